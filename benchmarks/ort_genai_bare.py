"""A bare ONNX Runtime GenAI loop: the engine's own API, nothing of bakeoff around it (issue 28).

The yardstick for bakeoff's ORT GenAI figures (``benchmarks/bench_fidelity.py`` imports
:class:`BareOrtGenai`; this file also runs alone). One process in the ort-genai environment loads
the export once and runs, per command, ``sessions`` x ``requests_per_session`` greedy requests of
exactly ``max_tokens`` tokens (EOS ignored, as bakeoff's sweep asks) over the prompts given, in
one of two shapes:

- ``generator``: each turn, the sessions' prompts as ONE ``og.Generator`` batch (right-padded
  with ``pad_token_id``, og's own ``Tokenizer.encode_batch`` layout): the static batch an
  offline user would run (issue 28's "bare og.Generator batch 8"). A paged export cannot be fed
  to ``og.Generator`` (1-D ids): refused with that reason.
- ``engine``: ``og.Engine`` with ``sessions`` requests in flight, each session beginning its
  next request when its last ends (bakeoff's closed loop), each request's session capped at its
  prompt plus ``max_tokens`` (``RequestOptions.set_max_session_tokens``, as bakeoff's worker):
  how a server built on og.Engine runs. Continuous with a paged export, static batches of 4
  otherwise (:mod:`backends.ort_genai.og_engine`).

Figures: output tok/s = output tokens / wall time from the first request's start to the last
one's end (bakeoff's sweep point definition, ``bakeoff/loadgen/stats.py`` ``summarize``), TTFT
p50 from each request's start to its first token (an ``og.Generator`` batch: its first step),
TPOT p50 from the first token to the last, per token after the first.
The tokenizer is ``og.Tokenizer`` (the engine's own), else the export's ``tokenizer.json``.

Usage:
    .venv/bin/python benchmarks/ort_genai_bare.py --run artifacts/runs/<ort-genai run>
        bare loops on the run's export, prompts, output length and session counts, beside the
        run's sweep figures, with ratios (bakeoff / bare engine's best)
    .venv/bin/python benchmarks/ort_genai_bare.py --export EXPORT_DIR --sessions 1,8 --max-tokens 32
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

BARE_CHILD = r"""
import json, os, sys, time
import numpy as np
import onnxruntime_genai as og
model_dir, ep, threads = sys.argv[1], sys.argv[2], int(sys.argv[3])
config = og.Config(model_dir)
config.clear_providers()
if ep != "cpu":
    config.append_provider(ep)
if threads:
    config.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": threads}}}}))
model = og.Model(config)
with open(os.path.join(model_dir, "genai_config.json")) as fh:
    gcfg = json.load(fh)
paged = isinstance((gcfg.get("engine") or {}).get("dynamic_batching"), dict)
pad = gcfg["model"].get("pad_token_id") or 0
pad = pad[0] if isinstance(pad, list) else pad
try:
    tok = og.Tokenizer(model)
    encode = lambda p: [int(t) for t in tok.encode(p)]
except Exception:
    from tokenizers import Tokenizer
    hf = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    encode = lambda p: hf.encode(p).ids
engine = og.Engine(model)
buf = engine.create_event_buffer(1024)
TOKEN, FAILED = int(og.EngineEventFlags.TOKEN.value), int(og.EngineEventFlags.FAILED.value)
clock = time.perf_counter

def generator(prompts, max_tokens, sessions, rounds):
    if paged:
        return {"error": "og.Generator cannot feed a PagedAttention export (1-D input_ids); use the engine kind"}
    n_out, ttfts, tpots, t0 = 0, [], [], clock()
    for turn in range(rounds):
        ids = [encode(prompts[s][turn]) for s in range(sessions)]
        width = max(len(x) for x in ids)
        params = og.GeneratorParams(model)
        params.set_search_options(batch_size=sessions, max_length=width + max_tokens, min_length=width + max_tokens,
                                  do_sample=False)
        t_req = clock()
        gen = og.Generator(model, params)
        gen.append_tokens(np.asarray([x + [pad] * (width - len(x)) for x in ids], dtype=np.int32))
        steps = 0
        while not gen.is_done() and steps < max_tokens:
            gen.generate_next_token()
            steps += 1
            if steps == 1:
                t_first = clock()
                ttfts += [(t_first - t_req) * 1e3] * sessions
        if steps > 1:
            tpots += [(clock() - t_first) * 1e3 / (steps - 1)] * sessions
        n_out += steps * sessions
        del gen
    return {"output_tokens": n_out, "wall_s": clock() - t0, "ttft_ms": ttfts, "tpot_ms": tpots}

