"""Output tokens/s of several backends on one model, side by side, in one run.

Prints figures; asserts nothing about speed. Every backend is started once (its environment,
export and load are not timed) and stays up; then rounds alternate over the backends
(``A, B, C, D, A, B, ...``) so that a shared host's drift over minutes lands on every backend
alike, and each backend's figure is the median of its rounds. A round is one closed-loop sweep
point per session count (``--sessions``, default 1 and 8), each session sending distinct
prompts (:func:`evaluations.probing.throughput_prompt`), greedy, ``ignore_eos`` so every
request decodes exactly ``--max-tokens`` tokens. Aggregate output tokens/s is the point's
output tokens over its wall time (``bakeoff.loadgen.stats.summarize``); TPOT p50 is in ms.

The ratio column divides each backend's median by the first backend's at the same session count,
so the comparison is within one run on one host.

Usage::

    .venv/bin/python benchmarks/bench_backends.py                                   # vllm, ort-genai, optimum-ort, openvino
    .venv/bin/python benchmarks/bench_backends.py --backends ort-genai,openvino --rounds 5 --out /tmp/b.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import backends
from bakeoff.api.specs import BackendConfig, GenerationRequest
from bakeoff.loadgen import run_loop
from bakeoff.loadgen.sweep import closed_loop
from bakeoff.loadgen.stats import summarize
from bakeoff.models.resolve import resolve
from evaluations.probing import throughput_prompt

DEFAULT_BACKENDS = "vllm,ort-genai,optimum-ort,openvino"


def start(name: str, model, workdir: Path, options: dict) -> tuple[object | None, str]:
    """Start one backend; ``(backend, note)`` or ``(None, the start failure)``."""
    cfg = BackendConfig(backend=name, model=model.path, model_label=model.label, options=options,
                        workdir=str(workdir / name), start_timeout_s=900)
    backend = backends.resolve(name)(cfg)
    t0 = time.monotonic()
    try:
        info = backend.start()
    except Exception as exc:  # noqa: BLE001 - a backend that cannot start is a row, not a crash
        backend.stop()
        return None, f"{type(exc).__name__}: {str(exc)[:200]}"
    return backend, f"{info.engine} {info.engine_version or ''} started in {time.monotonic() - t0:.0f} s".strip()


def one_point(backend, sessions: int, requests_per_session: int, max_tokens: int, fixture: bool) -> dict:
    """One closed-loop point; the summary of ``bakeoff.loadgen.stats.summarize``."""
    def make(session: int, turn: int) -> GenerationRequest:
        return GenerationRequest(request_id=f"b{session}-{turn}-{time.monotonic_ns()}",
                                 prompt=throughput_prompt(session, turn, fixture), max_tokens=max_tokens,
                                 temperature=0.0, ignore_eos=True)

    async def main():
        try:
            recs, wall = await closed_loop(backend, make, sessions, requests_per_session, 0.5, None)
        finally:
            await backend.aclose()  # the client's connections belong to this event loop
        return summarize(recs, wall, sessions)

    return run_loop(main())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backends", default=DEFAULT_BACKENDS)
    ap.add_argument("--model", default="fixture:tiny-qwen3")
    ap.add_argument("--sessions", default="1,8", help="comma-separated session counts")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds; the figure is their median")
    ap.add_argument("--requests-per-session", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--backend-opt", action="append", default=[], metavar="BACKEND:KEY=VALUE")
    ap.add_argument("--out", default=None, help="write every round as JSON here")
    args = ap.parse_args(argv)
    names = [n.strip() for n in args.backends.split(",") if n.strip()]
    for n in names:
        backends.validate(n)
    session_counts = [int(s) for s in args.sessions.split(",")]
    opts: dict[str, dict] = {n: {} for n in names}
    for item in args.backend_opt:
        target, _, kv = item.partition(":")
        key, _, value = kv.partition("=")
        try:
            parsed = json.loads(value)
        except ValueError:
            parsed = value
        opts.setdefault(target, {})[key] = parsed
    model = resolve(args.model)
    fixture = model.fixture is not None
    work = Path(tempfile.mkdtemp(prefix="bench-backends-"))
    started: dict[str, object] = {}
    notes: dict[str, str] = {}
    try:
        for n in names:
            b, notes[n] = start(n, model, work, opts.get(n, {}))
            print(f"{n}: {notes[n]}", flush=True)
            if b is not None:
                started[n] = b
                one_point(b, 1, 1, args.max_tokens, fixture)  # warm-up, not counted
        rounds: dict[str, dict[int, list[dict]]] = {n: {s: [] for s in session_counts} for n in started}
        for r in range(args.rounds):
            for n, b in started.items():
                for s in session_counts:
                    p = one_point(b, s, args.requests_per_session, args.max_tokens, fixture)
                    rounds[n][s].append(p)
                    print(f"round {r + 1} {n} {s} sessions: {p['output_tokens_per_s']:.1f} tok/s "
                          f"({p['errors']} errors)", flush=True)
    finally:
        for b in started.values():
            b.stop()
    _table(names, session_counts, rounds, notes, args)
    if args.out:
        Path(args.out).write_text(json.dumps({"model": args.model, "notes": notes, "rounds": rounds,
                                              "max_tokens": args.max_tokens}, indent=1, default=str))
    return 0


def _median(points: list[dict], key: str) -> float | None:
    vals = [p[key] for p in points if p.get(key) is not None and p.get("ok")]
    return statistics.median(vals) if vals else None


def _table(names, session_counts, rounds, notes, args) -> None:
    print(f"\nmodel {args.model}; {args.max_tokens} output tokens per request, {args.requests_per_session} requests "
          f"per session, median of {args.rounds} alternating rounds")
    print("| backend | " + " | ".join(f"{s} sess. tok/s | ratio | TPOT p50 ms" for s in session_counts) + " |")
    print("|---|" + "---|---|---|" * len(session_counts))
    base = {s: _median(rounds[names[0]][s], "output_tokens_per_s") if names[0] in rounds else None
            for s in session_counts}
    for n in names:
        if n not in rounds:
            print(f"| {n} | did not start: {notes[n]} |")
            continue
        cells = []
        for s in session_counts:
            tps = _median(rounds[n][s], "output_tokens_per_s")
            tpot = _median(rounds[n][s], "tpot_p50_ms")
            ratio = f"{tps / base[s]:.2f}" if tps and base[s] else "–"
            cells += [f"{tps:,.1f}" if tps else "–", ratio, f"{tpot:.2f}" if tpot else "–"]
        print(f"| {n} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    sys.exit(main())
