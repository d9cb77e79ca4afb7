"""Throughput: a closed-loop session sweep with TTFT / TPOT / ITL / E2E per point."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from bakeoff.loadgen.accounting import ABS_TOLERANCE_TOKENS, REL_TOLERANCE, accounting_row
from bakeoff.loadgen.stats import per_request, summarize
from bakeoff.loadgen.sweep import run_sweep
from bakeoff.api.specs import GenerationRequest
from bakeoff.loadgen.distortion import engine_timing, judge
from evaluations.measuring import client_token_counter, read_metrics
from evaluations.plugin import attach_engine_evidence, gpu_sampler
from evaluations.probing import throughput_prompt
from bakeoff.analysis.roofline import load_shape, sweep_roofline
from bakeoff.host.telemetry import device_name
from bakeoff.host.telemetry import joules_per_token
from bakeoff.host.artifacts import SWEEP_POINTS_LOG, RunDir

TOKEN_COUNTS = "token_counts.json"
TRANSPORT = "transport.json"
POINT_KEYS = ("sessions", "requests", "ok", "errors", "output_tokens_per_s", "per_session_output_tokens_per_s",
              "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "itl_p50_ms", "itl_p99_ms", "e2e_p50_ms",
              "accounting_mismatches", "valid", "invalid_reason")
# Per-repeat figures kept for the noise estimate of `bakeoff compare` (bakeoff/analysis/noise.py).
REPEAT_KEYS = ("output_tokens_per_s", "per_session_output_tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms")
# GPU hosts: telemetry per point (bakeoff/host/telemetry.py) and the roofline (bakeoff/analysis/roofline.py).
GPU_KEYS = ("gpu_power_mean_w", "gpu_sm_util_mean_pct", "gpu_energy_j", "joules_per_output_token",
            "bound_tokens_per_s", "pct_of_bound", "bound_kind")


def append_point(run_path: Path, point: dict) -> None:
    """The point's headline figures as one line of ``SWEEP_POINTS_LOG``, for the live view."""
    RunDir(run_path).append_jsonl(SWEEP_POINTS_LOG, [{
        "sessions": point.get("sessions"), "output_tokens_per_s": point.get("output_tokens_per_s"),
        "ttft_p50_ms": point.get("ttft_p50_ms"), "valid": point.get("valid", True), "errors": point.get("errors")}])


