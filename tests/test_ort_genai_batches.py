"""og.Generator static batches of the ORT GenAI engine process (``backends/ort_genai/generator_batch.py``).

The real engine (onnxruntime-genai 0.18.0 in its environment) on the trained fixture's fp32
export: each row of a right-padded batch gets the tokens and logprobs its prompt gets alone;
a prompt that ends with the pad id, and an empty one, are set aside (og would take a trailing
pad for padding) without failing their batch; a restart takes in a wave's late arrivals.
The engine object is a stand-in holding the attributes the module reads (named ``Engine``
below); og, the export and the module's code are real.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from pathlib import Path

import pytest

from adapters.ort_genai_export import ExportOptions, env_spec, export
from bakeoff.host import envs
from tests.test_ort_genai import PROMPTS_FALLBACK, tiny_qwen3  # noqa: F401 - the session fixture

REPO = Path(__file__).resolve().parent.parent

SCRIPT = r"""
import contextlib, json, sys
import numpy as np
import onnxruntime_genai as og
from backends.ort_genai import generator_batch as gb
d, bodies = sys.argv[1], json.loads(sys.argv[2])
frames, order = {}, []
def send(msg, urgent=False):
    order.append((msg[0], msg[1]))
    if msg[0] == "tok":
        ids = np.frombuffer(msg[2], dtype=np.int32).tolist()
        frames.setdefault(msg[1], {"ids": [], "lps": [], "end": None})
        frames[msg[1]]["ids"] += ids
        if len(msg) > 4:
            frames[msg[1]]["lps"] += [lp for lp, _ in msg[4]]
    elif msg[0] in ("end", "err"):
        frames.setdefault(msg[1], {"ids": [], "lps": [], "end": None})["end"] = msg[0] + ":" + str(msg[2])
class Engine:  # the attributes generator_batch reads of an OrtGenaiEngine
    def __init__(s):
        c = og.Config(d); c.clear_providers(); s.model = og.Model(c)
        g = json.load(open(d + "/genai_config.json"))["model"]
        eos = g["eos_token_id"]
        s.og, s.np, s.tokenizer_json, s.cancelled, s.paged = og, np, "x", set(), False
        s.eos_ids, s.pad_id = set(eos if isinstance(eos, list) else [eos]), g["pad_token_id"]
        s.stream_interval_s, s.max_batch, s.inbox, s.context_length = 0.0, 16, gb.Inbox(), 4096
        s.decode_steps = s.restarts = s.logprobs_rows_max = s.max_running = s.wave_waits = 0
        s.wave = None
        s.own_s = s.og_s = 0.0
        s.tok = og.Tokenizer(s.model)
    def encode(s, p):
        if p.startswith("IDS:"):
            return [int(x) for x in p[4:].split(",") if x]
        return [int(t) for t in s.tok.encode(p)]
    def stats(s): return {}
    def search_options(s, body, n):
        o = {"max_length": n + int(body["max_tokens"]), "do_sample": False}
        if body.get("ignore_eos"): o["min_length"] = o["max_length"]
        return o
e = Engine()
if "PAD" in json.dumps(bodies):
    bodies = json.loads(json.dumps(bodies).replace("PAD", str(e.pad_id)))
alone = {}
def drain():  # what the engine's serve loop does next: the requests left waiting, batch by batch
    while not e.inbox.empty():
        item = e.inbox.get()
        if gb.TOKENIZE in item[1]:
            gb.answer_tokenize(e, send, item[0], item[1][gb.TOKENIZE])
        else:
            gb.run_batch(e, gb.take_batch(e, item), send, contextlib.nullcontext)
for i, b in enumerate(bodies):
    gb.run_batch(e, [(f"a{i}", b)], send, contextlib.nullcontext)
# together: the first request starts the batch, the others wait in the inbox
for i, b in enumerate(bodies[1:], 1):
    e.inbox.put((f"b{i}", b))
gb.run_batch(e, gb.take_batch(e, ("b0", bodies[0])), send, contextlib.nullcontext)
drain()
# a wave: one request alone starts, the rest arrive at its first step (the inbox is filled by
# the step's frame sender here) and the young batch restarts to take them in
wave = [dict(b, max_tokens=6) for b in bodies if not b["prompt"].startswith("IDS:")]
pending = [(f"w{i}", b) for i, b in enumerate(wave[1:], 1)]
def wave_send(msg, urgent=False):
    send(msg, urgent)
    while pending:
        e.inbox.put(pending.pop())
restarts = e.restarts
if wave:
    gb.run_batch(e, [("w0", wave[0])], wave_send, contextlib.nullcontext)
    drain()
