"""Closed-loop session sweeps: N concurrent sessions, each sending its next request when the
previous one ends (the usual "N concurrent sessions" serving benchmark).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable

from bakeoff.errors import EngineFailure
from bakeoff.loadgen.stats import summarize
from bakeoff.specs import GenerationRequest, RequestRecord


async def run_request(backend, req: GenerationRequest, session: int = 0, scheduled_ns: int | None = None,
                      count_tokens: Callable[[str], int] | None = None) -> RequestRecord:
    """Send one request through ``backend.stream`` and time it.

    Token counts: server usage first, then streamed token ids, then ``count_tokens`` on the
    text (client re-tokenization), then the number of content events; a disagreement between
    usage and the client's count is flagged (``accounting_mismatch``).

    Never raises for an engine failure: it is recorded in the record (``status="error"``).
    """
    rec = RequestRecord(request_id=req.request_id, session=session)
    rec.sent_ns = time.monotonic_ns()
    rec.scheduled_ns = scheduled_ns or rec.sent_ns
    texts: list[str] = []
    ids: list[int] | None = None
    n_events = 0
    usage = None
    try:
        async for ev in backend.stream(req):
            if ev.usage is not None:
                usage = ev.usage if usage is None else type(ev.usage)(
                    ev.usage.prompt_tokens if ev.usage.prompt_tokens is not None else usage.prompt_tokens,
                    ev.usage.completion_tokens if ev.usage.completion_tokens is not None else usage.completion_tokens)
            if ev.finish_reason:
                rec.finish_reason = ev.finish_reason
            if ev.kind == "reasoning":
                rec.reasoning_tokens += len(ev.token_ids) if ev.token_ids else 1
            if not ev.text and not ev.token_ids:
                continue
            if rec.first_token_ns is None:
                rec.first_token_ns = ev.t_ns
            k = len(ev.token_ids) if ev.token_ids else 1
            rec.token_times_ns.extend([ev.t_ns] * k)
            n_events += 1
            if ev.kind == "text":
                texts.append(ev.text)
            if ev.token_ids is not None:
                ids = (ids or []) + list(ev.token_ids)
        rec.end_ns = time.monotonic_ns()
    except EngineFailure as exc:
        rec.end_ns = time.monotonic_ns()
        rec.status, rec.error, rec.error_class = "error", exc.message, exc.failure_class
    except Exception as exc:  # an unexpected client bug is still data, not a crash
        rec.end_ns = time.monotonic_ns()
        rec.status, rec.error, rec.error_class = "error", f"{type(exc).__name__}: {exc}", "runtime-crash"
    rec.output_text = "".join(texts)
    rec.output_token_ids = ids
    if ids is not None:
        rec.client_output_tokens = len(ids)
    elif count_tokens is not None:
        rec.client_output_tokens = count_tokens(rec.output_text)
    else:
        rec.client_output_tokens = len(rec.token_times_ns)
    if usage is not None and usage.completion_tokens is not None:
        rec.output_tokens, rec.output_tokens_source = usage.completion_tokens, "server-usage"
        rec.accounting_mismatch = rec.client_output_tokens is not None and rec.client_output_tokens != usage.completion_tokens
        # ITL per token: when usage says more tokens than events carried, spread chunk tokens
        if ids is None and usage.completion_tokens > len(rec.token_times_ns) and rec.status == "ok":
            rec.accounting_mismatch = False if count_tokens is None else rec.accounting_mismatch
    elif ids is not None:
        rec.output_tokens, rec.output_tokens_source = len(ids), "token-ids"
    else:
        rec.output_tokens, rec.output_tokens_source = rec.client_output_tokens, "client"
    rec.input_tokens = usage.prompt_tokens if usage is not None else None
    return rec


async def closed_loop(backend, make_request: Callable[[int, int], GenerationRequest], sessions: int,
                      requests_per_session: int, max_error_rate: float = 0.5) -> tuple[list[RequestRecord], float]:
    """Run ``sessions`` concurrent sessions, each sending ``requests_per_session`` requests.

    Args:
        backend: a started Backend.
        make_request: ``(session, turn) -> GenerationRequest`` (distinct prompt per session).
        sessions: concurrency.
        requests_per_session: requests each session sends, back to back.
        max_error_rate: once more than this fraction of finished requests failed (after at
            least ``sessions`` requests), sessions stop sending: the point ends cleanly.

    Returns:
        ``(records, wall_s)``.
    """
    records: list[RequestRecord] = []
    stop = asyncio.Event()

    async def session(i: int) -> None:
        for turn in range(requests_per_session):
            if stop.is_set():
                return
            rec = await run_request(backend, make_request(i, turn), session=i)
            records.append(rec)
            errs = sum(1 for r in records if r.status == "error")
            if len(records) >= sessions and errs / len(records) > max_error_rate:
                stop.set()

    t0 = time.monotonic()
    await asyncio.gather(*(session(i) for i in range(sessions)))
    return records, time.monotonic() - t0


def run_sweep(backend, make_request: Callable[[int, int], GenerationRequest], session_counts: list[int],
              requests_per_session: int, warmup_requests: int = 2,
              on_point: Callable[[dict[str, Any], list[RequestRecord]], None] | None = None) -> dict[str, Any]:
    """A session sweep with warm-up requests reported apart.

    Args:
        backend: a started Backend.
        make_request: ``(session, turn) -> GenerationRequest``.
        session_counts: e.g. ``[1, 2, 4, 8, 16, 32]``.
        requests_per_session: per point.
        warmup_requests: sent one at a time before the first point; reported apart.
        on_point: called after each point with its summary and records (so nothing measured
            is lost if a later point crashes the engine).

    Returns:
        ``{"warmup": summary, "points": [summary...]}``; a point whose requests all failed is
        kept with its errors; the sweep stops after a point with errors only.
    """
    async def main() -> dict[str, Any]:
        out: dict[str, Any] = {"warmup": None, "points": []}
        try:
            warm: list[RequestRecord] = []
            t0 = time.monotonic()
            for k in range(warmup_requests):
                warm.append(await run_request(backend, make_request(10_000 + k, 0), session=-1))
            w = summarize(warm, time.monotonic() - t0, 1)
            w["first_request_ttft_ms"] = ((warm[0].first_token_ns - warm[0].sent_ns) / 1e6
                                          if warm and warm[0].first_token_ns else None)
            out["warmup"] = w
            for n in session_counts:
                recs, wall = await closed_loop(backend, make_request, n, requests_per_session)
                point = summarize(recs, wall, n)
                out["points"].append(point)
                if on_point:
                    on_point(point, recs)
                if point["ok"] == 0:
                    break
        finally:
            await backend.aclose()
        return out

    return asyncio.run(main())
