"""ORT GenAI decode speed: INT4 vs fp32 export, and the worker's overhead over bare loops.

Prints figures; asserts nothing about speed. Target (issue 3): the worker keeps >= 97% of a
bare ``og.Generator`` loop's tokens/s, on the same export, prompt and intra-op thread count,
one request at a time, ``ignore_eos`` so every run decodes exactly ``--tokens`` tokens.

Method: every contender is loaded once and stays up (a bare-loop process that runs a loop per
command, and one worker per ``batching`` x ``stream_interval_ms``), then single runs alternate
``bare, worker A, bare, worker B, ...`` for ``--pairs`` cycles. Each worker run is divided by
the mean of the bare runs just before and after it: one paired sample. The median of the
samples is the figure; the 10th-90th percentile range beside it shows the spread, because a
small shared host drifts by tens of percent over minutes but little within one second.
Decode tokens/s counts tokens after the first and divides by the time from the first to the
last (engine-side clock for bare loops, client receive times for workers).

Bare loops: ``og.Generator`` (``generate_next_token`` / ``get_next_tokens``) and ``og.Engine``
(``create_request`` / ``begin_turn`` / ``run``), so the worker in engine mode is compared both
with what it must match and with the Engine's own cost.

Usage:
    .venv/bin/python benchmarks/bench_ort_genai.py [--model FOLDER] [--tokens 1500] [--pairs 15]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from adapters.ort_genai_export import ExportOptions, env_spec, export
from bakeoff.host import envs

BARE_SERVER = r"""
import json, sys, time
import numpy as np
import onnxruntime_genai as og
model_dir, prompt, threads = sys.argv[1], sys.argv[2], int(sys.argv[3])
config = og.Config(model_dir)
config.clear_providers()
if threads:
    config.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": threads}}}}))
model = og.Model(config)
tok = og.Tokenizer(model)
ids = tok.encode(prompt)
engine = og.Engine(model)
buf = engine.create_event_buffer(256)

clock = time.perf_counter

def generator(n_tok):
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(ids) + n_tok, min_length=len(ids) + n_tok, do_sample=False)
    gen = og.Generator(model, params)
    gen.append_tokens(ids)
    first = None; n = 0; own = og_s = 0.0; t_out = clock()
    while True:  # the same two clock reads per step as the worker's loop, for the own/og split
        t_in = clock()
        own += t_in - t_out
        if gen.is_done():
            break
        gen.generate_next_token()
        gen.get_next_tokens()
        t_out = clock()
        og_s += t_out - t_in
        n += 1
        if first is None:
            first = t_out
    return (n - 1) / (t_out - first), own / n, og_s / n

def engine_loop(n_tok):
    req = engine.create_request()
    to = og.TurnOptions(req)
    to.set_do_sample(False); to.set_max_generated_tokens(n_tok); to.set_min_generated_tokens(n_tok)
    req.begin_turn(np.asarray(ids, dtype=np.int32), to)
    first = None; n = 0; steps = 0; done = False; own = og_s = 0.0; t_out = None
    while not done:
        t_in = clock()
        if t_out is not None:
            own += t_in - t_out
        events = engine.run(buf)
        t_out = clock()
        og_s += t_out - t_in
        steps += 1
        for ev in events or ():
            if int(ev.flags.value) & token_flag:
                n += 1
                if first is None:
                    first = t_out
            if ev.finish_reason != og.FinishReason.NONE:
                done = True
    req.close()
    return (n - 1) / (t_out - first), own / steps, og_s / steps

token_flag = int(og.EngineEventFlags.TOKEN.value)
print("ready", flush=True)
for line in sys.stdin:
    kind, n_tok = line.split()
    print(json.dumps((generator if kind == "generator" else engine_loop)(int(n_tok))), flush=True)