def _gpu_point(sampler, t0_ns: int, t1_ns: int, tokens: int) -> dict:
    """Mean power, SM utilisation, energy and J/token of a window (empty without a sampler)."""

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
    """Per-point roofline (bakeoff/analysis/roofline.py), merged into ``points``; returns the summary."""

    info = engine.info
    dtype = (info.notes or {}).get("dtype") if info else None
    shape = load_shape(settings.model.path, dtype) if settings.model.local else None

    roof = sweep_roofline(points, shape, device_name(info.device) if info else None, max_tokens)
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
        count_tokens, c.values["client_tokenizer"] = client_token_counter(settings, engine)
        counts_rows: list[dict] = []  # every request's token counts: the accounting check's evidence

        windows: dict[int, list] = {}  # sessions -> [(t0_ns, t1_ns, tokens, energy_j)] per repeat

        def on_point(point, recs):
            t1 = gpu_telemetry.sample_now()["t_ns"] if gpu_telemetry else time.monotonic_ns()
            t0 = t1 - int(point["wall_s"] * 1e9)
            point.update(_gpu_point(gpu_telemetry, t0, t1, point["output_tokens"]))
            windows.setdefault(point["sessions"], []).append((t0, t1, point["output_tokens"], point.get("gpu_energy_j")))
            points.append(point)
            append_point(run.dir.path, point)
            recs_by_n.setdefault(point["sessions"], []).extend(recs)
            for r in recs:
                if r.status == "error" and len(c.values.setdefault("first_errors", [])) < 3:
                    c.values["first_errors"].append(f"{r.error_class}: {r.error}")
            c.evidence("sweep.json", {"points": points, "profile": settings.profile, "max_tokens": cfg["max_tokens"]})
            counts_rows.extend(accounting_row(r, point["sessions"]) for r in recs)
            c.evidence(TOKEN_COUNTS, counts_rows)
            if settings.requests_log:
                run.dir.append_jsonl("requests.jsonl", [{**per_request(r), "output_text": r.output_text} for r in recs])

        counts = [n for n in cfg["sessions"] for _ in range(repeats)]  # each point R times, back to back
        (run.dir.path / SWEEP_POINTS_LOG).unlink(missing_ok=True)  # a resumed run's sweep starts it again
        cal = run.get("loadgen.calibration")
        calibrated = cal.values.get("calibrated_concurrency") if cal is not None and cal.status == "pass" else None
        metrics_before = read_metrics(engine)
        result = run_sweep(engine, make, counts, cfg["requests_per_session"], cfg["warmup"], on_point=on_point,
                           calibrated_concurrency=calibrated, count_tokens=count_tokens)
        sources: dict[str, int] = {}
        for row in counts_rows:
            if row["status"] == "ok":
                sources[row["output_tokens_source"]] = sources.get(row["output_tokens_source"], 0) + 1
        c.values["output_tokens_sources"] = sources  # which count the figures use, per request
        shape = judge([r for recs in recs_by_n.values() for r in recs], engine_timing(metrics_before, read_metrics(engine)))
        c.evidence(TRANSPORT, shape)
        c.values["transport_distorted"] = shape["distorted"]
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
        ok_points = [p for p in result["points"] if p["ok"] and p.get("valid", True)]
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
        if not ok_points:
            why = next((p.get("invalid_reason") for p in result["points"] if p.get("invalid_reason")), None)
            c.skip("no sweep point was measured within the load generator's error budget"
                   + (f" ({why})" if why else "") + ": this host could not measure the engine (its figures are kept "
                   "in values, marked invalid); rerun on an idle host")
        c.summary = (f"peak {c.values['peak_output_tokens_per_s']:.0f} output tok/s at {c.values['peak_sessions']} "
                     f"sessions; single session {c.values['single_session_output_tokens_per_s']:.0f} tok/s"
                     + _roof_summary(result["points"], c.values["peak_sessions"], roof)
                     + (f"; {c.values['joules_per_output_token']} J/token" if c.values.get("joules_per_output_token") else "")
                     + ("; DISTORTED in transit (see throughput.transport)" if shape["distorted"] else ""))


@pytest.mark.check("throughput.transport")
def test_transport(run, engine):
    """Whether the sweep's streams were distorted between engine and client (a buffering proxy):
    the rule of bakeoff/loadgen/distortion.py (bursts, with the first token held back or TTFT
    above the engine's own). Fails ``transport-distortion`` naming the evidence; the sweep's
    figures are then the hop's, not the engine's (the report marks them)."""
    sweep = run.get("throughput.sweep")
    with run.check("throughput.transport", "transport-distortion") as c:
        path = next((p for p in (sweep.evidence if sweep else []) if p.endswith("/" + TRANSPORT)), None)
        if path is None or not (run.dir.path / path).is_file():
            c.skip("no sweep stream to inspect (throughput.sweep did not finish)")
        shape = json.loads((run.dir.path / path).read_text())
        c.values.update({k: v for k, v in shape.items() if k not in ("reasons",)})
        c.evidence("transport.json", shape)
        if shape["distorted"] is None:
            c.skip(f"cannot tell: {shape['reasons'][0]}")
        c.values["hop_possible"] = not engine.serves_on_loopback
        if shape["distorted"] and engine.serves_on_loopback:
            c.skip("streams arrived batched (" + "; ".join(shape["reasons"]) + "), but no hop exists: bakeoff launched "
                   "this server on 127.0.0.1, so the engine's own frontend or a loaded host batched them; the sweep's "
                   "TTFT/ITL are marked distorted, not the engine's")
        c.require(not shape["distorted"], "stream distorted in transit: " + "; ".join(shape["reasons"]))
        c.summary = (f"no buffering hop: median first cluster {shape['first_cluster_events_p50']:g} event(s), "
                     f"median {shape['events_per_cluster_p50']:g} events per arrival cluster over "
                     f"{shape['requests']} streams" + (f"; headers {shape['headers']}" if shape["headers"] else ""))