wave_restarts = e.restarts - restarts
# the same wave plus a tokenize request: answered between the batch's steps, before it ends
pending = [(f"t{i}", b) for i, b in enumerate(wave[1:], 1)] + [("tok0", {"__tokenize__": "hello"})]
pending = [(rid, {gb.TOKENIZE: b["__tokenize__"]} if "__tokenize__" in b else b) for rid, b in pending]
if wave:
    gb.run_batch(e, [("t0", wave[0])], wave_send, contextlib.nullcontext)
    drain()
# rows that end on one step leave a wave behind: their clients come back together (take_batch waits for them)
together = [(f"z{i}", dict(b, max_tokens=3, ignore_eos=True)) for i, b in enumerate(wave[:3])]
e.wave = None
if together:
    gb.run_batch(e, together, send, contextlib.nullcontext)
    wave_together = e.wave[0] if e.wave else None
    # a session left out of a batch (its request waited through it) is part of the next wave
    e.inbox.put(("late", dict(wave[0], max_tokens=3, ignore_eos=True)))
    gb.run_batch(e, [(f"y{i}", b) for i, (_, b) in enumerate(together)], send, contextlib.nullcontext)
print(json.dumps({"frames": frames, "order": order, "restarts": wave_restarts, "rows_max": e.logprobs_rows_max,
                  "running_max": e.max_running, "n": len(bodies), "wave": len(wave), "all_restarts": e.restarts,
                  "wave_after": wave_together if together else None, "together": len(together),
                  "wave_with_late": e.wave[0] if together and e.wave else None}))
