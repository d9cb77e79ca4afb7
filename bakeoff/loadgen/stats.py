"""Per-request figures and per-point summaries (numpy percentiles).

Definitions (as in vLLM's ``benchmarks/serve`` and guidellm):
- TTFT: first output token time - send time (``ttft_ms``); ``ttft_from_schedule_ms``
  adds the time the request waited for a free session slot.
- ITL: gaps between consecutive output tokens; a chunk carrying k tokens contributes k gaps,
  the first its arrival gap and the other k-1 of zero, so ITL is per token, not per chunk.
- TPOT: (E2E - TTFT) / (output tokens - 1).
- E2E latency: end - send.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from bakeoff.api.specs import RequestRecord

PCTS = (50, 90, 99)


def per_request(r: RequestRecord) -> dict[str, Any]:
    """Figures of one request in milliseconds; None where undefined."""
    out: dict[str, Any] = {"request_id": r.request_id, "session": r.session, "status": r.status,
                           "error": r.error, "error_class": r.error_class,
                           "input_tokens": r.input_tokens, "output_tokens": r.output_tokens,
                           "output_tokens_source": r.output_tokens_source,
                           "client_output_tokens": r.client_output_tokens,
                           "accounting_mismatch": r.accounting_mismatch, "reasoning_tokens": r.reasoning_tokens,
                           "usage_output_tokens": r.usage_output_tokens, "text_output_tokens": r.text_output_tokens,
                           "content_events": r.content_events, "accounting": r.accounting}
    ttft = (r.first_token_ns - r.sent_ns) / 1e6 if r.first_token_ns else None
    e2e = (r.end_ns - r.sent_ns) / 1e6 if r.end_ns else None
    out["ttft_ms"] = ttft
    out["ttft_from_schedule_ms"] = (r.first_token_ns - r.scheduled_ns) / 1e6 if r.first_token_ns and r.scheduled_ns else None
    out["queue_wait_ms"] = (r.sent_ns - r.scheduled_ns) / 1e6 if r.scheduled_ns else None
    out["e2e_ms"] = e2e
    n = r.output_tokens or 0
    out["tpot_ms"] = (e2e - ttft) / (n - 1) if (ttft is not None and e2e is not None and n > 1) else None
    times = r.token_times_ns
    out["itl_ms"] = [(b - a) / 1e6 for a, b in zip(times, times[1:])]
    return out


def pct(values: list[float], p: float) -> float | None:
    vals = [v for v in values if v is not None]
    return float(np.percentile(vals, p)) if vals else None


def summarize(records: list[RequestRecord], wall_s: float, sessions: int) -> dict[str, Any]:
    """Summary of one sweep point (warm-up requests excluded).

    Args:
        records: the point's requests.
        wall_s: seconds from the first send to the last end.
        sessions: concurrent sessions at this point.

    Returns:
        Aggregate output tok/s, per-session tok/s, TTFT/TPOT/ITL/E2E percentiles (ms),
        error count and rate, accounting mismatches and disputed counts (the client's tokenizer
        is not the server's: bakeoff/loadgen/accounting.py).
    """
    recs = [r for r in records if not r.warmup]
    rows = [per_request(r) for r in recs]
    ok = [x for x in rows if x["status"] == "ok"]
    out_tokens = sum(x["output_tokens"] or 0 for x in ok)
    s: dict[str, Any] = {
        "sessions": sessions, "requests": len(rows), "ok": len(ok), "errors": len(rows) - len(ok),
        "error_rate": (len(rows) - len(ok)) / len(rows) if rows else 0.0,
        "wall_s": wall_s, "output_tokens": out_tokens,
        "input_tokens": sum(x["input_tokens"] or 0 for x in ok),
        "output_tokens_per_s": out_tokens / wall_s if wall_s > 0 else None,
        "accounting_mismatches": sum(1 for x in ok if x["accounting_mismatch"]),
        "accounting_disputed": sum(1 for x in ok if x["accounting"] == "disputed"),
    }
    if s["accounting_mismatches"]:
        s["accounting_failure_class"] = "client-accounting"
    s["per_session_output_tokens_per_s"] = s["output_tokens_per_s"] / sessions if s["output_tokens_per_s"] else None
    s.update(_latencies(ok))
    s["errors_by_class"] = _errors_by_class(rows)
    return s


def _errors_by_class(rows: list[dict[str, Any]]) -> dict[str, int]:
    """How many requests failed, by failure class (``error`` where none was named)."""
    errs: dict[str, int] = {}
    for x in rows:
        if x["status"] != "ok":
            errs[x["error_class"] or "error"] = errs.get(x["error_class"] or "error", 0) + 1
    return errs


def _latencies(ok: list[dict[str, Any]]) -> dict[str, Any]:
    """TTFT (from the send and from the schedule), TPOT and E2E percentiles and means, and ITL
    percentiles over every gap of the successful requests, in ms (None where none was measured)."""
    s: dict[str, Any] = {}
    for name in ("ttft_ms", "ttft_from_schedule_ms", "tpot_ms", "e2e_ms"):
        vals = [x[name] for x in ok]
        for p in PCTS:
            s[f"{name[:-3]}_p{p}_ms"] = pct(vals, p)
        known = [v for v in vals if v is not None]
        s[f"{name[:-3]}_mean_ms"] = float(np.mean(known)) if known else None
    itl = [v for x in ok for v in x["itl_ms"]]
    for p in PCTS:
        s[f"itl_p{p}_ms"] = pct(itl, p)
    return s
