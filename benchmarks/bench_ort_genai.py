"""ORT GenAI decode speed: INT4 vs fp32 export, and the worker's overhead over a bare loop.

Prints figures; asserts nothing about speed. Target (issue 3): the worker keeps >= 97% of a
bare ``og.Generator`` loop's tokens/s, measured on the same export, same prompt, same
intra-op thread count, one request at a time, ``ignore_eos`` so every run decodes exactly
``--tokens`` tokens. Each round runs the bare loop, then the worker in generator and engine
mode at each ``--intervals`` value (``stream_interval_ms``); a round's worker/bare ratio is
one sample, and the median of the samples is printed with each round's value, because
single processes on a small shared host vary by tens of percent.

Usage:
    .venv/bin/python benchmarks/bench_ort_genai.py [--model FOLDER] [--tokens 1500] [--runs 3] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from adapters.ort_genai_export import ExportOptions, env_spec, export  # noqa: E402
from bakeoff import envs  # noqa: E402

BARE_LOOP = r"""
import json, sys, time
import onnxruntime_genai as og
model_dir, prompt, n_tok, runs, threads = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
config = og.Config(model_dir)
config.clear_providers()
if threads:
    config.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": threads}}}}))
model = og.Model(config)
tok = og.Tokenizer(model)
ids = tok.encode(prompt)
rates = []
for r in range(runs + 1):
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(ids) + n_tok, min_length=len(ids) + n_tok, do_sample=False)
    gen = og.Generator(model, params)
    gen.append_tokens(ids)
    t0 = time.perf_counter(); first = None; n = 0
    while not gen.is_done():
        gen.generate_next_token()
        gen.get_next_tokens()
        n += 1
        if first is None:
            first = time.perf_counter()
    t1 = time.perf_counter()
    if r:  # run 0 is warm-up
        rates.append((n - 1) / (t1 - first))
print(json.dumps({"decode_tok_s": rates, "tokens": n}))
"""


def bare_loop(python: Path, model_dir: str, prompt: str, tokens: int, runs: int, threads: int | None) -> list[float]:
    """Decode tokens/s (after the first token) of a bare og.Generator loop, per run."""
    out = subprocess.run([str(python), "-c", BARE_LOOP, model_dir, prompt, str(tokens), str(runs), str(threads or 0)],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["decode_tok_s"]


def worker_rates(model: Path, precision: str, batching: str, prompt: str, tokens: int, runs: int,
                 threads: int | None, interval_ms: float) -> list[float]:
    """Decode tokens/s (after the first token, client timestamps) through the worker's HTTP stream."""
    from backends import resolve
    from bakeoff.specs import BackendConfig, GenerationRequest

    with tempfile.TemporaryDirectory() as wd:
        b = resolve("ort-genai")(BackendConfig(backend="ort-genai", model=str(model), workdir=wd,
                                               options={"precision": precision, "batching": batching,
                                                        "intra_op_num_threads": threads,
                                                        "stream_interval_ms": interval_ms}))
        try:
            b.start()

            async def go() -> list[float]:
                rates = []
                for r in range(runs + 1):
                    times, counts = [], []
                    req = GenerationRequest(request_id=str(r), prompt=prompt, max_tokens=tokens, ignore_eos=True)
                    async for ev in b.stream(req):
                        if ev.token_ids:  # an event may carry several tokens (coalesced)
                            times.append(ev.t_ns)
                            counts.append(len(ev.token_ids))
                    if r:
                        rates.append((sum(counts) - counts[0]) / ((times[-1] - times[0]) / 1e9))
                await b.aclose()
                return rates

            return asyncio.run(go())
        finally:
            b.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint folder (default: the tiny-qwen3 fixture)")
    ap.add_argument("--tokens", type=int, default=1500, help="decoded tokens per run (the fixture's context is 2048)")
    ap.add_argument("--runs", type=int, default=3, help="runs per process (median taken)")
    ap.add_argument("--rounds", type=int, default=5,
                    help="alternations of bare loop and worker; each round's worker/bare ratio is one sample")
    ap.add_argument("--prompt", default="count: 15 16 17 18")
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads for both (0: ORT's default)")
    ap.add_argument("--intervals", type=lambda v: [float(x) for x in v.split(",")], default=[0.0, 2.0],
                    help="worker stream_interval_ms values to compare (comma-separated)")
    args = ap.parse_args()
    if args.model:
        model = Path(args.model)
    else:
        from bakeoff.fixtures import build

        model = Path(build("tiny-qwen3"))
    python = envs.ensure(env_spec(), print)
    print(f"model {model}, {args.tokens} tokens/run, {args.runs} runs (+1 warm-up) per process, median decode tok/s; "
          f"bare loop and workers alternate {args.rounds} times")
    for precision in ("int4", "fp32"):
        res = export(model, ExportOptions(precision=precision), log=lambda s: None)
        threads = args.threads or None
        variants = [(b, i) for b in ("generator", "engine") for i in args.intervals]
        bare: list[float] = []
        work: dict[tuple, list[float]] = {v: [] for v in variants}
        paired: dict[tuple, list[float]] = {v: [] for v in variants}
        for _ in range(args.rounds):  # alternate so drift of a shared host hits all alike
            b = statistics.median(bare_loop(python, res.output_dir, args.prompt, args.tokens, args.runs, threads))
            bare.append(b)
            for batching, interval in variants:
                w = statistics.median(worker_rates(model, precision, batching, args.prompt, args.tokens, args.runs,
                                                   threads, interval))
                work[(batching, interval)].append(w)
                paired[(batching, interval)].append(w / b)
        print(f"{precision:5s} export {res.duration_s:6.1f} s {res.output_bytes / 1e6:5.2f} MB | intra-op threads "
              f"{threads or 'ORT default'} | bare og.Generator {statistics.median(bare):7.1f} tok/s", flush=True)
        for (batching, interval), rates in work.items():
            r = paired[(batching, interval)]
            print(f"      worker[{batching:9s} stream_interval_ms={interval:g}] {statistics.median(rates):7.1f} tok/s | "
                  f"paired ratio to bare: median {100 * statistics.median(r):5.1f}% "
                  f"(rounds {', '.join(f'{x * 100:.0f}' for x in r)})", flush=True)


if __name__ == "__main__":
    t0 = time.monotonic()
    main()
    print(f"total {time.monotonic() - t0:.0f} s")
