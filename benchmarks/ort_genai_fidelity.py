"""bakeoff's ORT GenAI worker against bare og loops on the same export, alternating (issue 28).

The worker (``backends.ort_genai``: HTTP worker + engine process, bakeoff's default options
unless ``--backend-opt`` says otherwise) is driven by bakeoff's own load generator
(``bakeoff.loadgen.sweep.closed_loop``: ``sessions`` closed-loop sessions, bakeoff's
throughput prompts, ``max_tokens`` exactly, EOS ignored); the bare loops
(:class:`benchmarks.ort_genai_bare.BareOrtGenai`: one ``og.Generator`` batch per turn, or
``og.Engine`` with ``sessions`` requests in flight) run the same prompts and lengths on the
worker's own export. Runs alternate ``bare, worker, bare, ...`` for ``--cycles`` cycles per
session count, each worker figure divided by the mean of the best bare figures just before and
after it (a small shared host drifts by tens of percent over minutes, little within seconds);
the median ratio is the figure.

Usage:
    .venv/bin/python benchmarks/ort_genai_fidelity.py [--model FOLDER] [--sessions 1,8]
        [--max-tokens 256] [--requests-per-session 4] [--cycles 5] [--backend-opt batching=generator]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.ort_genai_bare import BareOrtGenai, sweep_prompts  # noqa: E402


class WorkerLoop:
    """The ort-genai backend kept up, measured by bakeoff's closed loop."""

    def __init__(self, model: Path, options: dict[str, Any], fixture: bool):
        from backends import resolve
        from bakeoff.api.specs import BackendConfig

        self.tmp = tempfile.TemporaryDirectory()
        self.fixture = fixture
        self.backend = resolve("ort-genai")(BackendConfig(backend="ort-genai", model=str(model), workdir=self.tmp.name,
                                                          options=options))
        self.info = self.backend.start()

    def run(self, sessions: int, max_tokens: int, rounds: int) -> dict[str, Any]:
        """One closed-loop point: bakeoff's sweep summary (``output_tokens_per_s``, ``ttft_p50_ms``, ...)."""
        from bakeoff.api.specs import GenerationRequest
        from bakeoff.loadgen import run_loop
        from bakeoff.loadgen.stats import summarize
        from bakeoff.loadgen.sweep import closed_loop
        from evaluations.probing import throughput_prompt

        def make(session: int, turn: int) -> GenerationRequest:
            return GenerationRequest(request_id=f"s{session}-t{turn}-{time.monotonic_ns()}",
                                     prompt=throughput_prompt(session, turn, self.fixture), max_tokens=max_tokens,
                                     temperature=0.0, ignore_eos=True)

        recs, wall = run_loop(closed_loop(self.backend, make, sessions, rounds))
        return summarize(recs, wall, sessions)

    def close(self) -> None:
        from bakeoff.loadgen import run_loop

        run_loop(self.backend.aclose())
        self.backend.stop()
        self.tmp.cleanup()


def compare(model: Path, options: dict[str, Any], sessions: list[int], max_tokens: int, rounds: int, cycles: int,
            fixture: bool, log=print) -> list[dict[str, Any]]:
    """Alternating worker / bare runs per session count; one row per count (medians)."""
    worker = WorkerLoop(model, options, fixture)
    notes = worker.info.notes
    bare = BareOrtGenai(worker.backend.export_result.output_dir, worker.backend.options.execution_provider,
                        int(worker.backend.threads()[0] or 0))  # the worker's own (its default too)
    kinds = ("engine",) if bare.paged else ("generator", "engine")
    prompts = sweep_prompts(fixture, max(sessions), rounds)
    log(f"worker: batching {notes.get('batching')}, {notes.get('og_engine', '')}; paged export: {bare.paged}")
    rows = []
    try:
        worker.run(1, 8, 1)
        for k in kinds:
            bare.run(k, prompts, 8, 1, 1)
        for n in sessions:
            def best_bare() -> tuple[float, str, dict]:
                runs = [bare.run(k, prompts, max_tokens, n, rounds) for k in kinds]
                ok = [r for r in runs if "error" not in r]
                top = max(ok, key=lambda r: r["output_tokens_per_s"])
                return top["output_tokens_per_s"], top["kind"], {r["kind"]: r.get("output_tokens_per_s") for r in runs}

            before = best_bare()
            ratios, mine, bares = [], [], [before[2]]
            for _ in range(cycles):
                w = worker.run(n, max_tokens, rounds)
                after = best_bare()
                ratios.append(w["output_tokens_per_s"] / ((before[0] + after[0]) / 2))
                mine.append(w)
                bares.append(after[2])
                before = after
            row = {"sessions": n, "ratio_median": statistics.median(ratios), "ratios": ratios,
                   "worker_tok_s_median": statistics.median(w["output_tokens_per_s"] for w in mine),
                   "worker_ttft_p50_ms_median": statistics.median(w["ttft_p50_ms"] for w in mine),
                   **{f"bare_{k}_tok_s_median": statistics.median(b[k] for b in bares if b.get(k)) for k in kinds}}
            rows.append(row)
            log(f"{n:>3} sessions: worker {row['worker_tok_s_median']:8.1f} tok/s (TTFT p50 "
                f"{row['worker_ttft_p50_ms_median']:.2f} ms) | " + " | ".join(
                    f"bare {k} {row[f'bare_{k}_tok_s_median']:8.1f}" for k in kinds)
                + f" | worker / best bare: median {row['ratio_median']:.3f} "
                  f"(min {min(ratios):.3f}, max {max(ratios):.3f}, n={len(ratios)})")
    finally:
        bare.close()
        worker.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint folder (default: the tiny-qwen3 fixture)")
    ap.add_argument("--sessions", default="1,8")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--requests-per-session", type=int, default=4)
    ap.add_argument("--cycles", type=int, default=5)
    ap.add_argument("--backend-opt", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args()
    from bakeoff.api.options import parse_value

    options = {k: parse_value(v) for k, _, v in (o.partition("=") for o in args.backend_opt)}
    fixture = args.model is None
    if fixture:
        from bakeoff.models.fixtures import build

        model = Path(build("tiny-qwen3"))
    else:
        model = Path(args.model)
    print(f"model {model}, options {options or 'bakeoff defaults'}, {args.max_tokens} tokens x "
          f"{args.requests_per_session} requests per session, {args.cycles} alternating cycles")
    compare(model, options, [int(x) for x in args.sessions.split(",")], args.max_tokens, args.requests_per_session,
            args.cycles, fixture)


if __name__ == "__main__":
    t0 = time.monotonic()
    main()
    print(f"total {time.monotonic() - t0:.0f} s")