"""


@pytest.fixture(scope="module")
def fp32_export(tiny_qwen3):
    envs.ensure(env_spec(), print)
    return export(tiny_qwen3, ExportOptions(precision="fp32"), log=print).output_dir


def _prompts(model: Path, n: int) -> list[str]:
    """``n`` probe prompts of the fixture (different lengths), else the fallback prompts varied."""
    probes = model / "probes.jsonl"
    if probes.is_file():
        return [json.loads(x)["prompt"] for x in probes.read_text().splitlines() if x.strip()][:n]
    return [PROMPTS_FALLBACK[i % len(PROMPTS_FALLBACK)] + " x" * i for i in range(n)]


def _run(export_dir: str, bodies: list[dict], context_length: int = 4096) -> dict:
    py = envs.ensure(env_spec(), print)
    script = SCRIPT.replace("gb.Inbox(), 4096", f"gb.Inbox(), {context_length}")
    out = subprocess.run([str(py), "-c", script, export_dir, json.dumps(bodies)], capture_output=True, text=True,
                         timeout=300, cwd=REPO, env=envs.child_env())
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.splitlines()[-1])


def test_batched_rows_match_each_alone_and_odd_prompts_run_aside(tiny_qwen3, fp32_export):
    prompts = _prompts(tiny_qwen3, 6)
    bodies = [{"prompt": p, "max_tokens": 4 + 3 * i, "logprobs": 3} for i, p in enumerate(prompts)]
    bodies += [{"prompt": "", "max_tokens": 5, "logprobs": 3},  # empty: og refuses it, alone
               {"prompt": "IDS:5,6,PAD", "max_tokens": 5, "logprobs": 3}]  # ends with the pad id: aside
    r = _run(fp32_export, bodies)
    f = r["frames"]
    assert f[f"b{len(bodies) - 2}"]["end"].startswith("err:")  # the empty prompt fails alone ...
    assert f[f"b{len(bodies) - 1}"]["end"].startswith("end:")  # ... not the row set aside after it
    for i in [*range(len(bodies) - 2), len(bodies) - 1]:
        assert f[f"b{i}"]["ids"] == f[f"a{i}"]["ids"] and f[f"a{i}"]["ids"], (i, f[f"a{i}"], f[f"b{i}"])
        assert f[f"b{i}"]["end"] == f[f"a{i}"]["end"] and f[f"a{i}"]["end"].startswith("end:")
        assert max(abs(x - y) for x, y in zip(f[f"a{i}"]["lps"], f[f"b{i}"]["lps"])) < 1e-4
    assert len(f["a0"]["ids"]) == 4 and len(f["a5"]["ids"]) <= 19
    assert f[f"b{len(bodies) - 2}"]["end"] == f[f"a{len(bodies) - 2}"]["end"]  # the empty prompt: as alone
    assert r["rows_max"] == len(bodies) - 2  # the two odd prompts were not in the batch


def test_a_young_batch_restarts_for_a_wave_and_answers_tokenize_between_steps(tiny_qwen3, fp32_export):
    prompts = _prompts(tiny_qwen3, 8)
    r = _run(fp32_export, [{"prompt": p, "max_tokens": 6} for p in prompts])
    f = r["frames"]
    assert r["restarts"] == 1 and r["running_max"] == len(prompts)
    assert r["together"] == 3 and r["wave_after"] == 3  # three rows that ended on one step: a wave of three
    # three rows and the request that waited through their batch: the next batch waits for all four
    assert r["wave_with_late"] == 4
    for i in range(r["wave"]):  # rows continue after the restart (the fixture's fp32 export: the same tokens)
        want = f[f"a{i}"]["ids"][:6]
        assert f[f"w{i}"]["ids"] == want and f[f"w{i}"]["end"].startswith("end:"), (i, f[f"w{i}"], want)
    order = [tuple(x) for x in r["order"]]
    t_ends = [i for i, x in enumerate(order) if x[0] == "end" and str(x[1]).startswith("t")]
    assert len(t_ends) == r["wave"] and order.index(("ids", "tok0")) < min(t_ends)  # not after the batch


def test_a_logprobs_wave_never_restarts_and_sampled_arrivals_restart_nothing(tiny_qwen3, fp32_export):
    """Probes get what each gets alone whenever they arrive (a restart's prefill is not
    bit-equal to the steps it replaces); requests that could not join restart nothing."""
    prompts = _prompts(tiny_qwen3, 8)
    r = _run(fp32_export, [{"prompt": p, "max_tokens": 6, "logprobs": 2} for p in prompts])
    assert r["all_restarts"] == 0
    for i in range(r["wave"]):
        assert r["frames"][f"w{i}"]["lps"] == r["frames"][f"a{i}"]["lps"][:6]
    sampled = [{"prompt": p, "max_tokens": 6, "temperature": 0.8, "seed": i} for i, p in enumerate(prompts)]
    r = _run(fp32_export, [{"prompt": prompts[0], "max_tokens": 6}] + sampled[1:])
    assert r["all_restarts"] == 0


def test_rows_that_fit_the_context_alone_do_not_fail_together(fp32_export):
    """A long prompt with few tokens and a short prompt with many: together the batch's
    max_length would pass the context; the second runs after the first instead."""
    ctx = json.loads((Path(fp32_export) / "genai_config.json").read_text())["model"]["context_length"]
    long_ids = ",".join(str(5 + i % 50) for i in range(ctx - 32))
    bodies = [{"prompt": f"IDS:{long_ids}", "max_tokens": 4, "ignore_eos": True, "logprobs": 1},
              {"prompt": "IDS:7,8,9", "max_tokens": 40, "ignore_eos": True, "logprobs": 1}]
    r = _run(fp32_export, bodies, context_length=ctx)
    f = r["frames"]
    assert f["b0"]["end"] == f["a0"]["end"] and f["b0"]["ids"] == f["a0"]["ids"]
    assert f["b1"]["end"] == "end:length" and f["b1"]["ids"] == f["a1"]["ids"] and len(f["b1"]["ids"]) == 40


def _waiting_engine(wave_rows: int, body: dict):
    """The attributes :func:`take_batch` reads, after a batch whose ``wave_rows`` rows ended just now."""
    from types import SimpleNamespace

    from backends.ort_genai import generator_batch as gb

    return SimpleNamespace(paged=False, max_batch=16, inbox=gb.Inbox(), wave_waits=0, wave_gap_s=None,
                           wave=(wave_rows, time.perf_counter(), gb.batch_key(body), 0))


def test_the_next_wave_after_a_batch_that_ended_together_is_waited_for_not_restarted(monkeypatch):
    """Closed-loop clients whose streams ended on one step send their next requests over a few
    milliseconds: the first to arrive waits (up to WAVE_WAIT_S) for the rest, and they start as one
    batch instead of a batch of one that the others restart."""
    from backends.ort_genai import generator_batch as gb

    monkeypatch.setattr(gb, "WAVE_WAIT_S", 30.0)  # generous: a loaded host's timer fires late
    body = {"prompt": "x", "max_tokens": 4, "ignore_eos": True}
    e = _waiting_engine(4, body)
    waiting, real_wait = threading.Event(), e.inbox.wait_wave

    def wait_wave(*args):  # the real wait; the wave is sent once it began
        waiting.set()
        return real_wait(*args)

    e.inbox.wait_wave = wait_wave
    threading.Thread(target=lambda: waiting.wait(20) and [e.inbox.put((f"r{i}", body)) for i in range(1, 4)],
                     daemon=True).start()
    t0 = time.perf_counter()
    got = gb.take_batch(e, ("r0", body))
    assert [rid for rid, _ in got] == ["r0", "r1", "r2", "r3"] and e.wave_waits == 1 and e.wave is None
    assert time.perf_counter() - t0 < 20  # it returned when the wave was in, not at the deadline
    # the wave is used once: the next batch does not wait again
    e.inbox.put(("s1", body))
    assert [rid for rid, _ in gb.take_batch(e, ("s0", body))] == ["s0", "s1"] and e.wave_waits == 1


def test_a_wave_that_does_not_come_costs_at_most_the_wait_and_other_requests_never_wait(monkeypatch):
    from backends.ort_genai import generator_batch as gb

    monkeypatch.setattr(gb, "WAVE_WAIT_S", 0.2)
    body = {"prompt": "x", "max_tokens": 4, "ignore_eos": True}
    e = _waiting_engine(4, body)
    ended = e.wave[1]
    assert gb.take_batch(e, ("r0", body)) == [("r0", body)]
    assert time.perf_counter() - ended >= 0.19 and e.wave_waits == 1  # waited for the wave, then went alone
    # a wave whose time is over is not waited for, nor counted
    e = _waiting_engine(4, body)
    e.wave = (4, e.wave[1] - 1.0, e.wave[2], 0)
    assert gb.take_batch(e, ("r0", body)) == [("r0", body)] and e.wave_waits == 0 and e.wave is None
    monkeypatch.setattr(gb, "WAVE_WAIT_S", 30.0)
    for wave_rows, other in ((4, dict(body, ignore_eos=False)), (4, dict(body, logprobs=2)), (1, body)):
        e = _waiting_engine(wave_rows, body)
        t0 = time.perf_counter()
        assert gb.take_batch(e, ("q", other)) == [("q", other)]  # another batch key, or a wave of one
        assert time.perf_counter() - t0 < 10 and e.wave_waits == 0


def test_a_wave_that_stops_coming_is_waited_for_a_silence_of_a_few_of_its_gaps_not_the_whole_wait(monkeypatch):
    """Once a wave came whole, the next wait ends after a silence of WAVE_QUIET_FACTOR times that
    wave's longest gap between arrivals: a closed loop's last, smaller wave costs milliseconds,
    not WAVE_WAIT_S (60 ms of the fixture's 100 ms timed run)."""
    from backends.ort_genai import generator_batch as gb

    monkeypatch.setattr(gb, "WAVE_WAIT_S", 30.0)
    body = {"prompt": "x", "max_tokens": 4, "ignore_eos": True}
    e = _waiting_engine(4, body)

    def arrive(ids, gap_s):  # the rest of the wave, one every gap_s
        for rid in ids:
            time.sleep(gap_s)
            e.inbox.put((rid, body))

    threading.Thread(target=arrive, args=(["r1", "r2", "r3"], 0.02), daemon=True).start()
    assert [rid for rid, _ in gb.take_batch(e, ("r0", body))] == ["r0", "r1", "r2", "r3"]
    assert e.wave_gap_s is not None and 0.015 < e.wave_gap_s < 5  # learnt from the whole wave
    # the next wave: two of four come, then silence; the wait ends a few gaps after the last one
    e.wave = (4, time.perf_counter(), gb.batch_key(body), 0)
    threading.Thread(target=arrive, args=(["s1", "s2"], 0.02), daemon=True).start()
    t0 = time.perf_counter()
    got = gb.take_batch(e, ("s0", body))
    took = time.perf_counter() - t0
    assert [rid for rid, _ in got] == ["s0", "s1", "s2"] and e.wave_waits == 2
    assert took < 10 and took >= 0.04 + gb.WAVE_QUIET_FACTOR * 0.015  # the arrivals, then a silence of a few gaps


def test_a_wave_whose_first_request_waited_through_the_batch_is_not_cut_before_its_clients_are_back(monkeypatch):
    """When a request waited through the batch, it is the next batch's first and no client of the
    batch is back yet: the silence counts from the first one back, not from the batch's end (a
    breaker's find: a learnt 3 ms silence ended the wait before the round trip, a batch of one)."""
    from backends.ort_genai import generator_batch as gb

    monkeypatch.setattr(gb, "WAVE_WAIT_S", 30.0)
    body = {"prompt": "x", "max_tokens": 4, "ignore_eos": True}
    e = _waiting_engine(8, body)
    e.wave, e.wave_gap_s = (8, time.perf_counter(), gb.batch_key(body), 1), 0.0005  # quiet: 3 ms
    threading.Thread(target=lambda: [time.sleep(0.03)] + [e.inbox.put((f"r{i}", body)) for i in range(1, 8)],
                     daemon=True).start()  # the seven clients back after 30 ms, at once
    got = gb.take_batch(e, ("waited", body))
    assert [rid for rid, _ in got] == ["waited"] + [f"r{i}" for i in range(1, 8)]