def engine_loop(prompts, max_tokens, sessions, rounds):
    live, n_out, ttfts, tpots, steps, t0 = {}, 0, [], [], 0, clock()
    def begin(s, turn):
        ids = encode(prompts[s][turn])
        ro = og.RequestOptions()
        ro.set_max_session_tokens(len(ids) + max_tokens)
        req = engine.create_request(options=ro)
        to = og.TurnOptions(req)
        to.set_do_sample(False); to.set_max_generated_tokens(max_tokens); to.set_min_generated_tokens(max_tokens)
        req.begin_turn(np.asarray(ids, dtype=np.int32), to)
        live[id(req)] = [req, s, turn, clock(), None, 0]
    for s in range(sessions):
        begin(s, 0)
    while live:
        steps += 1
        for ev in engine.run(buf) or ():
            e = live.get(id(ev.request))
            if e is None:
                continue
            flags = int(ev.flags.value)
            if flags & FAILED:
                return {"error": f"og.Engine request failed: error_code={ev.error_code}"}
            if flags & TOKEN:
                n_out += 1
                e[5] += 1
                if e[4] is None:
                    e[4] = clock()
                    ttfts.append((e[4] - e[3]) * 1e3)
            if ev.finish_reason != og.FinishReason.NONE:
                del live[id(ev.request)]
                e[0].close()
                if e[5] > 1:
                    tpots.append((clock() - e[4]) * 1e3 / (e[5] - 1))
                if e[2] + 1 < rounds:
                    begin(e[1], e[2] + 1)
    return {"output_tokens": n_out, "wall_s": clock() - t0, "ttft_ms": ttfts, "tpot_ms": tpots,
            "tokens_per_step": round(n_out / steps, 2) if steps else None,
            "configured_max_batch_size": engine.get_capabilities().configured_max_batch_size}

print(json.dumps({"ready": True, "paged": paged, "version": og.__version__}), flush=True)
for line in sys.stdin:
    cmd = json.loads(line)
    fn = generator if cmd["kind"] == "generator" else engine_loop
    try:
        c0 = time.process_time()
        out = fn(cmd["prompts"], cmd["max_tokens"], cmd["sessions"], cmd["rounds"])
        out["cpu_s"] = time.process_time() - c0
    except Exception as exc:
        out = {"error": f"{type(exc).__name__}: {exc}"}
    print(json.dumps(out), flush=True)
