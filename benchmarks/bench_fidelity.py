"""Fidelity: bakeoff's sweep figure for each engine beside the engine's own tool, same host, one run.

bakeoff exists to compare engines, so its figure for an engine must be the engine's own best
(issue 28: within 5% of the engine's own benchmark on the same hardware). For each engine that
runs here this starts bakeoff's backend once (the backend class with bakeoff's defaults, or
``--backend-opt ENGINE:key=value``) and measures, at each ``--sessions`` count:

- **bakeoff**: :class:`bakeoff.loadgen.throughput.ThroughputSweep` (the measurement
  ``evaluations/test_throughput.py::test_sweep`` records), one point of ``sessions`` closed-loop
  sessions x ``--requests-per-session`` requests of exactly ``--max-tokens`` tokens (EOS
  ignored) over bakeoff's throughput prompts, after ``--warmup`` requests one at a time;
- **the engine's own tool**, on the same export / server, prompts, output length and
  concurrency, after the same number of warm-up requests:
  vLLM: ``vllm bench serve`` from vLLM's environment against the server bakeoff launched
  (``--dataset-name custom`` with bakeoff's very prompts, ``--skip-chat-template``,
  ``--custom-output-len``, ``--ignore-eos``, ``--max-concurrency`` = sessions, ``--request-rate
  inf``, ``--num-warmups``; ``--extra-body`` as bakeoff's requests carry it); ORT GenAI: a bare
  ``og.Generator`` loop at 1 session, a bare ``og.Engine`` closed loop above
  (``benchmarks/ort_genai_bare.py``, the worker's own export and thread count); OpenVINO GenAI:
  a bare ``ContinuousBatchingPipeline`` closed loop (``LLMPipeline`` with ``batching=pipeline``);
  optimum-ort and transformers: bare ``generate``, one at a time as their workers serve
  (``benchmarks/fidelity_bare.py``).

The figure, on both sides: **aggregate output tokens/s = output tokens of the timed requests /
seconds from the first timed request's send to the last one's end** (bakeoff's sweep point,
``bakeoff/loadgen/stats.py``; ``vllm bench serve``'s ``output_throughput``, whose duration runs
from its first request after the warm-ups to the last end). TTFT p50 and TPOT p50 ((end -
first token) / (tokens - 1)) beside it, in ms. And CPU microseconds per output token of each
process (``/proc``): bakeoff's client and the backend's processes over a whole run (warm-ups
included, their tokens counted); the tool's process (bare loops: the timed part; ``vllm bench
serve``: its whole run) and, for vLLM, the server's processes. On a loaded host CPU time per
token moves far less than tokens/s: it is how a request field's cost is told apart
(``--vllm-bodies``).

Drift: a shared host drifts by tens of percent over minutes, little within seconds. Each session
count runs ``tool, bakeoff, tool, bakeoff, ..., tool`` (``--pairs`` bakeoff runs, after one
untimed run of each side); each bakeoff run is divided by the mean of the tool runs just before
and after it: one paired ratio (:func:`paired_ratios`). The table shows each ratio with its 95%
interval (Student's t on the log ratios, :func:`bakeoff.analysis.noise.ratio_interval`): after
``--pairs`` pairs, more are run while the interval's half-width exceeds ``--half-width`` (0.03),
up to ``--max-pairs``; a row whose interval stays wider is printed ``unresolved`` with it, never
as a bare figure. The JSON (``--out``) keeps every run.

vLLM request fields (issue 28): ``--vllm-bodies`` measures bakeoff and ``vllm bench serve`` with
the same extra request body, per variant (``sweep``: what bakeoff's sweep sends; ``probes``: what
its sanity probes send; ``none``; or field names joined by ``+``).

Usage (CPU, minutes on the fixture):
    .venv/bin/python benchmarks/bench_fidelity.py [--engines transformers,vllm] [--sessions 1,8] [--out F]
On a GPU host with a random Qwen3-1.7B shape (``examples/h200/random_model.py``):
    python benchmarks/bench_fidelity.py --model /path/qwen3-1.7b-random --sessions 1,8,32 --max-tokens 128
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bakeoff.analysis.noise import ratio_interval  # noqa: E402
from benchmarks.fidelity_tools import TOOLS, ToolSide, cpu_per_token, engine_cpu_s, make_tool  # noqa: E402

ENGINES = ("vllm", "ort-genai", "openvino", "optimum-ort", "transformers", "llamacpp")
COLUMNS = ("engine", "sessions", "bakeoff tok/s", "tool tok/s", "ratio [95% interval], pairs", "TTFT p50 ms b/t",
           "TPOT p50 ms b/t")
HALF_WIDTH = 0.03  # the ratio's 95% interval, half its width at most, or the row is unresolved
MAX_PAIRS = 10


def paired_ratios(bakeoff: list[float], tool: list[float]) -> list[float]:
    """bakeoff run i over the mean of the tool runs just before and after it (``len(tool) ==
    len(bakeoff) + 1``: the runs alternate tool, bakeoff, tool, ...)."""
    if len(tool) != len(bakeoff) + 1:
        raise ValueError(f"{len(bakeoff)} bakeoff runs need {len(bakeoff) + 1} tool runs around them, got {len(tool)}")
    return [b / ((t0 + t1) / 2) for b, t0, t1 in zip(bakeoff, tool, tool[1:])]


def _median(xs: list[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return float(statistics.median(vals)) if vals else None


def interval_of(b_runs: list[dict], t_runs: list[dict]):
    """The paired ratios of the runs so far and their 95% interval (None below 2 pairs)."""
    ratios = paired_ratios([r["output_tokens_per_s"] for r in b_runs], [r["output_tokens_per_s"] for r in t_runs])
    return ratios, ratio_interval(ratios)


def resolved(ci, half_width: float) -> bool:
    """Whether an interval is as narrow as asked (half its width at most ``half_width``)."""
    return ci is not None and (ci.high - ci.low) / 2 <= half_width


def summarize_row(engine: str, variant: str, sessions: int, tool_name: str, b_runs: list[dict], t_runs: list[dict],
                  half_width: float = HALF_WIDTH) -> dict:
    """One table row: medians of each side's runs, the paired ratios (:func:`paired_ratios`), their
    geometric mean and 95% interval, and whether the interval is within ``half_width``."""
    ratios, ci = interval_of(b_runs, t_runs)
    return {"engine": engine, "variant": variant, "sessions": sessions, "tool": tool_name,
            "bakeoff_output_tokens_per_s": _median([r["output_tokens_per_s"] for r in b_runs]),
            "tool_output_tokens_per_s": _median([r["output_tokens_per_s"] for r in t_runs]),
            "ratio": ci.mean if ci else ratios[0], "ratio_low": ci.low if ci else None,
            "ratio_high": ci.high if ci else None, "resolved": resolved(ci, half_width), "half_width_target": half_width,
            "ratio_min": min(ratios), "ratio_max": max(ratios), "ratios": ratios,
            "bakeoff_ttft_p50_ms": _median([r.get("ttft_p50_ms") for r in b_runs]),
            "tool_ttft_p50_ms": _median([r.get("ttft_p50_ms") for r in t_runs]),
            "bakeoff_tpot_p50_ms": _median([r.get("tpot_p50_ms") for r in b_runs]),
            "tool_tpot_p50_ms": _median([r.get("tpot_p50_ms") for r in t_runs]),
            "bakeoff_cpu_us_per_token": _median_cpu(b_runs), "tool_cpu_us_per_token": _median_cpu(t_runs),
            "bakeoff_runs": b_runs, "tool_runs": t_runs}


def _median_cpu(runs: list[dict]) -> dict[str, float]:
    """Median CPU us per output token of each process over runs."""
    keys = dict.fromkeys(k for r in runs for k in (r.get("cpu_us_per_token") or {}))
    return {k: _median([(r.get("cpu_us_per_token") or {}).get(k) for r in runs]) for k in keys}


class BakeoffSide:
    """bakeoff's sweep point on a started backend (the suite's measurement, module docstring)."""

    def __init__(self, engine, model_path: str, fixture: bool, args):
        from bakeoff.loadgen.accounting import model_token_counter

        self.engine, self.fixture, self.args = engine, fixture, args
        self.count_tokens = engine.count_tokens or model_token_counter(model_path)
        self.serial = 0

    def run(self, sessions: int) -> dict:
        from bakeoff.api.specs import GenerationRequest
        from bakeoff.loadgen.throughput import SweepPlan, ThroughputSweep
        from evaluations.probing import throughput_prompt

        self.serial += 1
        tag, a = self.serial, self.args

        def make(session: int, turn: int) -> GenerationRequest:
            return GenerationRequest(request_id=f"f{tag}-s{session}-t{turn}", max_tokens=a.max_tokens, temperature=0.0,
                                     prompt=throughput_prompt(session, turn, self.fixture), ignore_eos=True)

        plan = SweepPlan([sessions], a.requests_per_session, a.warmup, a.max_tokens)
        m0 = _counters(self.engine)
        before, c0 = engine_cpu_s(self.engine), time.process_time()
        res = ThroughputSweep(self.engine, make, plan, self.count_tokens).run()
        client_s, after = time.process_time() - c0, engine_cpu_s(self.engine)
        m1 = _counters(self.engine)
        p = res.points[0]
        if not p["ok"]:
            raise RuntimeError(f"bakeoff's point failed: {p['errors_by_class']}")
        out = {k: p.get(k) for k in ("output_tokens_per_s", "output_tokens", "wall_s", "ttft_p50_ms", "tpot_p50_ms",
                                     "requests", "ok", "accounting_mismatches", "accounting_disputed")}
        out["transport"] = {k: res.transport.get(k) for k in ("distorted", "first_cluster_events_p50",
                                                              "events_per_cluster_p50", "cluster_period_p50_ms")}
        out["output_tokens_sources"] = res.sources()
        tokens = p["output_tokens"] + (res.warmup or {}).get("output_tokens", 0)  # CPU counts the warm-up too
        out["cpu_us_per_token"] = {"client": round(client_s / tokens * 1e6, 1),
                                   **{f"engine:{k}": v for k, v in cpu_per_token(before, after, tokens).items()}}
        out["engine_counters"] = c = {k: round(v - m0.get(k, 0.0), 6) for k, v in m1.items() if v != m0.get(k, 0.0)}
        warm = a.warmup * a.max_tokens  # the warm-ups' steps, one token each, are in the counters: taken out
        if c.get("decode_steps_total", 0) > warm and c.get("generated_tokens"):
            out["tokens_per_step"] = round((c["generated_tokens"] - warm) / (c["decode_steps_total"] - warm), 2)
        return out


def _counters(engine) -> dict[str, float]:
    """The backend's numeric counters (``/metrics``), {} when it has none; their change over a run
    is kept beside it (e.g. a worker's decode steps: tokens per step shows how full its batches were)."""
    try:
        return {k.split(":", 1)[-1]: float(v) for k, v in (engine.metrics() or {}).items()
                if isinstance(v, (int, float)) and not isinstance(v, bool) and "{" not in k
                and not k.endswith(("_bucket", "_created"))}
    except Exception:  # noqa: BLE001 - counters are evidence, never a reason to fail a run
        return {}


def alternate(bake: BakeoffSide, tool: ToolSide, sessions: int, pairs: int, log, max_pairs: int | None = None,
              half_width: float = HALF_WIDTH) -> tuple[list[dict], list[dict]]:
    """One untimed run of each side, then tool, bakeoff, tool, ...: ``pairs`` bakeoff runs, and
    more while the ratio's interval is wider than ``half_width``, up to ``max_pairs``."""
    bake.run(sessions)
    first = tool.run(sessions)
    if first.get("kinds"):
        log(f"    {sessions} sessions, untimed: {tool.describe(sessions)}: {first['kinds']}"
            + (f" failed: {first['failed_kinds']}" if first.get("failed_kinds") else ""))
    t_runs, b_runs = [tool.run(sessions)], []
    i = 0
    while i < pairs or (i < (max_pairs or pairs) and not resolved(interval_of(b_runs, t_runs)[1], half_width)):
        b_runs.append(bake.run(sessions))
        t_runs.append(tool.run(sessions))
        fill = ("" if b_runs[-1].get("tokens_per_step") is None else
                f"; tokens per step {b_runs[-1]['tokens_per_step']} / {t_runs[-1].get('tokens_per_step') or '-'}")
        i += 1
        log(f"    {sessions} sessions, pair {i}/{pairs}+: bakeoff {b_runs[-1]['output_tokens_per_s']:.1f}, "
            f"{tool.name} {t_runs[-2]['output_tokens_per_s']:.1f} / {t_runs[-1]['output_tokens_per_s']:.1f} tok/s"
            + f"{fill}"
            f" (load {os.getloadavg()[0]:.1f})")
    return b_runs, t_runs


def measure_engine(name: str, model_path: str, fixture: bool, args, log) -> tuple[list[dict], str | None]:
    """Rows of one engine, or ``([], why it was skipped)``."""
    from backends import resolve
    from bakeoff.api.errors import EngineFailure
    from bakeoff.api.specs import BackendConfig

    opts = {k: v for (e, k), v in args.backend_opts.items() if e == name}
    with tempfile.TemporaryDirectory(prefix=f"fidelity-{name}-") as work:
        engine = resolve(name)(BackendConfig(backend=name, model=model_path, workdir=work, options=opts))
        t0 = time.monotonic()
        try:
            engine.start()
        except EngineFailure as exc:
            engine.stop()
            return [], f"{exc.failure_class}: {exc.message[:300]}"
        log(f"  {name}: started in {time.monotonic() - t0:.0f} s ({engine.info.engine} {engine.info.engine_version})")
        rows: list[dict] = []
        try:
            bake = BakeoffSide(engine, model_path, fixture, args)
            for variant in (args.vllm_bodies if name == "vllm" else ["default"]):
                tool = make_tool(name, engine, model_path, fixture, args, variant, work)
                try:
                    for n in args.sessions:
                        b_runs, t_runs = alternate(bake, tool, n, args.pairs, log, args.max_pairs, args.half_width)
                        rows.append(summarize_row(name, variant, n, tool.describe(n), b_runs, t_runs, args.half_width))
                finally:
                    tool.close()
        except (RuntimeError, OSError, EngineFailure) as exc:
            log(f"  {name}: {type(exc).__name__}: {exc}")
            return rows, f"{type(exc).__name__}: {str(exc)[:300]}"
        finally:
            engine.stop()
        return rows, None


def fmt(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def ratio_cell(r: dict) -> str:
    """``0.970 [0.95, 0.99], 4``; ``unresolved 0.93 [0.80, 1.05], 10`` when the interval stayed
    wider than asked; ``unresolved 0.93 (one pair: no interval), 1``."""
    n = len(r["ratios"])
    if r.get("ratio_low") is None:
        return f"unresolved {fmt(r['ratio'], '.3f')} (one pair: no interval), {n}"
    cell = f"{fmt(r['ratio'], '.3f')} [{fmt(r['ratio_low'], '.2f')}, {fmt(r['ratio_high'], '.2f')}], {n}"
    return cell if r.get("resolved") else "unresolved " + cell


def cpu_table(rows: list[dict]) -> str:
    """CPU microseconds per output token of each process, both sides (medians over the runs):
    where bakeoff's figure loses to the tool, which of its processes spends the difference."""
    lines = ["engine | sessions | bakeoff: us/token per process | tool: us/token per process", "--- | --- | --- | ---"]
    for r in rows:
        label = r["engine"] + ("" if r["variant"] == "default" else f" [{r['variant']}]")
        cells = [", ".join(f"{k} {fmt(v, '.0f')}" for k, v in (r.get(side) or {}).items() if v is not None) or "-"
                 for side in ("bakeoff_cpu_us_per_token", "tool_cpu_us_per_token")]
        lines.append(" | ".join((label, str(r["sessions"]), *cells)))
    return "\n".join(lines)


def table(rows: list[dict]) -> str:
    """The printed table (one line per engine, variant and session count)."""
    lines = [" | ".join(COLUMNS), " | ".join("---" for _ in COLUMNS)]
    for r in rows:
        label = r["engine"] + ("" if r["variant"] == "default" else f" [{r['variant']}]")
        lines.append(" | ".join((
            label, str(r["sessions"]), fmt(r["bakeoff_output_tokens_per_s"]), fmt(r["tool_output_tokens_per_s"]),
            ratio_cell(r),
            f"{fmt(r['bakeoff_ttft_p50_ms'])} / {fmt(r['tool_ttft_p50_ms'])}",
            f"{fmt(r['bakeoff_tpot_p50_ms'], '.2f')} / {fmt(r['tool_tpot_p50_ms'], '.2f')}")))
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="fixture:tiny-qwen3", help="fixture:NAME or a checkpoint folder")
    ap.add_argument("--engines", default=",".join(ENGINES), help=f"comma-separated, of {', '.join(ENGINES)}")
    ap.add_argument("--sessions", default="1,8", help="comma-separated session counts (H200: 1,8,32)")
    ap.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (EOS ignored)")
    ap.add_argument("--requests-per-session", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2, help="warm-up requests before every run, each side")
    ap.add_argument("--pairs", type=int, default=3, help="bakeoff runs per session count at least, each between two "
                    "tool runs")
    ap.add_argument("--max-pairs", type=int, default=MAX_PAIRS, help="pairs at most: more are run while the ratio's 95%% "
                    "interval is wider than --half-width")
    ap.add_argument("--half-width", type=float, default=HALF_WIDTH, help="the ratio's 95%% interval, half its width, "
                    "at most (else the row is 'unresolved')")
    ap.add_argument("--backend-opt", action="append", default=[], metavar="ENGINE:KEY=VALUE",
                    help="a backend option for one engine, e.g. ort-genai:paged_attention=false (repeatable)")
    ap.add_argument("--vllm-bodies", default="sweep",
                    help="vLLM extra-body variants, comma-separated: sweep, probes, none, or fields joined by '+'")
    ap.add_argument("--out", type=Path, help="write the table and every run as JSON here")
    args = ap.parse_args(argv)
    bad = [e for e in args.engines.split(",") if e not in ENGINES]
    if bad:
        ap.error(f"unknown engine {bad[0]!r}: use some of {', '.join(ENGINES)}")
    args.engines = args.engines.split(",")
    try:
        args.sessions = [int(x) for x in args.sessions.split(",")]
    except ValueError:
        ap.error(f"--sessions takes comma-separated integers, e.g. 1,8 (got {args.sessions!r})")
    if any(n < 1 for n in args.sessions) or min(args.max_tokens, args.requests_per_session, args.pairs) < 1 or args.warmup < 0:
        ap.error("--sessions, --max-tokens, --requests-per-session and --pairs take positive integers, --warmup >= 0")
    args.max_pairs = max(args.max_pairs, args.pairs)
    if not 0 < args.half_width < 1:
        ap.error(f"--half-width takes a number between 0 and 1 (a ratio's interval, half its width), not {args.half_width}")
    args.backend_opts = {}
    for item in args.backend_opt:
        engine, sep, kv = item.partition(":")
        if not sep or engine not in ENGINES or "=" not in kv:
            ap.error(f"--backend-opt takes ENGINE:key=value with ENGINE one of {', '.join(ENGINES)} (got {item!r})")
        from bakeoff.api.options import parse_value

        k, _, v = kv.partition("=")
        args.backend_opts[(engine, k)] = parse_value(v)
    args.vllm_bodies = args.vllm_bodies.split(",")
    if args.out is not None and args.out.is_dir():
        ap.error(f"--out {args.out} is a folder: give a file name, e.g. {args.out / 'fidelity.json'}")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    from bakeoff.models.resolve import resolve as resolve_model

    model = resolve_model(args.model)
    fixture = model.fixture is not None
    log = lambda s: print(s, flush=True)  # noqa: E731
    log(f"fidelity: {args.model} ({model.path}), sessions {args.sessions}, {args.requests_per_session} requests x "
        f"{args.max_tokens} tokens per session, {args.warmup} warm-up, {args.pairs} pairs; host {platform.node()}, "
        f"{os.cpu_count()} CPUs")
    from bakeoff.host import hugepages

    pages = {"asked": hugepages.engine_env(wanted=True)[1], "not asked": hugepages.engine_env(wanted=False)[1]}
    log(f"huge pages, each engine's own loop as bakeoff's engine process (openvino, optimum-ort ask): {pages['asked']}")
    rows: list[dict] = []
    skipped: dict[str, str] = {}
    t0 = time.monotonic()
    for name in args.engines:
        log(f"{name}: {TOOLS[name]}")
        got, why = measure_engine(name, str(model.path), fixture, args, log)
        rows += got
        if why:
            skipped[name] = why
            log(f"  {name} skipped: {why}")
    log("")
    log(table(rows))
    log("")
    log(cpu_table(rows))
    for name, why in skipped.items():
        log(f"{name}: not measured: {why}")
    out = {"command": [sys.executable, *sys.argv], "model": args.model, "model_path": str(model.path),
           "settings": {k: getattr(args, k) for k in ("sessions", "max_tokens", "requests_per_session", "warmup", "pairs",
                                                       "max_pairs", "half_width",
                                                     "vllm_bodies")},
           "host": {"node": platform.node(), "cpus": os.cpu_count(), "machine": platform.machine(), "huge_pages": pages},
           "metric": "aggregate output tokens/s: output tokens of the timed requests / s from the first send to the last end",
           "rows": rows, "skipped": skipped, "duration_s": round(time.monotonic() - t0, 1)}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1, default=str))
        log(f"wrote {args.out}")
    return out


if __name__ == "__main__":
    main()
