"""Throughput: a closed-loop session sweep with TTFT / TPOT / ITL / E2E per point."""

from __future__ import annotations

import time

import pytest

from bakeoff.loadgen.stats import per_request, summarize
from bakeoff.loadgen.sweep import run_sweep
from bakeoff.specs import GenerationRequest
from evaluations.plugin import attach_engine_evidence, gpu_sampler
from evaluations.probing import throughput_prompt

POINT_KEYS = ("sessions", "requests", "ok", "errors", "output_tokens_per_s", "per_session_output_tokens_per_s",
              "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "itl_p50_ms", "itl_p99_ms", "e2e_p50_ms",
              "accounting_mismatches", "valid", "invalid_reason")
# Per-repeat figures kept for the noise estimate of `bakeoff compare` (bakeoff/noise.py).
REPEAT_KEYS = ("output_tokens_per_s", "per_session_output_tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms")
# GPU hosts: telemetry per point (bakeoff/telemetry.py) and the roofline (bakeoff/roofline.py).
GPU_KEYS = ("gpu_power_mean_w", "gpu_sm_util_mean_pct", "gpu_energy_j", "joules_per_output_token",
            "bound_tokens_per_s", "pct_of_bound", "bound_kind")


def _gpu_point(sampler, t0_ns: int, t1_ns: int, tokens: int) -> dict:
    """Mean power, SM utilisation, energy and J/token of a window (empty without a sampler)."""
    from bakeoff.telemetry import joules_per_token

    if sampler is None:
        return {}
    g = sampler.summary((t0_ns, t1_ns))
    return {"gpu_power_mean_w": g.get("power_mean_w"), "gpu_sm_util_mean_pct": g.get("sm_util_mean_pct"),
            "gpu_energy_j": g.get("energy_j"), "joules_per_output_token": joules_per_token(g, tokens)}


def _roof_summary(points: list[dict], peak_sessions: int, roof: dict) -> str:
    if not roof.get("available"):
        return f"; roofline: {roof.get('reason')}"
    p = next((p for p in points if p["sessions"] == peak_sessions), {})
    return (f"; {p.get('pct_of_bound')}% of the {p.get('bound_kind')}-bound roofline "
            f"({p.get('bound_tokens_per_s')} tok/s on {roof['gpu']}) at peak")


def _roofline(points: list[dict], engine, settings, max_tokens: int) -> dict:
    """Per-point roofline (bakeoff/roofline.py), merged into ``points``; returns the summary."""
    from bakeoff.roofline import load_shape, sweep_roofline

    info = getattr(engine, "info", None)
    dtype = (info.notes or {}).get("dtype") if info else None
    shape = load_shape(settings.model.path, dtype) if settings.model.local else None
    roof = sweep_roofline(points, shape, info.device if info else None, max_tokens)
    for p, r in zip(points, roof.get("points") or []):
        p.update({k: r[k] for k in ("bound_tokens_per_s", "pct_of_bound", "bound_kind")})
    return roof


