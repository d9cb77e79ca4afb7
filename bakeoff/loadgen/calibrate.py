"""Self-calibration: the load generator measured against the synthetic server's send times.

At a planned load (concurrency, TTFT and ITL schedule) the generator streams from
:mod:`bakeoff.loadgen.synth_server`, which records when it really wrote every event. The
difference between what the client measured and what the server sent is the client's own
error (docs/design.md "Measurement": a sweep point whose client error exceeds the budget is
marked invalid, not silently kept).

Entry points:
- :func:`calibrate` ``(concurrency, ...) -> dict``: one load level.
- :func:`calibrate_sweep` ``(concurrencies, ...) -> dict``: several; ``calibrated_concurrency``
  is the highest level within budget; pass it to ``run_sweep(calibrated_concurrency=...)``.
``bakeoff calibrate --concurrency N [...]`` (``cli/tools.py``) checks its values and calls
:func:`calibrate_sweep`.
"""

from __future__ import annotations

import tempfile
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict

from bakeoff.loadgen.synth_launch import SynthServer
from bakeoff.api.specs import BackendConfig, GenerationRequest, RequestRecord
from bakeoff.loadgen import run_loop
from bakeoff.loadgen.multiproc import closed_loop_mp
from bakeoff.loadgen.sweep import closed_loop


class ErrorBudget(BaseModel):
    """How wrong the generator may be and still be trusted (all ms).

    Attributes:
        ttft_p50_ms: median TTFT error (client TTFT - server TTFT).
        ttft_p99_ms: 99th percentile TTFT error.
        itl_p50_ms: median absolute per-token ITL error.
        itl_p99_ms: 99th percentile absolute per-token ITL error.
    """

    model_config = ConfigDict(extra="forbid")
    ttft_p50_ms: float = 5.0
    ttft_p99_ms: float = 25.0
    itl_p50_ms: float = 2.0
    itl_p99_ms: float = 25.0


def _pcts(values, prefix: str) -> dict[str, float | None]:
    a = np.asarray([v for v in values if v is not None], dtype=np.float64)
    out: dict[str, float | None] = {}
    for p in (50, 90, 99):
        out[f"{prefix}_p{p}_ms"] = float(np.percentile(a, p)) if a.size else None
    out[f"{prefix}_mean_ms"] = float(a.mean()) if a.size else None
    return out


def server_token_times(sent: dict) -> list[int]:
    """Per-token actual send times (ns) of one server record (a k-token event counts k times)."""
    return [a for _, a, k, kind in sent["events"] if kind in ("text", "reasoning") for _ in range(k)]


def compare_to_server(records: list[RequestRecord], sent: dict[str, dict]) -> dict[str, Any]:
    """The client's timing error per request and token against the server's records (ms).

    On one host's loopback, ``send()`` copies the request into the server's socket queue
    before it returns, and the client stamps ``sent_ns`` just before that call; the server
    stamps each event just before writing it. So the TTFT a perfect client would measure is
    ``server first-token write - client sent_ns``, and:

    - ``ttft_error`` = client TTFT - that = client first-token stamp - server first-token write
      (the client's delivery + loop lag; exact for bakeoff's client, whose send stamp is the
      write time);
    - ``ttft_error_vs_receipt`` = client TTFT - (server first-token write - server receipt
      stamp): also counts the server's own lag in reading the request (``receive_lag``, the
      server's latency, not the client's), a conservative upper bound;
    - ``itl_abs_error`` = |client per-token gap - server per-token write gap|;
    - ``token_lag`` = client token stamp - server write of that token.

    Returns:
        Percentiles of each, the distribution-level TTFT error (client p50 - server p50, with
        the server's TTFT from receipt), matched requests, token count mismatches.
    """
    ttft_err, ttft_rcpt, recv_lag, itl_err, c_ttft, s_ttft, tok_lag = [], [], [], [], [], [], []
    matched = count_mismatch = 0
    for r in records:
        s = sent.get(r.request_id)
        if s is None or r.status != "ok" or r.first_token_ns is None:
            continue
        st = server_token_times(s)
        if not st:
            continue
        matched += 1
        ct, stt = (r.first_token_ns - r.sent_ns) / 1e6, (st[0] - s["recv_ns"]) / 1e6
        c_ttft.append(ct)
        s_ttft.append(stt)
        ttft_err.append((r.first_token_ns - st[0]) / 1e6)
        ttft_rcpt.append(ct - stt)
        recv_lag.append((s["recv_ns"] - r.sent_ns) / 1e6)
        cts = r.token_times_ns
        if len(cts) != len(st):
            count_mismatch += 1
            continue
        c, sv = np.asarray(cts, dtype=np.int64), np.asarray(st, dtype=np.int64)
        itl_err.extend((np.diff(c) - np.diff(sv)) / 1e6)
        tok_lag.extend((c - sv) / 1e6)
    out: dict[str, Any] = {"matched_requests": matched, "token_count_mismatches": count_mismatch}
    out.update(_pcts(ttft_err, "ttft_error"))
    out.update(_pcts(ttft_rcpt, "ttft_error_vs_receipt"))
    out.update(_pcts(np.abs(itl_err), "itl_abs_error"))
    out.update(_pcts(recv_lag, "receive_lag"))
    out.update(_pcts(tok_lag, "token_lag"))
    out["client_ttft_p50_ms"] = float(np.median(c_ttft)) if c_ttft else None
    out["server_ttft_p50_ms"] = float(np.median(s_ttft)) if s_ttft else None
    out["ttft_p50_distribution_error_ms"] = (out["client_ttft_p50_ms"] - out["server_ttft_p50_ms"]
                                             if c_ttft else None)
    return out


