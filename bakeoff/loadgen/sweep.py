"""Load shapes: closed-loop sessions (N concurrent sessions, each sending its next request when
the previous one ends) and open-loop Poisson arrivals, plus the session sweep with warm-up.

Every request goes through :func:`run_request`, which never raises for an engine failure:
the failure is recorded with what was measured before it. Multi-process load (one event
loop per process) is in :mod:`bakeoff.loadgen.multiproc`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any, Callable

import numpy as np

from bakeoff.api.errors import EngineFailure
from bakeoff.loadgen.accounting import account
from bakeoff.loadgen.client import SENT_NS
from bakeoff.loadgen.serving_cpu import cpu_reading, us_per_token
from bakeoff.loadgen.stats import summarize
from bakeoff.api.specs import GenerationRequest, RequestRecord
from bakeoff.loadgen import run_loop


async def run_request(backend, req: GenerationRequest, session: int = 0, scheduled_ns: int | None = None,
                      count_tokens: Callable[[str], int] | None = None) -> RequestRecord:
    """Send one request through ``backend.stream`` and time it.

    Token counts and their agreement: :func:`bakeoff.loadgen.accounting.account` (streamed
    token ids, the client's tokenizer on each event's text, server usage; a disagreement sets
    ``accounting_mismatch``, failure class ``client-accounting``, and the figures use the
    client's count).

    Per-token times: an event carrying k tokens (k from its token ids, else from
    ``count_tokens`` on its text) contributes k entries to ``token_times_ns`` with its arrival
    time, so ITL is per token (k - 1 zero gaps). Reasoning (thinking) events are output tokens
    too, counted apart in ``reasoning_tokens``; their text is not in ``output_text``.

    Args:
        backend: a started Backend (anything with ``stream(request)``).
        req: the request.
        session: session (closed loop) or arrival index (open loop).
        scheduled_ns: when the request was due (``time.monotonic_ns()``); ``sent_ns -
            scheduled_ns`` is its queue wait. Default: now.
        count_tokens: client re-tokenization, ``text -> tokens``.

    Returns:
        The record; ``status="error"`` with ``error``/``error_class`` on failure, keeping every
        event received before it.
    """
    rec = RequestRecord(request_id=req.request_id, session=session)
    rec.sent_ns = time.monotonic_ns()  # replaced by the write time when the client reports it
    rec.scheduled_ns = scheduled_ns or rec.sent_ns
    evs: list = []
    usage_p = usage_c = None
    holder: list = [None, None]
    token = SENT_NS.set(holder)
    try:
        async for ev in backend.stream(req):
            if ev.usage is not None:
                if ev.usage.prompt_tokens is not None:
                    usage_p = ev.usage.prompt_tokens
                if ev.usage.completion_tokens is not None:
                    usage_c = ev.usage.completion_tokens
                if ev.usage.cached_prompt_tokens is not None:
                    rec.cached_prompt_tokens = ev.usage.cached_prompt_tokens
            if ev.finish_reason:
                rec.finish_reason = ev.finish_reason
            if ev.text or ev.token_ids or ev.logprobs or ev.step:
                evs.append(ev)
    except EngineFailure as exc:
        rec.status, rec.error, rec.error_class = "error", exc.message, exc.failure_class
    except Exception as exc:  # an unexpected client bug is still data, not a crash
        rec.status, rec.error, rec.error_class = "error", f"{type(exc).__name__}: {exc}", "runtime-crash"
    rec.end_ns = time.monotonic_ns()
    SENT_NS.reset(token)
    if holder[0] is not None:  # the HTTP client reported when the request bytes were written
        rec.sent_ns = holder[0]
    rec.response_headers = holder[1]
    completions = req.prompt is not None and getattr(backend, "api", "completions") == "completions"
    account(rec, evs, usage_p, usage_c, count_tokens, req.prompt if completions else None, req.max_tokens)
    if rec.cached_prompt_tokens is not None and (rec.input_tokens is None or rec.cached_prompt_tokens > rec.input_tokens):
        rec.cached_prompt_tokens = None  # more cached than prompted is impossible: never a figure
    short_stream(rec, req)  # the exact count first, where EOS was ignored
    unfinished_stream(rec)
    return rec


UNFINISHED = "the stream ended without a finish_reason"


def unfinished_stream(rec: RequestRecord) -> None:
    """A stream that ended (``[DONE]``, or its connection closed cleanly) with no event carrying a
    ``finish_reason`` did not finish: the server ended it before deciding why it stopped. Every
    OpenAI-compatible server states one on its last choice (``stop``, ``length``); llama-cpp-python's
    server, with its default ``interrupt_requests``, sends ``[DONE]`` mid-stream when another request
    waits (issue 37: 299 of 300 concurrent probe streams cut after one token, judged as wrong answers).
    A failed request, ``transport-distortion``, never a figure or an answer."""
    if rec.status == "ok" and not rec.finish_reason:
        rec.status, rec.error_class = "error", "transport-distortion"
        rec.error = (f"{UNFINISHED} after {rec.output_tokens or 0} tokens: the server ended it early (llama-cpp-python's "
                     "server does, with its default interrupt_requests, when another request waits)")


def short_stream(rec: RequestRecord, req: GenerationRequest) -> None:
    """A request that asked ``ignore_eos`` and got fewer than ``max_tokens`` tokens, counted exactly
    (accounting ``agree``), is not a full stream: it becomes a failed request, never a figure
    (issue 37: a server that cut 25 of 28 concurrent streams after one token passed the sweep).
    ``ineffective-option`` where the stream ended at EOS (the server ignored ``ignore_eos``), else
    ``transport-distortion`` (the stream ended early)."""
    n = rec.output_tokens
    if not (req.ignore_eos and rec.status == "ok" and rec.accounting == "agree" and isinstance(n, int)
            and n < req.max_tokens):
        return
    how = f"finish_reason {rec.finish_reason!r}" if rec.finish_reason else "no finish_reason"
    if rec.finish_reason == "stop":
        rec.status, rec.error_class = "error", "ineffective-option"
        rec.error = f"ignore_eos asked, but the stream ended at EOS after {n} of max_tokens {req.max_tokens} tokens ({how})"
    else:
        rec.status, rec.error_class = "error", "transport-distortion"
        rec.error = f"stream ended after {n} of max_tokens {req.max_tokens} tokens with EOS ignored ({how})"


async def sessions_loop(backend, make_request: Callable[[int, int], GenerationRequest], session_ids: list[int],
                        requests_per_session: int, max_error_rate: float = 0.5, start_at_ns: int | None = None,
                        count_tokens: Callable[[str], int] | None = None) -> list[RequestRecord]:
    """Closed-loop sessions ``session_ids`` on the running loop (the body of :func:`closed_loop`).

    Args:
        start_at_ns: wait until this ``time.monotonic_ns()`` before the first send (lines up
            several processes).
    """
    if start_at_ns is not None:
        await asyncio.sleep(max(0.0, (start_at_ns - time.monotonic_ns()) / 1e9))
    records: list[RequestRecord] = []
    stop = asyncio.Event()
    min_done = len(session_ids)

    async def session(i: int) -> None:
        for turn in range(requests_per_session):
            if stop.is_set():
                return
            rec = await run_request(backend, make_request(i, turn), session=i, count_tokens=count_tokens)
            records.append(rec)
            errs = sum(1 for r in records if r.status == "error")
            if len(records) >= min_done and errs / len(records) > max_error_rate:
                stop.set()

    await asyncio.gather(*(session(i) for i in session_ids))
    return records


async def closed_loop(backend, make_request: Callable[[int, int], GenerationRequest], sessions: int,
                      requests_per_session: int, max_error_rate: float = 0.5,
                      count_tokens: Callable[[str], int] | None = None) -> tuple[list[RequestRecord], float]:
    """Run ``sessions`` concurrent sessions, each sending ``requests_per_session`` requests.

    Args:
        backend: a started Backend.
        make_request: ``(session, turn) -> GenerationRequest`` (distinct prompt per session).
        sessions: concurrency.
        requests_per_session: requests each session sends, back to back.
        max_error_rate: once more than this fraction of finished requests failed (after at
            least ``sessions`` requests), sessions stop sending: the point ends cleanly and
            keeps every record measured so far.
        count_tokens: client re-tokenization (see :func:`run_request`).

    Returns:
        ``(records, wall_s)``.
    """
    t0 = time.monotonic()
    recs = await sessions_loop(backend, make_request, list(range(sessions)), requests_per_session,
                               max_error_rate, count_tokens=count_tokens)
    return recs, time.monotonic() - t0


async def pool_loop(backend, requests: list[GenerationRequest], concurrency: int,
                    count_tokens: Callable[[str], int] | None = None) -> tuple[list[RequestRecord], float]:
    """Send ``requests`` in order through ``concurrency`` workers that share one queue.

    The load shape of ``vllm bench serve --max-concurrency N --request-rate inf``: a request
    starts whenever one of the N slots is free, so concurrency stays at N until the queue
    drains. Sessions of :func:`closed_loop` instead own their requests and can end unevenly,
    leaving a tail with fewer requests in flight (lower tokens/s for the same engine).

    Returns:
        ``(records in request order, wall_s)``.
    """
    out: list[RequestRecord | None] = [None] * len(requests)
    next_i = 0

    async def worker(slot: int) -> None:
        nonlocal next_i
        while next_i < len(requests):
            i, next_i = next_i, next_i + 1
            out[i] = await run_request(backend, requests[i], session=slot, count_tokens=count_tokens)

    t0 = time.monotonic()
    await asyncio.gather(*(worker(k) for k in range(min(concurrency, len(requests)))))
    return [r for r in out if r is not None], time.monotonic() - t0


def poisson_arrivals_ns(rate_per_s: float, duration_s: float | None = None, n: int | None = None,
                        seed: int = 0) -> np.ndarray:
    """Offsets (ns from start) of a Poisson process: exponential gaps of mean ``1/rate_per_s`` s.

    Exactly one of ``duration_s`` (arrivals before it) or ``n`` (that many arrivals) is given.
    """
    if (duration_s is None) == (n is None):
        raise ValueError("give exactly one of duration_s or n")
    rng = np.random.default_rng(seed)
    count = n if n is not None else max(16, int(rate_per_s * duration_s * 1.5 + 10 * np.sqrt(rate_per_s * duration_s)))
    t = np.cumsum(rng.exponential(1.0 / rate_per_s, size=count))
    if duration_s is not None:
        t = t[t < duration_s]
    return (t * 1e9).astype(np.int64)


async def open_loop(backend, make_request: Callable[[int, int], GenerationRequest], rate_per_s: float,
                    duration_s: float | None = None, n: int | None = None, seed: int = 0,
                    max_concurrency: int | None = None, max_error_rate: float = 0.5,
                    count_tokens: Callable[[str], int] | None = None,
                    start_at_ns: int | None = None) -> tuple[list[RequestRecord], float]:
    """Open-loop load: requests arrive as a Poisson process whatever the server's pace.

    Each request's ``scheduled_ns`` is its arrival time, so ``ttft_from_schedule_ms`` includes
    any wait for a free slot (``max_concurrency``) and the generator's own lateness.

    Args:
        backend: a started Backend.
        make_request: ``(index, 0) -> GenerationRequest`` for arrival ``index``.
        rate_per_s: mean arrivals per second.
        duration_s: send arrivals falling within this many seconds; or
        n: send exactly this many arrivals.
        seed: seed of the arrival process.
        max_concurrency: at most this many requests in flight (excess arrivals queue).
        max_error_rate: past this failed fraction (after 10 finished requests) no new arrival
            is sent; what was measured is kept.
        count_tokens: client re-tokenization.
        start_at_ns: time zero of the schedule (default: now).

    Returns:
        ``(records, wall_s)`` with records in arrival order of completion.
    """
    loop = asyncio.get_running_loop()
    offsets = poisson_arrivals_ns(rate_per_s, duration_s, n, seed)
    t0 = start_at_ns or time.monotonic_ns()
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    records: list[RequestRecord] = []
    tasks: list[asyncio.Task] = []
    stopped = False

    async def one(i: int, due: int) -> None:
        nonlocal stopped
        if stopped:
            return
        if sem is not None:
            async with sem:
                rec = await run_request(backend, make_request(i, 0), session=i, scheduled_ns=due,
                                        count_tokens=count_tokens)
        else:
            rec = await run_request(backend, make_request(i, 0), session=i, scheduled_ns=due, count_tokens=count_tokens)
        records.append(rec)
        errs = sum(1 for r in records if r.status == "error")
        if len(records) >= 10 and errs / len(records) > max_error_rate:
            stopped = True

    def launch(i: int, due: int) -> None:
        if not stopped:
            tasks.append(loop.create_task(one(i, due)))

    mono_to_loop = loop.time() - time.monotonic_ns() / 1e9
    for i, off in enumerate(offsets.tolist()):
        due = t0 + off
        loop.call_at(due / 1e9 + mono_to_loop, launch, i, due)
    end_due = (t0 + (int(offsets[-1]) if len(offsets) else 0)) / 1e9
    await asyncio.sleep(max(0.0, end_due - time.monotonic_ns() / 1e9) + 0.002)
    while len(tasks) < len(offsets) and not stopped:
        await asyncio.sleep(0.001)
    if tasks:
        await asyncio.gather(*tasks)
    return records, (time.monotonic_ns() - t0) / 1e9


def run_sweep(backend, make_request: Callable[[int, int], GenerationRequest], session_counts: list[int],
              requests_per_session: int, warmup_requests: int = 2,
              on_point: Callable[[dict[str, Any], list[RequestRecord]], None] | None = None,
              max_error_rate: float = 0.5, count_tokens: Callable[[str], int] | None = None,
              calibrated_concurrency: int | None = None) -> dict[str, Any]:
    """A session sweep with warm-up requests reported apart.

    Args:
        backend: a started Backend.
        make_request: ``(session, turn) -> GenerationRequest``.
        session_counts: e.g. ``[1, 2, 4, 8, 16, 32]``.
        requests_per_session: per point.
        warmup_requests: sent one at a time before the first point; reported apart.
        on_point: called after each point with its summary and records (so nothing measured
            is lost if a later point crashes the engine).
        max_error_rate: per point, see :func:`closed_loop`.
        count_tokens: client re-tokenization.
        calibrated_concurrency: the highest concurrency at which the load generator met its
            error budget (:func:`bakeoff.loadgen.calibrate.calibrate`); points above it get
            ``"valid": False`` and ``"invalid_reason"``.

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
                rec = await run_request(backend, make_request(10_000 + k, 0), session=-1, count_tokens=count_tokens)
                rec.warmup = True
                warm.append(rec)
            w = summarize([_unwarm(r) for r in warm], time.monotonic() - t0, 1)
            w["first_request_ttft_ms"] = ((warm[0].first_token_ns - warm[0].sent_ns) / 1e6
                                          if warm and warm[0].first_token_ns else None)
            out["warmup"] = w
            for n in session_counts:
                cpu0 = cpu_reading(backend, client_last=True)
                recs, wall = await closed_loop(backend, make_request, n, requests_per_session, max_error_rate,
                                               count_tokens)
                cpu1 = cpu_reading(backend)  # before summarize: its CPU is bakeoff's arithmetic, not serving
                point = summarize(recs, wall, n)
                point["cpu_us_per_output_token"] = us_per_token(cpu0, cpu1, point["output_tokens"])
                if calibrated_concurrency is not None:
                    point["valid"] = n <= calibrated_concurrency
                    if not point["valid"]:
                        point["invalid_reason"] = (f"{n} sessions exceed the load generator's calibrated "
                                                   f"concurrency {calibrated_concurrency}")
                out["points"].append(point)
                if on_point:
                    on_point(point, recs)
                if point["ok"] == 0:
                    break
        finally:
            await backend.aclose()
        return out

    return run_loop(main())


def _unwarm(r: RequestRecord) -> RequestRecord:
    """A copy counted by ``summarize`` (which skips warm-up records)."""
    return dataclasses.replace(r, warmup=False)
