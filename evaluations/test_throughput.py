"""Throughput: a closed-loop session sweep with TTFT / TPOT / ITL / E2E per point."""

from __future__ import annotations

import pytest

from bakeoff.loadgen.stats import per_request, summarize
from bakeoff.loadgen.sweep import run_sweep
from bakeoff.specs import GenerationRequest
from evaluations.plugin import attach_engine_evidence
from evaluations.probing import throughput_prompt

POINT_KEYS = ("sessions", "requests", "ok", "errors", "output_tokens_per_s", "per_session_output_tokens_per_s",
              "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "itl_p50_ms", "itl_p99_ms", "e2e_p50_ms",
              "accounting_mismatches")
# Per-repeat figures kept for the noise estimate of `bakeoff compare` (bakeoff/noise.py).
REPEAT_KEYS = ("output_tokens_per_s", "per_session_output_tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms")


@pytest.mark.check("throughput.sweep")
def test_sweep(run, settings, engine, pytestconfig):
    cfg = settings.profile_cfg
    repeats = max(1, int(pytestconfig.getoption("--repeats", 1) or 1))
    fixture = settings.model.fixture is not None

    def make(session: int, turn: int) -> GenerationRequest:
        return GenerationRequest(request_id=f"s{session}-t{turn}", prompt=throughput_prompt(session, turn, fixture),
                                 max_tokens=cfg["max_tokens"], temperature=0.0, ignore_eos=True)

    with run.check("throughput.sweep", "runtime-crash") as c:
        points: list[dict] = []
        recs_by_n: dict[int, list] = {}

        def on_point(point, recs):
            points.append(point)
            recs_by_n.setdefault(point["sessions"], []).extend(recs)
            for r in recs:
                if r.status == "error" and len(c.values.setdefault("first_errors", [])) < 3:
                    c.values["first_errors"].append(f"{r.error_class}: {r.error}")
            c.evidence("sweep.json", {"points": points, "profile": settings.profile, "max_tokens": cfg["max_tokens"]})
            if settings.requests_log:
                run.dir.append_jsonl("requests.jsonl", [{**per_request(r), "output_text": r.output_text} for r in recs])

        counts = [n for n in cfg["sessions"] for _ in range(repeats)]  # each point R times, back to back
        result = run_sweep(engine, make, counts, cfg["requests_per_session"], cfg["warmup"], on_point=on_point)
        if repeats > 1:  # one point per session count: the repeats pooled, each repeat kept for noise
            pooled = []
            for n in dict.fromkeys(p["sessions"] for p in result["points"]):
                reps = [p for p in result["points"] if p["sessions"] == n]
                pt = summarize(recs_by_n[n], sum(p["wall_s"] for p in reps), n)
                pt["repeats"] = [{k: p.get(k) for k in REPEAT_KEYS} for p in reps]
                pooled.append(pt)
            result["points"] = pooled
        for p in result["points"]:
            p.setdefault("repeats", [{k: p.get(k) for k in REPEAT_KEYS}])
        c.evidence("sweep.json", {"warmup": result["warmup"], "points": result["points"], "profile": settings.profile,
                                  "max_tokens": cfg["max_tokens"]})
        c.values["warmup"] = result["warmup"]
        c.values["points"] = [{k: p.get(k) for k in (*POINT_KEYS, "repeats")} for p in result["points"]]
        c.values["repeats"] = repeats
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
                     f"sessions; single session {c.values['single_session_output_tokens_per_s']:.0f} tok/s")


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