"""


def pin(pid: int, cores: set[int]) -> None:
    """Every thread of ``pid`` onto ``cores`` (``sched_setaffinity`` of the pid moves only its main thread)."""
    import os

    for tid in os.listdir(f"/proc/{pid}/task"):
        os.sched_setaffinity(int(tid), cores)


class BareLoop:
    """A process in the ort-genai environment that runs one bare decode loop per command."""

    def __init__(self, python: Path, model_dir: str, prompt: str, threads: int | None):
        self.proc = subprocess.Popen([str(python), "-c", BARE_SERVER, model_dir, prompt, str(threads or 0)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline().strip() == "ready"
        self.pid = self.proc.pid

    def run(self, kind: str, tokens: int) -> float:
        """Decode tokens/s of one ``generator`` or ``engine`` loop."""
        return self.run_full(kind, tokens)[0]

    def run_full(self, kind: str, tokens: int) -> tuple[float, float, float]:
        """(decode tokens/s, own us... ) of one loop: tokens/s, own s/step, og s/step."""
        self.proc.stdin.write(f"{kind} {tokens}\n")
        self.proc.stdin.flush()
        return tuple(json.loads(self.proc.stdout.readline()))

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


class Worker:
    """The ort-genai backend (worker + engine process), kept up across runs."""

    def __init__(self, model: Path, precision: str, batching: str, threads: int | None, interval_ms: float):
        from backends import resolve
        from bakeoff.api.specs import BackendConfig

        self.tmp = tempfile.TemporaryDirectory()
        self.backend = resolve("ort-genai")(BackendConfig(
            backend="ort-genai", model=str(model), workdir=self.tmp.name,
            options={"precision": precision, "batching": batching, "intra_op_num_threads": threads,
                     "stream_interval_ms": interval_ms}))
        self.backend.start()
        self.engine_pid = self.backend.ready_payload["info"]["engine_process"]
        self.worker_pid = self.backend.ready_payload["pid"]

    def split(self) -> tuple[float, float, float]:
        """The engine process's counters: (own s, og s, steps) of its decode thread (``/metrics``)."""
        m = self.backend.metrics()
        return tuple(m.get(f"bakeoff_worker:decode_{k}_total", 0.0) for k in ("own_seconds", "og_seconds", "steps"))

    async def run(self, prompt: str, tokens: int) -> float:
        """Decode tokens/s of one request, from the client's receive times."""
        from bakeoff.api.specs import GenerationRequest

        times, counts = [], []
        req = GenerationRequest(request_id=str(time.monotonic_ns()), prompt=prompt, max_tokens=tokens,
                                ignore_eos=True)
        async for ev in self.backend.stream(req):
            if ev.token_ids:  # an event may carry several tokens (coalesced)
                times.append(ev.t_ns)
                counts.append(len(ev.token_ids))
        if sum(counts) != tokens:
            raise RuntimeError(f"worker streamed {sum(counts)} tokens, asked for {tokens}")
        return (sum(counts) - counts[0]) / ((times[-1] - times[0]) / 1e9)

    async def close(self) -> None:
        await self.backend.aclose()
        self.backend.stop()
        self.tmp.cleanup()


def spread(xs: list[float]) -> str:
    """Median and 10th-90th percentile of ratios, in percent."""
    p10, p50, p90 = np.percentile(np.asarray(xs) * 100, [10, 50, 90])
    return f"median {p50:5.1f}% (p10 {p10:5.1f}, p90 {p90:5.1f}, n={len(xs)})"