def server_slip(sent: dict[str, dict]) -> dict[str, float | None]:
    """The server's own lateness (actual - nominal write time, ms) over every non-comment event."""
    slips = [(a - n) / 1e6 for s in sent.values() for n, a, _, kind in s["events"] if kind != "ka"]
    return _pcts(slips, "slip")


def _backend(url: str, extra_body: dict | None = None):
    # lazy: upward: the load generator reaches the openai backend (tests/test_layers.py ALLOWED); only calibration uses it
    from backends.openai.backend import OpenAIBackend

    b = OpenAIBackend(BackendConfig(backend="openai", model="synth", workdir=tempfile.gettempdir(),
                                    options={"base_url": url, "extra_body": extra_body or {}}))
    b.start()
    return b


def _run_load(url: str, concurrency: int, requests_per_session: int, max_tokens: int, processes: int,
              extra_body: dict | None = None) -> tuple[list[RequestRecord], float]:
    def make(session: int, turn: int) -> GenerationRequest:
        return GenerationRequest(request_id=f"cal-{session}-{turn}", prompt=f"calibration session {session} turn {turn}",
                                 max_tokens=max_tokens, ignore_eos=True)

    if processes > 1:
        recs, _, errors = closed_loop_mp(lambda: _backend(url, extra_body), make, concurrency, requests_per_session,
                                         processes=processes, max_error_rate=1.0)
        if errors:
            raise RuntimeError("load process failed:\n" + errors[0])
    else:
        backend = _backend(url, extra_body)

        async def main():
            try:
                return (await closed_loop(backend, make, concurrency, requests_per_session, max_error_rate=1.0))[0]
            finally:
                await backend.aclose()

        recs = run_loop(main())
    # turn 0 of every session opens its connection: reported apart, like a warm-up
    measured = [r for r in recs if not r.request_id.endswith("-0")]
    sent_ns = [r.sent_ns for r in measured]
    ends = [r.end_ns for r in measured if r.end_ns]
    wall = (max(ends) - min(sent_ns)) / 1e9 if measured else 0.0
    return measured, wall


