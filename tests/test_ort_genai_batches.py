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
from pathlib import Path

import pytest

from adapters.ort_genai_export import ExportOptions, env_spec, export
from bakeoff.host import envs
from tests.test_ort_genai import PROMPTS_FALLBACK, tiny_qwen3  # noqa: F401 - the session fixture

REPO = Path(__file__).resolve().parent.parent

SCRIPT = r"""
import contextlib, json, queue, sys
import numpy as np
import onnxruntime_genai as og
from backends.ort_genai import generator_batch as gb
d, bodies = sys.argv[1], json.loads(sys.argv[2])
frames = {}
def send(msg, urgent=False):
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
        s.stream_interval_s, s.max_batch, s.inbox = 0.0, 16, queue.SimpleQueue()
        s.decode_steps = s.restarts = s.logprobs_rows_max = s.max_running = 0
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
for i, b in enumerate(bodies):
    gb.run_batch(e, [(f"a{i}", b)], send, contextlib.nullcontext)
# together: the first request starts the batch, the others wait in the inbox
for i, b in enumerate(bodies[1:], 1):
    e.inbox.put((f"b{i}", b))
gb.run_batch(e, gb.take_batch(e, ("b0", bodies[0])), send, contextlib.nullcontext)
# a wave: one request alone starts, the rest arrive at its first step (the inbox is filled by
# the step's frame sender here) and the young batch restarts to take them in
wave = [dict(b, max_tokens=6) for b in bodies if not b["prompt"].startswith("IDS:")]
pending = [(f"w{i}", b) for i, b in enumerate(wave[1:], 1)]
def wave_send(msg, urgent=False):
    send(msg, urgent)
    while pending:
        e.inbox.put(pending.pop())
restarts = e.restarts
gb.run_batch(e, [("w0", wave[0])], wave_send, contextlib.nullcontext)
print(json.dumps({"frames": frames, "restarts": e.restarts - restarts, "rows_max": e.logprobs_rows_max,
                  "running_max": e.max_running, "n": len(bodies), "wave": len(wave)}))
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


def _run(export_dir: str, bodies: list[dict]) -> dict:
    py = envs.ensure(env_spec(), print)
    out = subprocess.run([str(py), "-c", SCRIPT, export_dir, json.dumps(bodies)], capture_output=True, text=True,
                         timeout=300, cwd=REPO, env=envs.child_env())
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.splitlines()[-1])


def test_batched_rows_match_each_alone_and_odd_prompts_run_aside(tiny_qwen3, fp32_export):
    prompts = _prompts(tiny_qwen3, 6)
    bodies = [{"prompt": p, "max_tokens": 4 + 3 * i, "logprobs": 3} for i, p in enumerate(prompts)]
    bodies += [{"prompt": "IDS:5,6,PAD", "max_tokens": 5, "logprobs": 3},  # ends with the pad id: aside
               {"prompt": "", "max_tokens": 5, "logprobs": 3}]  # empty: og refuses it, alone
    r = _run(fp32_export, bodies)
    f = r["frames"]
    for i in range(len(bodies) - 1):
        assert f[f"b{i}"]["ids"] == f[f"a{i}"]["ids"] and f[f"a{i}"]["ids"], (i, f[f"a{i}"], f[f"b{i}"])
        assert f[f"b{i}"]["end"] == f[f"a{i}"]["end"] and f[f"a{i}"]["end"].startswith("end:")
        assert max(abs(x - y) for x, y in zip(f[f"a{i}"]["lps"], f[f"b{i}"]["lps"])) < 1e-4
    assert len(f["a0"]["ids"]) == 4 and len(f["a5"]["ids"]) <= 19
    assert f[f"b{len(bodies) - 1}"]["end"] == f[f"a{len(bodies) - 1}"]["end"]  # the empty prompt: as alone
    assert r["rows_max"] == len(bodies) - 2  # the two odd prompts were not in the batch


def test_a_young_batch_restarts_for_a_wave(tiny_qwen3, fp32_export):
    prompts = _prompts(tiny_qwen3, 8)
    r = _run(fp32_export, [{"prompt": p, "max_tokens": 6} for p in prompts])
    f = r["frames"]
    assert r["restarts"] == 1 and r["running_max"] == len(prompts)
    for i in range(r["wave"]):  # rows continue after the restart: greedy, the same tokens as alone
        want = f[f"a{i}"]["ids"][:6]
        assert f[f"w{i}"]["ids"] == want and f[f"w{i}"]["end"].startswith("end:"), (i, f[f"w{i}"], want)
