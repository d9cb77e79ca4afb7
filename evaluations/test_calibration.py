"""Self-calibration of the load generator at the planned load, before the engine starts.

The generator runs against bakeoff's synthetic SSE server (known schedule: 50 ms TTFT, 10 ms
ITL) at each concurrency of the sweep; its own TTFT/ITL error against the server's recorded
send times decides up to which concurrency the sweep's figures can be trusted. Sweep points
above it are kept but marked ``valid: false`` (evaluations/test_throughput.py).

Once per ``bakeoff qualify`` command: the calibration measures the load generator on this host,
not the engine, so the command's runs share one (``BAKEOFF_CALIBRATION_FILE``, a file the command
owns). The first run measures it; a later run of the same command at the same sessions reuses a
calibration that certified every planned session (its values say which run measured it, and
when) and measures again after one that missed (the host may be quieter now).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from bakeoff.api.verdict import utc_now
from bakeoff.loadgen.calibrate import ErrorBudget, calibrate_sweep

SHARED_ENV = "BAKEOFF_CALIBRATION_FILE"


MAX_SHARED_BYTES = 1 << 20  # a calibration is a few KB; anything larger is not one
POINT_KEYS = {"concurrency", "within_budget", "violations"}  # what the check reads of each point


def _shared(sessions: list[int]) -> dict | None:
    """The command's calibration if an earlier run of it certified every session in ``sessions``:
    a regular file of at most :data:`MAX_SHARED_BYTES`, in the shape :func:`_share` writes; anything
    else (missing, damaged, another budget or sessions) is measured again, never trusted."""
    path = os.environ.get(SHARED_ENV)
    try:
        p = Path(path) if path else None
        if p is None or not p.is_file() or p.stat().st_size > MAX_SHARED_BYTES:  # not a FIFO, device or huge file
            return None
        saved = json.loads(p.read_bytes()[:MAX_SHARED_BYTES])
    except (OSError, ValueError, RecursionError):
        return None
    res = saved.get("result") if isinstance(saved, dict) else None
    ok = (isinstance(res, dict) and saved.get("sessions") == sessions and saved.get("budget") == ErrorBudget().model_dump()
          and _certifies(res, max(sessions))
          and isinstance(saved.get("measured_in_run"), str) and isinstance(saved.get("measured_at"), str))
    return saved if ok else None


def _certifies(res: dict, top: int) -> bool:
    """Whether a saved result is in :func:`calibrate_sweep`'s shape and certified ``top`` sessions within budget."""
    best, points = res.get("calibrated_concurrency"), res.get("points")
    return (type(best) is int and best == top and isinstance(points, list)
            and all(isinstance(q, dict) and POINT_KEYS <= q.keys() for q in points)
            and any(q["concurrency"] == best and q["within_budget"] is True for q in points))


def _share(sessions: list[int], res: dict, run_id: str) -> None:
    """Keep a calibration that certified every session for the command's later runs (a file that cannot
    be written is no loss: the later runs measure their own)."""
    path = os.environ.get(SHARED_ENV)
    if path and res["calibrated_concurrency"] == max(sessions):
        try:
            Path(path).write_text(json.dumps({"sessions": sessions, "budget": ErrorBudget().model_dump(), "result": res,
                                              "measured_in_run": run_id, "measured_at": utc_now()}))
        except OSError:
            pass


@pytest.mark.check("loadgen.calibration")
def test_calibration(run, settings):
    sessions = settings.profile_cfg["sessions"]
    with run.check("loadgen.calibration", "slo-miss") as c:
        saved = _shared(sessions)
        if saved:
            res = saved["result"]
            c.values["measured"] = (f"by run {saved['measured_in_run']} of this qualify command at "
                                    f"{saved['measured_at']} (the load generator on this host, not the engine)")
        else:
            res = calibrate_sweep(sessions, stop_at_first_miss=True, requests_per_session=2, output_tokens=32,
                                  measure_max_throughput=False)
            c.values["measured"] = "by this run"
            _share(sessions, res, run.verdict.run_id)
        c.evidence("calibration.json", res)
        best = res["calibrated_concurrency"]
        c.values.update({
            "calibrated_concurrency": best, "budget": ErrorBudget().model_dump(),
            "points": [{"concurrency": p["concurrency"], "within_budget": p["within_budget"],
                        "ttft_error_p50_ms": p.get("ttft_error_p50_ms"), "ttft_error_p99_ms": p.get("ttft_error_p99_ms"),
                        "itl_abs_error_p99_ms": p.get("itl_abs_error_p99_ms"), "violations": p["violations"]}
                       for p in res["points"]]})
        above = [n for n in sessions if n > best]
        if not best:  # nothing certified: on a loaded host the generator misses even at 1 session
            miss = res["points"][0]["violations"] if res["points"] else []
            c.skip(f"the load generator missed its error budget already at {sessions[0]} session(s) on this host "
                   f"({'; '.join(miss) or 'no point measured'}): every sweep point will be marked invalid; "
                   "rerun on an idle host")
        c.summary = (f"load generator within its error budget up to {best} sessions"
                     + (f"; sweep points at {above} sessions will be marked invalid" if above else "")
                     + ("" if c.values["measured"] == "by this run" else f" (measured {c.values['measured']})"))
