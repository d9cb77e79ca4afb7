"""Load from several processes, each with its own event loop, records merged.

One Python event loop saturates somewhere between a few hundred and a few thousand SSE
events per second; past that its timestamps lag. Splitting sessions (or the arrival rate)
over processes keeps each loop light. Every process stamps with ``time.monotonic_ns()``,
one clock per host, so merged records stay comparable.

Processes are forked (``multiprocessing`` "fork" context), so ``backend_factory`` and
``make_request`` may be closures; the factory runs in the child and must return a backend
ready to ``stream`` (e.g. an :class:`backends.openai.backend.OpenAIBackend` after ``start()``,
or a fresh one built from the same config: HTTP backends hold no state that needs the
parent's engine).
"""

from __future__ import annotations

import multiprocessing as mp
import time
import traceback
from typing import Any, Callable

from bakeoff.api.specs import GenerationRequest, RequestRecord
from bakeoff.loadgen import run_loop
from bakeoff.loadgen.sweep import open_loop, sessions_loop


def _child(conn, backend_factory, mode: str, kwargs: dict[str, Any]) -> None:
    try:
        backend = backend_factory()

        async def main():
            try:
                if mode == "closed":
                    return await sessions_loop(backend, **kwargs)
                recs, _ = await open_loop(backend, **kwargs)
                return recs
            finally:
                await backend.aclose()

        conn.send(("ok", run_loop(main())))
    except BaseException:  # the parent turns this into data
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


def _run(backend_factory, mode: str, per_child: list[dict[str, Any]], timeout_s: float) -> tuple[list[RequestRecord], float, list[str]]:
    ctx = mp.get_context("fork")
    procs, pipes = [], []
    for kw in per_child:
        parent, child = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_child, args=(child, backend_factory, mode, kw), daemon=True)
        p.start()
        child.close()
        procs.append(p)
        pipes.append(parent)
    records: list[RequestRecord] = []
    errors: list[str] = []
    deadline = time.monotonic() + timeout_s
    for p, pipe in zip(procs, pipes):
        if pipe.poll(max(0.0, deadline - time.monotonic())):
            try:
                status, payload = pipe.recv()
            except EOFError:
                status, payload = "error", f"load process {p.pid} died (exit {p.exitcode})"
        else:
            status, payload = "error", f"load process {p.pid} gave no result within {timeout_s:.0f} s"
        if status == "ok":
            records.extend(payload)
        else:
            errors.append(payload)
    for p in procs:
        p.join(5)
        if p.is_alive():
            p.kill()
    sent = [r.sent_ns for r in records]
    ends = [r.end_ns for r in records if r.end_ns]
    wall_s = (max(ends) - min(sent)) / 1e9 if sent and ends else 0.0
    return records, wall_s, errors


def closed_loop_mp(backend_factory: Callable[[], Any], make_request: Callable[[int, int], GenerationRequest],
                   sessions: int, requests_per_session: int, processes: int = 2, max_error_rate: float = 0.5,
                   count_tokens: Callable[[str], int] | None = None, timeout_s: float = 3600.0,
                   ) -> tuple[list[RequestRecord], float, list[str]]:
    """Closed-loop sessions split round-robin over ``processes`` processes.

    Args:
        backend_factory: builds the backend in each child (called once per process).
        make_request: ``(session, turn) -> GenerationRequest`` with global session ids.
        sessions: total concurrent sessions.
        requests_per_session: per session.
        processes: event loops (processes) to spread them over.
        max_error_rate: applied per process (see :func:`bakeoff.loadgen.sweep.closed_loop`).
        count_tokens: client re-tokenization.
        timeout_s: deadline for every process to report.

    Returns:
        ``(records, wall_s, errors)``: merged records; wall seconds from the first send to the
        last end; one traceback per process that failed (its requests are missing, the
        others' are kept).
    """
    start_at = time.monotonic_ns() + int(0.3e9)
    per = [dict(make_request=make_request, session_ids=list(range(w, sessions, processes)),
                requests_per_session=requests_per_session, max_error_rate=max_error_rate, start_at_ns=start_at,
                count_tokens=count_tokens) for w in range(min(processes, sessions))]
    return _run(backend_factory, "closed", per, timeout_s)


def open_loop_mp(backend_factory: Callable[[], Any], make_request: Callable[[int, int], GenerationRequest],
                 rate_per_s: float, duration_s: float | None = None, n: int | None = None, processes: int = 2,
                 seed: int = 0, max_error_rate: float = 0.5, count_tokens: Callable[[str], int] | None = None,
                 timeout_s: float = 3600.0) -> tuple[list[RequestRecord], float, list[str]]:
    """Poisson arrivals at ``rate_per_s`` in all, as ``processes`` independent Poisson streams of
    ``rate_per_s / processes`` (a sum of independent Poisson processes is Poisson).

    ``make_request`` gets ``(process * 1_000_000 + index, 0)``; other arguments as in
    :func:`bakeoff.loadgen.sweep.open_loop`. Returns ``(records, wall_s, errors)``.
    """
    start_at = time.monotonic_ns() + int(0.3e9)
    per = []
    for w in range(processes):
        share = None if n is None else n // processes + (1 if w < n % processes else 0)
        per.append(dict(make_request=_offset(make_request, w * 1_000_000), rate_per_s=rate_per_s / processes,
                        duration_s=duration_s, n=share, seed=seed * 1000 + w, max_error_rate=max_error_rate,
                        count_tokens=count_tokens, start_at_ns=start_at))
    return _run(backend_factory, "open", per, timeout_s)


def _offset(make_request, base: int):
    return lambda i, turn: make_request(base + i, turn)
