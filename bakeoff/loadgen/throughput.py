"""The throughput sweep as the suite measures it: one run of :func:`bakeoff.loadgen.sweep.run_sweep`
with everything the ``throughput.*`` checks read from it.

:class:`ThroughputSweep` runs the session counts (each ``repeats`` times, back to back), and per
point keeps the records, the token counts of every request (the accounting check's evidence,
:func:`bakeoff.loadgen.accounting.accounting_row`), the GPU window (mean power, SM utilisation,
energy per output token, when a :class:`bakeoff.host.telemetry.GpuSampler` runs) and the first
few errors. After the last point it pools the repeats of each session count into one point (each
repeat kept under ``repeats`` for ``bakeoff compare``'s noise estimate), judges the streams'
shape (:func:`bakeoff.loadgen.distortion.judge`, with the engine's own TTFT/ITL from its
counters over the same window) and adds the roofline (:mod:`bakeoff.analysis.roofline`).

``evaluations/test_throughput.py`` records what it measured as checks; ``benchmarks/bench_fidelity.py``
takes the same figures to set beside each engine's own tool, so the figure compared there is
the one bakeoff publishes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

from bakeoff.analysis.roofline import load_shape, sweep_roofline
from bakeoff.api.specs import GenerationRequest, RequestRecord
from bakeoff.host.telemetry import device_name, joules_per_token
from bakeoff.loadgen.accounting import accounting_row
from bakeoff.loadgen.distortion import engine_timing, judge
from bakeoff.loadgen.stats import summarize
from bakeoff.loadgen.serving_cpu import serving_bound, serving_bound_note
from bakeoff.loadgen.sweep import run_sweep

POINT_KEYS = ("sessions", "requests", "ok", "errors", "input_tokens", "output_tokens", "output_tokens_per_s",
              "per_session_output_tokens_per_s",
              "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "itl_p50_ms", "itl_p99_ms", "e2e_p50_ms",
              "accounting_mismatches", "accounting_disputed", "valid", "invalid_reason",
              "cpu_us_per_output_token", "serving_bound")
# Per-repeat figures kept for the noise estimate of `bakeoff compare` (bakeoff/analysis/noise.py).
REPEAT_KEYS = ("output_tokens_per_s", "per_session_output_tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms")
# GPU hosts: telemetry per point (bakeoff/host/telemetry.py) and the roofline (bakeoff/analysis/roofline.py).
GPU_KEYS = ("gpu_power_mean_w", "gpu_sm_util_mean_pct", "gpu_energy_j", "joules_per_output_token",
            "bound_tokens_per_s", "pct_of_bound", "bound_kind")
FIRST_ERRORS = 3


@dataclass
class SweepPlan:
    """What one sweep sends.

    Attributes:
        sessions: concurrent session counts, in order (e.g. ``[1, 2, 4, 8]``).
        requests_per_session: requests each session sends per point.
        warmup: requests sent one at a time before the first point, reported apart.
        max_tokens: output tokens asked per request.
        repeats: each point this many times, back to back (pooled into one point).
        calibrated_concurrency: the load generator's calibrated concurrency (points above it are
            marked invalid), None when not calibrated.
    """

    sessions: list[int]
    requests_per_session: int
    warmup: int
    max_tokens: int
    repeats: int = 1
    calibrated_concurrency: int | None = None


@dataclass
class SweepResult:
    """What a sweep measured (the checks' values and evidence are made from it).

    Attributes:
        warmup: the warm-up requests' summary.
        points: one summary per session count (repeats pooled), with GPU and roofline figures.
        records: every request of each session count.
        counts_rows: the token counts of every request, in order.
        transport: :func:`bakeoff.loadgen.distortion.judge` over all the sweep's requests.
        first_errors: the first few failed requests, ``class: message``.
        gpu: the whole sweep's GPU window, None without a sampler.
        roofline: :func:`bakeoff.analysis.roofline.sweep_roofline`'s summary.
    """

    warmup: dict[str, Any] | None
    points: list[dict[str, Any]]
    records: dict[int, list[RequestRecord]]
    counts_rows: list[dict[str, Any]]
    transport: dict[str, Any]
    first_errors: list[str] = field(default_factory=list)
    gpu: dict[str, Any] | None = None
    roofline: dict[str, Any] = field(default_factory=dict)

    def sources(self) -> dict[str, int]:
        """Which count the figures use, per ok request (``output_tokens_source`` -> requests)."""
        out: dict[str, int] = {}
        for row in self.counts_rows:
            if row["status"] == "ok":
                out[row["output_tokens_source"]] = out.get(row["output_tokens_source"], 0) + 1
        return out

    def ok_points(self) -> list[dict[str, Any]]:
        """Points with requests that ended ok and within the load generator's error budget."""
        return [p for p in self.points if p["ok"] and p.get("valid", True)]

    def peak(self) -> dict[str, Any]:
        """``peak_output_tokens_per_s``, ``peak_sessions`` and ``single_session_output_tokens_per_s``
        ({} when no point counts)."""
        ok = self.ok_points()
        if not ok:
            return {}
        best = max(ok, key=lambda p: p["output_tokens_per_s"] or 0)
        return {"peak_output_tokens_per_s": best["output_tokens_per_s"], "peak_sessions": best["sessions"],
                "single_session_output_tokens_per_s": self.points[0]["output_tokens_per_s"]}

    def point_values(self) -> list[dict[str, Any]]:
        """The points as the check's values list them (headline keys, repeats, GPU figures)."""
        out = []
        for p in self.points:
            v = {k: p.get(k) for k in (*POINT_KEYS, "repeats")}
            v.update({k: p[k] for k in GPU_KEYS if p.get(k) is not None})
            out.append(v)
        return out

    def errors_by_class(self) -> tuple[dict[str, int], list[dict[str, Any]]]:
        """Failed requests per failure class over all points, and the points that had any."""
        errs = [p for p in self.points if p["errors"]]
        classes: dict[str, int] = {}
        for p in errs:
            for k, v in p["errors_by_class"].items():
                classes[k] = classes.get(k, 0) + v
        return classes, errs

    def summary(self) -> str:
        """The check's one line: peak, single session, roofline, J/token, disputed counts, distortion."""
        peak = self.peak()
        roof = self.roofline
        if not roof.get("available"):
            roof_s = f"; roofline: {roof.get('reason')}"
        else:
            p = next((p for p in self.points if p["sessions"] == peak["peak_sessions"]), {})
            roof_s = (f"; {p.get('pct_of_bound')}% of the {p.get('bound_kind')}-bound roofline "
                      f"({p.get('bound_tokens_per_s')} tok/s on {roof['gpu']}) at peak")
        jpt = (self.gpu or {}).get("joules_per_output_token")
        disputed = sum(p.get("accounting_disputed") or 0 for p in self.points)
        return (f"peak {peak['peak_output_tokens_per_s']:.0f} output tok/s at {peak['peak_sessions']} "
                f"sessions; single session {peak['single_session_output_tokens_per_s']:.0f} tok/s" + roof_s
                + (f"; {jpt} J/token" if jpt else "")
                + (f"; token counts of {disputed} requests DISPUTED (the client's tokenizer is not the server's: "
                   "see throughput.accounting)" if disputed else "")
                + ("; DISTORTED in transit (see throughput.transport)" if self.transport["distorted"] else "")
                + (f"; {note}" if (note := serving_bound_note(self.points)) else ""))


def _pooled_cpu(reps: list[dict[str, Any]]) -> dict[str, float] | None:
    """The repeats' CPU microseconds per output token, weighted by their tokens (None if any lacks them);
    a side only where every repeat read it (a side one repeat could not read is not a 0)."""
    cpus = [p.get("cpu_us_per_output_token") for p in reps]
    tokens = [p["output_tokens"] or 0 for p in reps]
    if not all(cpus) or not sum(tokens):
        return None
    sides = [k for k in cpus[0] if all(k in c for c in cpus)]
    return {k: round(sum(c[k] * n for c, n in zip(cpus, tokens)) / sum(tokens), 1) for k in sides}


def _gpu_window(sampler, t0_ns: int, t1_ns: int, tokens: int) -> dict[str, Any]:
    """Mean power, SM utilisation, energy and J/token of a window (empty without a sampler)."""
    if sampler is None:
        return {}
    g = sampler.summary((t0_ns, t1_ns))
    return {"gpu_power_mean_w": g.get("power_mean_w"), "gpu_sm_util_mean_pct": g.get("sm_util_mean_pct"),
            "gpu_energy_j": g.get("energy_j"), "joules_per_output_token": joules_per_token(g, tokens)}


def _safe_metrics(engine) -> dict[str, float]:
    try:
        return dict(engine.metrics() or {})
    except Exception:  # counters are evidence, never a reason to crash a sweep
        return {}


class ThroughputSweep:
    """One sweep of a started engine (module docstring).

    Args:
        engine: a started Backend.
        make_request: ``(session, turn) -> GenerationRequest`` (a distinct prompt per session).
        plan: what to send.
        count_tokens: the client's tokenizer (:func:`bakeoff.loadgen.accounting.model_token_counter`), or None.
        sampler: a running GPU sampler, or None.
        on_point: called after each point (and each repeat) with the sweep and the point's
            records, once the point is in :attr:`points` and its counts in :attr:`counts_rows`
            (so what was measured is written before a later point can crash the engine).
    """

    def __init__(self, engine, make_request: Callable[[int, int], GenerationRequest], plan: SweepPlan,
                 count_tokens: Callable[[str], int] | None = None, sampler=None,
                 on_point: Callable[["ThroughputSweep", dict[str, Any], list[RequestRecord]], None] | None = None):
        self.engine, self.make_request, self.plan = engine, make_request, plan
        self.count_tokens, self.sampler, self.on_point = count_tokens, sampler, on_point
        self.points: list[dict[str, Any]] = []  # every point and repeat as measured
        self.records: dict[int, list[RequestRecord]] = {}
        self.counts_rows: list[dict[str, Any]] = []
        self.first_errors: list[str] = []
        self.windows: dict[int, list[tuple]] = {}  # sessions -> [(t0_ns, t1_ns, tokens, energy_j)] per repeat

    def _point(self, point: dict[str, Any], recs: list[RequestRecord]) -> None:
        t1 = self.sampler.sample_now()["t_ns"] if self.sampler else time.monotonic_ns()
        t0 = t1 - int(point["wall_s"] * 1e9)
        point.update(_gpu_window(self.sampler, t0, t1, point["output_tokens"]))
        self.windows.setdefault(point["sessions"], []).append((t0, t1, point["output_tokens"], point.get("gpu_energy_j")))
        self.points.append(point)
        self.records.setdefault(point["sessions"], []).extend(recs)
        for r in recs:
            if r.status == "error" and len(self.first_errors) < FIRST_ERRORS:
                self.first_errors.append(f"{r.error_class}: {r.error}")
        self.counts_rows.extend(accounting_row(r, point["sessions"]) for r in recs)
        if self.on_point:
            self.on_point(self, point, recs)

    def run(self, model_path: str | None = None) -> SweepResult:
        """Run the sweep; ``model_path`` (a local checkpoint folder) gives the roofline its shape."""
        plan = self.plan
        counts = [n for n in plan.sessions for _ in range(plan.repeats)]
        before = _safe_metrics(self.engine)
        out = run_sweep(self.engine, self.make_request, counts, plan.requests_per_session, plan.warmup,
                        on_point=self._point, calibrated_concurrency=plan.calibrated_concurrency,
                        count_tokens=self.count_tokens)
        every = [r for recs in self.records.values() for r in recs]
        shape = judge(every, engine_timing(before, _safe_metrics(self.engine)))
        points = self._pooled(out["points"]) if plan.repeats > 1 else out["points"]
        device = self.engine.info.device if self.engine.info else None
        for p in points:
            p.setdefault("repeats", [{k: p.get(k) for k in REPEAT_KEYS}])
            p["serving_bound"] = serving_bound(p.get("cpu_us_per_output_token"), device)
        res = SweepResult(warmup=out["warmup"], points=points, records=self.records, counts_rows=self.counts_rows,
                          transport=shape, first_errors=self.first_errors)
        res.roofline = self._roofline(points, model_path)
        res.gpu = self._gpu_total()
        return res

    def _pooled(self, measured: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """One point per session count: the repeats' records pooled, each repeat kept for noise."""
        pooled = []
        for n in dict.fromkeys(p["sessions"] for p in measured):
            reps = [p for p in measured if p["sessions"] == n]
            pt = summarize(self.records[n], sum(p["wall_s"] for p in reps), n)
            pt["repeats"] = [{k: p.get(k) for k in REPEAT_KEYS} for p in reps]
            pt["cpu_us_per_output_token"] = _pooled_cpu(reps)
            if any("valid" in p for p in reps):
                pt["valid"] = all(p.get("valid", True) for p in reps)
                pt["invalid_reason"] = next((p["invalid_reason"] for p in reps if p.get("invalid_reason")), None)
            ws = self.windows.get(n) or []
            if self.sampler and ws and all(w[3] is not None for w in ws):
                pt.update(_pooled_gpu(ws, reps, pt["output_tokens"]))
            pooled.append(pt)
        return pooled

    def _roofline(self, points: list[dict[str, Any]], model_path: str | None) -> dict[str, Any]:
        """Per-point roofline, merged into ``points``; returns the summary."""
        info = self.engine.info
        dtype = (info.notes or {}).get("dtype") if info else None
        shape = load_shape(model_path, dtype) if model_path else None
        roof = sweep_roofline(points, shape, device_name(info.device) if info else None, self.plan.max_tokens)
        for p, r in zip(points, roof.get("points") or []):
            p.update({k: r[k] for k in ("bound_tokens_per_s", "pct_of_bound", "bound_kind")})
        return roof

    def _gpu_total(self) -> dict[str, Any] | None:
        """The GPU window of the whole sweep, None without a sampler or points."""
        if not (self.sampler and self.windows):
            return None
        ws = [w for per in self.windows.values() for w in per]
        tokens = sum(w[2] for w in ws)
        g = _gpu_window(self.sampler, min(w[0] for w in ws), max(w[1] for w in ws), tokens)
        return {"power_mean_w": g["gpu_power_mean_w"], "sm_util_mean_pct": g["gpu_sm_util_mean_pct"],
                "energy_j": g["gpu_energy_j"], "output_tokens": tokens,
                "joules_per_output_token": g["joules_per_output_token"]}


def _pooled_gpu(windows: list, reps: list[dict[str, Any]], output_tokens: int) -> dict[str, Any]:
    """A pooled point's GPU figures: the energy of its repeats' windows (J, and J per output token)
    and the mean of their power (W) and SM utilisation (%)."""
    energy = sum(w[3] for w in windows)
    return {"gpu_energy_j": round(energy, 3),
            "joules_per_output_token": round(energy / output_tokens, 5) if output_tokens else None,
            "gpu_power_mean_w": round(sum(p.get("gpu_power_mean_w") or 0 for p in reps) / len(reps), 2),
            "gpu_sm_util_mean_pct": round(sum(p.get("gpu_sm_util_mean_pct") or 0 for p in reps) / len(reps), 2)}