async def measure(python: Path, model: Path, precision: str, args) -> None:
    res = export(model, ExportOptions(precision=precision), log=lambda s: None)
    threads = args.threads or None
    bare = BareLoop(python, res.output_dir, args.prompt, threads)
    variants = [(b, i) for b in ("generator", "engine") for i in args.intervals]
    workers = {v: Worker(model, precision, v[0], threads, v[1]) for v in variants}
    if args.pin:  # decode loops share one core; HTTP worker and this client get the others
        import os

        cores = args.cores  # read once in main(): this process pins itself below
        decode, rest = {cores[-1]}, set(cores[:-1]) or {cores[-1]}
        pin(bare.pid, decode)
        for w in workers.values():
            pin(w.engine_pid, decode)
            pin(w.worker_pid, rest)
        pin(os.getpid(), rest)
        print(f"pinned: decode loops (bare and engine processes) on core {cores[-1]}, HTTP workers and client on "
              f"{sorted(rest)}", flush=True)
    try:
        for v, w in workers.items():  # warm-up: first runs allocate
            await w.run(args.prompt, args.tokens)
        for kind in ("generator", "engine"):
            bare.run(kind, args.tokens)
        bare_rates: dict[str, list[float]] = {"generator": [], "engine": []}
        ratio_gen: dict[tuple, list[float]] = {v: [] for v in variants}
        ratio_own: dict[tuple, list[float]] = {v: [] for v in variants}
        engine_vs_gen: list[float] = []
        for _ in range(args.pairs):
            before = {k: bare.run(k, args.tokens) for k in ("generator", "engine")}
            for k, r in before.items():
                bare_rates[k].append(r)
            engine_vs_gen.append(before["engine"] / before["generator"])
            for v in variants:
                w = await workers[v].run(args.prompt, args.tokens)
                after = {k: bare.run(k, args.tokens) for k in ("generator", "engine")}
                ratio_gen[v].append(w / ((before["generator"] + after["generator"]) / 2))
                ratio_own[v].append(w / ((before[v[0]] + after[v[0]]) / 2))
                before = after
        # In-run decomposition: per decode step, the worker's own time in its decode thread
        # against its time inside og calls, both from the same requests (no drift between them).
        split: dict[tuple, tuple] = {}
        for v, w in workers.items():
            a = w.split()
            for _ in range(args.split_runs):
                await w.run(args.prompt, args.tokens)
            b = w.split()
            own, og_s, steps = (y - x for x, y in zip(a, b))
            split[v] = (own / steps * 1e6, og_s / steps * 1e6)
        bare_split = {}
        for kind in ("generator", "engine"):
            runs = [bare.run_full(kind, args.tokens) for _ in range(args.split_runs)]
            bare_split[kind] = (statistics.median(r[1] for r in runs) * 1e6, statistics.median(r[2] for r in runs) * 1e6)
        print(f"{precision:5s} export {res.duration_s:6.1f} s {res.output_bytes / 1e6:5.2f} MB | intra-op threads "
              f"{threads or 'ORT default'} | bare og.Generator {statistics.median(bare_rates['generator']):7.1f} "
              f"tok/s, bare og.Engine {statistics.median(bare_rates['engine']):7.1f} tok/s "
              f"(Engine/Generator {spread(engine_vs_gen)})", flush=True)
        for (batching, interval) in variants:
            own = "" if batching == "generator" else f" | to bare og.Engine: {spread(ratio_own[(batching, interval)])}"
            print(f"      worker[{batching:9s} stream_interval_ms={interval:g}] to bare og.Generator: "
                  f"{spread(ratio_gen[(batching, interval)])}{own}", flush=True)
        print(f"      in-run split of each decode thread, per step: time outside og calls (own) and inside "
              f"({args.split_runs} requests each)", flush=True)
        for kind, (own_us, og_us) in bare_split.items():
            print(f"      bare og.{kind.capitalize():9s} loop                      own {own_us:6.2f} us, in og "
                  f"{og_us:7.1f} us", flush=True)
        for (batching, interval), (own_us, og_us) in split.items():
            b_own = bare_split[batching][0]
            print(f"      worker[{batching:9s} stream_interval_ms={interval:g}] own {own_us:6.2f} us, in og "
                  f"{og_us:7.1f} us: {own_us - b_own:+6.2f} us/step over the bare loop's own -> keeps "
                  f"{100 * (og_us + b_own) / (og_us + own_us):5.1f}% of its tokens/s", flush=True)
    finally:
        bare.close()
        for w in workers.values():
            await w.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint folder (default: the tiny-qwen3 fixture)")
    ap.add_argument("--tokens", type=int, default=1500, help="decoded tokens per run (the fixture's context is 2048)")
    ap.add_argument("--pairs", type=int, default=15, help="cycles of bare loop / worker runs (paired samples)")
    ap.add_argument("--split-runs", type=int, default=5, help="requests per worker for the in-run split")
    ap.add_argument("--prompt", default="count: 15 16 17 18")
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads for all (0: ORT's default)")
    ap.add_argument("--intervals", type=lambda v: [float(x) for x in v.split(",")], default=[0.0, 2.0],
                    help="worker stream_interval_ms values to compare (comma-separated)")
    ap.add_argument("--pin", action=argparse.BooleanOptionalAction, default=True,
                    help="pin the bare loop and the engine processes to one core, the rest to the others")
    ap.add_argument("--precisions", default="int4,fp32", help="exports to measure (comma-separated)")
    args = ap.parse_args()
    if args.model:
        model = Path(args.model)
    else:
        from bakeoff.models.fixtures import build

        model = Path(build("tiny-qwen3"))
    python = envs.ensure(env_spec(), print)
    import os

    args.cores = sorted(os.sched_getaffinity(0))
    print(f"model {model}, {args.tokens} tokens/run, {args.pairs} alternating cycles; decode tok/s after the "
          "first token; ratios are paired with the bare runs around each worker run")
    from bakeoff.loadgen import run_loop

    for precision in args.precisions.split(","):
        run_loop(measure(python, model, precision, args))


if __name__ == "__main__":
    t0 = time.monotonic()
    main()
    print(f"total {time.monotonic() - t0:.0f} s")