def calibrate(concurrency: int, *, ttft_ms: float = 50.0, itl_ms: float = 10.0, output_tokens: int = 64,
              requests_per_session: int = 3, tokens_per_chunk: int = 1, processes: int = 1, server_workers: int = 1,
              budget: ErrorBudget | dict | None = None, measure_max_throughput: bool = True,
              server: SynthServer | None = None) -> dict[str, Any]:
    """Run the generator at ``concurrency`` against the synthetic server and report its own error.

    Args:
        concurrency: closed-loop sessions (the planned load).
        ttft_ms: the server's constant TTFT, ms.
        itl_ms: the server's constant per-token ITL, ms.
        output_tokens: tokens per response.
        requests_per_session: per session; the first of each session (connection set-up) is
            left out of the figures.
        tokens_per_chunk: tokens per SSE event.
        processes: client processes (event loops) to spread the sessions over.
        server_workers: synthetic server processes (``SO_REUSEPORT``).
        budget: the error budget (default :class:`ErrorBudget`).
        measure_max_throughput: also stream with zero TTFT/ITL to find the generator's maximum
            streamed tokens/s at this concurrency (``max_output_tokens_per_s``).
        server: an already started :class:`SynthServer` to use (its config is overridden per
            request).

    Returns:
        ``{"concurrency", "within_budget", "violations", "budget", "errors"}`` plus
        :func:`compare_to_server`'s figures (ms), ``server_slip`` (ms),
        ``output_tokens_per_s`` (achieved at the schedule), ``nominal_output_tokens_per_s``
        and ``max_output_tokens_per_s``.
    """
    budget = budget if isinstance(budget, ErrorBudget) else ErrorBudget.model_validate(budget or {})
    schedule = {"ttft": {"ms": ttft_ms}, "itl": {"ms": itl_ms}, "output_tokens": output_tokens,
                "tokens_per_chunk": tokens_per_chunk}
    own = server is None
    srv = server or SynthServer(schedule, workers=server_workers).start()
    try:
        srv.reset()
        recs, wall = _run_load(srv.url, concurrency, requests_per_session, output_tokens, processes,
                               None if own else {"synth": schedule})
        sent = srv.records(expect=concurrency * requests_per_session)
        out: dict[str, Any] = {"concurrency": concurrency, "processes": processes, "ttft_ms": ttft_ms,
                               "itl_ms": itl_ms, "output_tokens": output_tokens, "tokens_per_chunk": tokens_per_chunk,
                               "requests": len(recs), "errors": sum(r.status != "ok" for r in recs)}
        out.update(compare_to_server(recs, sent))
        out["server_slip"] = server_slip({r.request_id: sent[r.request_id] for r in recs if r.request_id in sent})
        toks = sum(r.output_tokens or 0 for r in recs if r.status == "ok")
        out["output_tokens_per_s"] = toks / wall if wall > 0 else None
        out["nominal_output_tokens_per_s"] = concurrency * output_tokens / ((ttft_ms + itl_ms * (output_tokens - 1)) / 1e3)
        if measure_max_throughput:
            out["max_output_tokens_per_s"] = _max_throughput(srv.url, concurrency, processes)
    finally:
        if own:
            srv.cleanup()
    out["violations"] = _violations(out, budget)
    out["within_budget"] = not out["violations"]
    out["budget"] = budget.model_dump()
    return out


def _max_throughput(url: str, concurrency: int, processes: int) -> float | None:
    """The generator's streamed output tokens/s at ``concurrency`` against zero TTFT and ITL."""
    fast = {"synth": {"ttft": {"ms": 0}, "itl": {"ms": 0}, "output_tokens": 256, "record": False, "tokens_per_chunk": 1}}
    recs, wall = _run_load(url, concurrency, 2, 256, processes, fast)
    toks = sum(r.output_tokens or 0 for r in recs if r.status == "ok")
    return toks / wall if wall > 0 else None


def _violations(out: dict[str, Any], budget: ErrorBudget) -> list[str]:
    """Each of the point's errors over its budget (or not measured), and its failed requests."""
    checks = {"ttft_p50_ms": out["ttft_error_p50_ms"], "ttft_p99_ms": out["ttft_error_p99_ms"],
              "itl_p50_ms": out["itl_abs_error_p50_ms"], "itl_p99_ms": out["itl_abs_error_p99_ms"]}
    found = [f"{k} error {v:.2f} > {getattr(budget, k)}" for k, v in checks.items()
             if v is None or abs(v) > getattr(budget, k)]
    return found + ([f"{out['errors']} failed requests"] if out["errors"] else [])


def calibrate_sweep(concurrencies: list[int], stop_at_first_miss: bool = True, **kwargs) -> dict[str, Any]:
    """:func:`calibrate` at each concurrency (ascending), sharing one synthetic server.

    Returns:
        ``{"points": [...], "calibrated_concurrency": highest concurrency within budget or 0}``.
    """
    points, best = [], 0
    workers = kwargs.pop("server_workers", 1)
    with SynthServer({}, workers=workers) as srv:
        for c in sorted(concurrencies):
            p = calibrate(c, server=srv, **kwargs)
            points.append(p)
            if p["within_budget"]:
                best = c
            elif stop_at_first_miss:
                break
    return {"points": points, "calibrated_concurrency": best}