@pytest.mark.check("throughput.sweep")
def test_sweep(run, settings, engine, pytestconfig):
    cfg = settings.profile_cfg
    repeats = max(1, int(pytestconfig.getoption("--repeats", 1) or 1))
    fixture = settings.model.fixture is not None
    gpu_telemetry = gpu_sampler(pytestconfig)

    def make(session: int, turn: int) -> GenerationRequest:
        return GenerationRequest(request_id=f"s{session}-t{turn}", prompt=throughput_prompt(session, turn, fixture),
                                 max_tokens=cfg["max_tokens"], temperature=0.0, ignore_eos=True)

    with run.check("throughput.sweep", "runtime-crash") as c:
        points: list[dict] = []
        recs_by_n: dict[int, list] = {}

        windows: dict[int, list] = {}  # sessions -> [(t0_ns, t1_ns, tokens, energy_j)] per repeat

        def on_point(point, recs):
            t1 = gpu_telemetry.sample_now()["t_ns"] if gpu_telemetry else time.monotonic_ns()
            t0 = t1 - int(point["wall_s"] * 1e9)
            point.update(_gpu_point(gpu_telemetry, t0, t1, point["output_tokens"]))
            windows.setdefault(point["sessions"], []).append((t0, t1, point["output_tokens"], point.get("gpu_energy_j")))
            points.append(point)
            recs_by_n.setdefault(point["sessions"], []).extend(recs)
            for r in recs:
                if r.status == "error" and len(c.values.setdefault("first_errors", [])) < 3:
                    c.values["first_errors"].append(f"{r.error_class}: {r.error}")
            c.evidence("sweep.json", {"points": points, "profile": settings.profile, "max_tokens": cfg["max_tokens"]})
            if settings.requests_log:
                run.dir.append_jsonl("requests.jsonl", [{**per_request(r), "output_text": r.output_text} for r in recs])

        counts = [n for n in cfg["sessions"] for _ in range(repeats)]  # each point R times, back to back
        cal = run.get("loadgen.calibration")
        calibrated = cal.values.get("calibrated_concurrency") if cal is not None and cal.status == "pass" else None
        result = run_sweep(engine, make, counts, cfg["requests_per_session"], cfg["warmup"], on_point=on_point,
                           calibrated_concurrency=calibrated)
        if repeats > 1:  # one point per session count: the repeats pooled, each repeat kept for noise
            pooled = []
            for n in dict.fromkeys(p["sessions"] for p in result["points"]):
                reps = [p for p in result["points"] if p["sessions"] == n]
                pt = summarize(recs_by_n[n], sum(p["wall_s"] for p in reps), n)
                pt["repeats"] = [{k: p.get(k) for k in REPEAT_KEYS} for p in reps]
                if any("valid" in p for p in reps):
                    pt["valid"] = all(p.get("valid", True) for p in reps)
                    pt["invalid_reason"] = next((p["invalid_reason"] for p in reps if p.get("invalid_reason")), None)
                ws = windows.get(n) or []
                if gpu_telemetry and ws and all(w[3] is not None for w in ws):
                    energy = sum(w[3] for w in ws)
                    pt.update({"gpu_energy_j": round(energy, 3), "joules_per_output_token":
                               round(energy / pt["output_tokens"], 5) if pt["output_tokens"] else None,
                               "gpu_power_mean_w": round(sum(p.get("gpu_power_mean_w") or 0 for p in reps) / len(reps), 2),
                               "gpu_sm_util_mean_pct": round(sum(p.get("gpu_sm_util_mean_pct") or 0 for p in reps) / len(reps), 2)})
                pooled.append(pt)
            result["points"] = pooled
        for p in result["points"]:
            p.setdefault("repeats", [{k: p.get(k) for k in REPEAT_KEYS}])
        c.evidence("sweep.json", {"warmup": result["warmup"], "points": result["points"], "profile": settings.profile,
                                  "max_tokens": cfg["max_tokens"]})
        c.values["warmup"] = result["warmup"]
        roof = _roofline(result["points"], engine, settings, cfg["max_tokens"])
        c.values["points"] = [{k: p.get(k) for k in (*POINT_KEYS, "repeats")} for p in result["points"]]
        for v, p in zip(c.values["points"], result["points"]):
            v.update({k: p[k] for k in GPU_KEYS if p.get(k) is not None})
        c.values["repeats"] = repeats
        c.values["roofline"] = roof
        if gpu_telemetry and windows:
            span = (min(w[0] for ws in windows.values() for w in ws), max(w[1] for ws in windows.values() for w in ws))
            tokens = sum(w[2] for ws in windows.values() for w in ws)
            g = _gpu_point(gpu_telemetry, *span, tokens)
            c.values["gpu"] = {"power_mean_w": g["gpu_power_mean_w"], "sm_util_mean_pct": g["gpu_sm_util_mean_pct"],
                               "energy_j": g["gpu_energy_j"], "output_tokens": tokens,
                               "joules_per_output_token": g["joules_per_output_token"]}
            c.values["joules_per_output_token"] = g["joules_per_output_token"]
        c.evidence("sweep.json", {"warmup": result["warmup"], "points": result["points"], "profile": settings.profile,
                                  "max_tokens": cfg["max_tokens"], "roofline": roof})
        ok_points = [p for p in result["points"] if p["ok"]]
        if ok_points:
            best = max(ok_points, key=lambda p: p["output_tokens_per_s"] or 0)
            c.values.update({"peak_output_tokens_per_s": best["output_tokens_per_s"], "peak_sessions": best["sessions"],
                             "single_session_output_tokens_per_s": result["points"][0]["output_tokens_per_s"]})
        errs = [p for p in result["points"] if p["errors"]]
        if errs:
            classes: dict[str, int] = {}
            for p in errs:
                for k, v in p["errors_by_class"].items():
                    classes[k] = classes.get(k, 0) + v
            worst = max(classes, key=classes.get)
            attach_engine_evidence(c, engine, worst)
            first_err = next((e for e in c.values.get("first_errors", [])), None)
            c.fail(f"{sum(classes.values())} requests failed across {len(errs)} sweep points "
                   f"(first at {errs[0]['sessions']} sessions): {first_err or worst}", worst)
        c.require(len(result["points"]) == len(cfg["sessions"]), "the sweep stopped early")
        c.summary = (f"peak {c.values['peak_output_tokens_per_s']:.0f} output tok/s at {c.values['peak_sessions']} "
                     f"sessions; single session {c.values['single_session_output_tokens_per_s']:.0f} tok/s"
                     + _roof_summary(result["points"], c.values["peak_sessions"], roof)
                     + (f"; {c.values['joules_per_output_token']} J/token" if c.values.get("joules_per_output_token") else ""))


@pytest.mark.check("throughput.accounting")
def test_accounting(run, engine):
    sweep = run.get("throughput.sweep")
    with run.check("throughput.accounting", "client-accounting") as c:
        if sweep is None or not sweep.values.get("points"):
            c.skip("no sweep point to check")
        mism = sum(p.get("accounting_mismatches") or 0 for p in sweep.values["points"])
        total = sum(p.get("ok") or 0 for p in sweep.values["points"])
        c.values.update({"requests": total, "mismatches": mism})
        c.require(mism == 0, f"{mism}/{total} requests: client token count differs from the server's usage")
        c.summary = f"server usage and client counts agree on {total} requests"