@pytest.mark.check("throughput.accounting")
def test_accounting(run, engine):
    """Server usage against the client's own count of every sweep request
    (bakeoff/loadgen/accounting.py). Token ids are exact: one disagreement fails. A tokenizer's
    count agrees within 2 tokens + 10% of those in multi-token events; it fails when more than 5% of requests (and at least
    2) disagree beyond that, so one odd detokenization cannot flip the verdict. Without usage, or
    with usage that only an event count could check and exceeds it, nothing was verified: skip."""
    sweep = run.get("throughput.sweep")
    with run.check("throughput.accounting", "client-accounting") as c:
        path = next((p for p in (sweep.evidence if sweep else []) if p.endswith("/" + TOKEN_COUNTS)), None)
        if path is None or not (run.dir.path / path).is_file():
            c.skip("no sweep request to check (throughput.sweep wrote no token counts)")
        rows = [r for r in json.loads((run.dir.path / path).read_text()) if r["status"] == "ok"]
        by = {k: [r for r in rows if r["accounting"] == k] for k in ("agree", "disagree", "unverified", "no-usage")}
        ids = sum(1 for r in rows if r["streamed_token_ids"] is not None)
        basis = ("streamed token ids" if ids == len(rows) and rows else
                 "the client's tokenizer" if all(r["client_tokenizer_tokens"] is not None for r in rows) else
                 "content events")
        c.values.update({"requests": len(rows), "basis": basis, "mismatches": len(by["disagree"]),
                         "unverified": len(by["unverified"]), "no_usage": len(by["no-usage"]),
                         "tolerance": "exact" if basis == "streamed token ids" else
                         f"{ABS_TOLERANCE_TOKENS} tokens + {REL_TOLERANCE:.0%} of multi-token events",
                         "client_tokenizer": sweep.values.get("client_tokenizer"),
                         "output_tokens_sources": sweep.values.get("output_tokens_sources")})
        worst = sorted(by["disagree"], key=lambda r: -abs((r["usage_output_tokens"] or 0) - (r["output_tokens"] or 0)))
        c.evidence("accounting.json", {"rule": test_accounting.__doc__.split("(")[0].strip(), **c.values,
                                       "disagreeing": worst, "requests": rows})
        if not rows:
            c.skip("no request of the sweep ended ok")
        n_bad, n = len(by["disagree"]), len(rows)
        if n_bad:
            r = worst[0]
            own = r["streamed_token_ids"] if r["streamed_token_ids"] is not None else (
                r["client_tokenizer_tokens"] if r["client_tokenizer_tokens"] is not None else r["content_events"])
            msg = (f"{n_bad}/{n} requests: server usage differs from {basis} (e.g. {r['request_id']}: usage "
                   f"{r['usage_output_tokens']} vs {own}); the sweep's figures use the client's count")
            c.require(basis != "streamed token ids" or n_bad == 0, msg)
            c.require(n_bad < 2 or n_bad <= 0.05 * n, msg)
        if len(by["no-usage"]) == n:
            c.skip(f"the server reported no usage: nothing to check; the figures use {basis}")
        if len(by["agree"]) == 0:
            c.skip(f"usage exceeds the content events of {len(by['unverified'])} requests: events may carry several "
                   "tokens, so only a tokenizer can tell (pass --backend-opt tokenizer=DIR); figures use server usage, "
                   "unverified")
        c.summary = (f"server usage agrees with {basis} on {len(by['agree'])}/{n} requests "
                     f"({c.values['tolerance']})" + (f"; {n_bad} outside tolerance" if n_bad else "")
                     + (f"; {len(by['unverified'])} unverified" if by["unverified"] else ""))