"""


class BareOrtGenai:
    """One process in the ort-genai environment holding an export, running bare loops on demand.

    Args:
        export_dir: the export folder (``genai_config.json``); a bakeoff run's is in its
            ``engine/export.json`` (``output_dir``).
        execution_provider: ``cpu`` or ``cuda`` (as the export was built).
        threads: decoder intra-op threads (0: ORT's default, as bakeoff's worker unless set).
        python: the interpreter (default: the ort-genai environment's, made if missing).
        huge_pages: the ort-genai backend's default (bakeoff/host/hugepages.py), so the loop runs as its engine.
    """

    def __init__(self, export_dir: str | Path, execution_provider: str = "cpu", threads: int = 0,
                 python: str | Path | None = None, huge_pages: bool = False):
        if python is None:
            from adapters.ort_genai_export import env_spec
            from bakeoff.host import envs

            python = envs.ensure(env_spec(), print)
        from bakeoff.host import hugepages

        # the engine's own loop on the pages bakeoff's engine processes get (bakeoff/host/hugepages.py)
        self.proc = subprocess.Popen([str(python), "-c", BARE_CHILD, str(export_dir), execution_provider, str(threads)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env={**os.environ, **hugepages.engine_env(wanted=huge_pages)[0]})
        ready = json.loads(self.proc.stdout.readline() or "{}")
        if not ready.get("ready"):
            raise RuntimeError(f"the bare ORT GenAI loop did not start (exit {self.proc.poll()})")
        self.paged, self.version = bool(ready["paged"]), ready["version"]

    def run(self, kind: str, prompts: list[list[str]], max_tokens: int, sessions: int, rounds: int) -> dict[str, Any]:
        """One measurement.

        Args:
            kind: ``generator`` or ``engine`` (module docstring).
            prompts: ``prompts[session][turn]``, at least ``sessions`` x ``rounds``.
            max_tokens: output tokens per request (exactly: EOS ignored).
            sessions: concurrency (the generator's batch size).
            rounds: requests per session.

        Returns:
            ``output_tokens``, ``wall_s``, ``output_tokens_per_s``, ``ttft_p50_ms``, ``tpot_p50_ms``
            (or ``error``).
        """
        self.proc.stdin.write(json.dumps({"kind": kind, "prompts": prompts, "max_tokens": max_tokens,
                                          "sessions": sessions, "rounds": rounds}) + "\n")
        self.proc.stdin.flush()
        out = json.loads(self.proc.stdout.readline() or '{"error": "the bare loop process died"}')
        if "error" not in out:
            import numpy as np

            out["output_tokens_per_s"] = out["output_tokens"] / out["wall_s"]
            for key in ("ttft", "tpot"):
                vals = out.pop(f"{key}_ms", None)
                out[f"{key}_p50_ms"] = float(np.percentile(vals, 50)) if vals else None
        return {"kind": kind, "sessions": sessions, **out}

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def sweep_prompts(fixture: bool, sessions: int, rounds: int) -> list[list[str]]:
    """bakeoff's throughput prompts, ``[session][turn]`` (``evaluations/probing.py`` ``throughput_prompt``)."""
    from evaluations.probing import throughput_prompt

    return [[throughput_prompt(s, t, fixture) for t in range(rounds)] for s in range(sessions)]


def bare_points(bare: BareOrtGenai, sessions: list[int], max_tokens: int, rounds: int, fixture: bool,
                kinds: tuple[str, ...] = ("generator", "engine"), warmup: bool = True) -> list[dict[str, Any]]:
    """Bare figures per session count and kind (after one untimed pass of each kind)."""
    prompts = sweep_prompts(fixture, max(sessions), rounds)
    if warmup:
        for kind in kinds:
            bare.run(kind, prompts, min(max_tokens, 8), 1, 1)
    return [bare.run(kind, prompts, max_tokens, n, rounds) for n in sessions for kind in kinds]


def run_threads(run_dir: Path, run: dict[str, Any]) -> int:
    """The decoder threads a run's worker used: its option, else the count its notes state
    (``evidence/load/backend_info.json``, e.g. ``"1 (bakeoff's CPU default: ...)"``), else 0 (ORT's default)."""
    if run["options"].get("intra_op_num_threads"):
        return int(run["options"]["intra_op_num_threads"])
    try:
        note = json.loads((run_dir / "evidence" / "load" / "backend_info.json").read_text())["notes"]["intra_op_num_threads"]
        return int(str(note).split()[0])
    except (OSError, KeyError, ValueError, IndexError):
        return 0


def compare_run(run_dir: Path, threads: int, kinds: tuple[str, ...]) -> None:
    """Print a run's sweep beside bare loops on its export (ratios against the best bare kind)."""
    run = json.loads((run_dir / "run.json").read_text())
    export = json.loads((run_dir / "engine" / "export.json").read_text())
    sweep = json.loads((run_dir / "checks" / "throughput.sweep.json").read_text())["values"]["points"]
    prof = run["profile_settings"]
    fixture = str(run.get("model", "")).startswith("fixture:")
    ep = export["options"]["execution_provider"]
    bare = BareOrtGenai(export["output_dir"], ep, threads or run_threads(run_dir, run))
    try:
        rows = bare_points(bare, [p["sessions"] for p in sweep], prof["max_tokens"], prof["requests_per_session"],
                           fixture, kinds)
    finally:
        bare.close()
    print(f"{run_dir.name}: onnxruntime-genai {bare.version}, {ep}, paged export: {bare.paged}, "
          f"{prof['max_tokens']} tokens x {prof['requests_per_session']} requests per session")
    print(f"{'sessions':>8} {'bakeoff tok/s':>14} " + " ".join(f"{'bare ' + k + ' tok/s':>22}" for k in kinds)
          + f" {'ratio to best':>14} {'TTFT p50 ms bakeoff / bare':>28}")
    for p in sweep:
        mine = [r for r in rows if r["sessions"] == p["sessions"]]
        ok = [r for r in mine if "error" not in r]
        best = max(ok, key=lambda r: r["output_tokens_per_s"]) if ok else None
        cells = " ".join(f"{r['output_tokens_per_s']:>22.1f}" if "error" not in r else f"{'n/a':>22}" for r in mine)
        ratio = p["output_tokens_per_s"] / best["output_tokens_per_s"] if best and p.get("output_tokens_per_s") else None
        ttft = f"{p.get('ttft_p50_ms') or 0:.1f} / {best['ttft_p50_ms'] or 0:.1f} ({best['kind']})" if best else "-"
        print(f"{p['sessions']:>8} {p.get('output_tokens_per_s') or 0:>14.1f} {cells} "
              f"{'-' if ratio is None else f'{ratio:.2f}':>14} {ttft:>28}")
    for r in rows:
        if "error" in r:
            print(f"  bare {r['kind']} at {r['sessions']} sessions: {r['error']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", type=Path, help="a bakeoff ort-genai run directory: compare its sweep with bare loops")
    ap.add_argument("--export", type=Path, help="an export folder: bare loops only")
    ap.add_argument("--execution-provider", default="cpu")
    ap.add_argument("--sessions", default="1,8", help="comma-separated session counts (--export)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--requests-per-session", type=int, default=2)
    ap.add_argument("--fixture", action=argparse.BooleanOptionalAction, default=True,
                    help="bakeoff's fixture prompts (counting) or the generic ones (--export)")
    ap.add_argument("--threads", type=int, default=0, help="decoder intra-op threads (0: ORT's default / the run's)")
    ap.add_argument("--kinds", default="generator,engine")
    args = ap.parse_args()
    kinds = tuple(args.kinds.split(","))
    if args.run:
        compare_run(args.run, args.threads, kinds)
        return
    if not args.export:
        ap.error("pass --run RUN_DIR or --export EXPORT_DIR")
    bare = BareOrtGenai(args.export, args.execution_provider, args.threads)
    try:
        for r in bare_points(bare, [int(x) for x in args.sessions.split(",")], args.max_tokens,
                             args.requests_per_session, args.fixture, kinds):
            print(json.dumps(r))
    finally:
        bare.close()


if __name__ == "__main__":
    main()
