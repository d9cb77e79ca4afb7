"""What the served checks send (``evaluations/test_served.py``): the quiet pass of the sweep's
prompts, the sweep's highest point replayed with probes interleaved, and the probe subset they share.

Every row has one shape (:func:`request_row`), the one :func:`bakeoff.analysis.served.compare_served`
reads: ``id``, ``prompt``, ``text``, ``token_ids``, ``logprobs``, ``finish_reason``, ``status``,
``error``, ``error_class``, ``ignore_eos``, ``max_tokens``.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from typing import Any, Callable

from bakeoff.analysis.sanity import jsonable_logprobs
from bakeoff.api.specs import GenerationRequest, RequestRecord
from bakeoff.loadgen.sweep import run_request
from evaluations.probing import budget

# Probes the served checks send under each condition: spread over every task family of the probe set.
# 32 keep the alone pass (one probe at a time) near 5 s on a 2-core host for SmolLM2-135M through vLLM
# (48 made the real model's quick run 28% longer, the budget is 20%), and still fail an engine
# at 3 real divergences (bakeoff.analysis.served.smallest_failing(32)).
SERVED_PROBES = 32
# The quiet pass sends each distinct sweep prompt once, alone: sessions x requests per session of the
# highest point, at most this many (the full profile's 32 sessions x 4: 128 requests).
MAX_QUIET_PROMPTS = 128


def request_row(req: GenerationRequest, rec: RequestRecord) -> dict[str, Any]:
    """One request and what it returned, in the served checks' shape (module docstring)."""
    return {"id": req.request_id, "prompt": req.prompt, "text": rec.output_text, "token_ids": rec.output_token_ids,
            "logprobs": jsonable_logprobs(rec.output_logprobs), "finish_reason": rec.finish_reason,
            "status": rec.status, "error": rec.error, "error_class": rec.error_class,
            "ignore_eos": req.ignore_eos, "max_tokens": req.max_tokens}


def read_evidence(run, rel: str) -> Any:
    """A JSON file of the run directory (``evidence/...``), None when absent or unreadable."""
    path = run.dir.path / rel
    try:
        return json.loads(path.read_text()) if path.is_file() else None
    except (OSError, ValueError):
        return None


def probe_subset(items: list, quiet: list[dict], n: int = SERVED_PROBES) -> list:
    """At most ``n`` probes whose quiet outputs ended ok with token ids, spread evenly over the probe
    set (every family), in the probe set's order; deterministic."""
    ok = {o["id"] for o in quiet if o.get("status") == "ok" and (o.get("token_ids") or o.get("text"))}
    usable = [p for p in items if p.id in ok]
    if len(usable) <= n:
        return usable
    return [usable[i * len(usable) // n] for i in range(n)]


def probe_request(p, prefix: str, logprobs: int | None) -> GenerationRequest:
    """The greedy request of one probe, as :func:`evaluations.probing.run_probes` sends it."""
    return GenerationRequest(request_id=f"{prefix}-{p.id}", prompt=p.prompt, messages=getattr(p, "messages", None),
                             max_tokens=budget(p), temperature=0.0, logprobs=logprobs)


def send_rows(engine, reqs: list[GenerationRequest], concurrency: int = 1) -> list[dict[str, Any]]:
    """Send ``reqs`` (``concurrency`` in flight, in order) and return their rows in order."""
    async def main() -> list[dict[str, Any]]:
        sem = asyncio.Semaphore(concurrency)

        async def one(i: int, r: GenerationRequest) -> dict[str, Any]:
            async with sem:
                return request_row(r, await run_request(engine, r, session=i))
        try:
            return list(await asyncio.gather(*(one(i, r) for i, r in enumerate(reqs))))
        finally:
            await engine.aclose()
    return asyncio.run(main())


def loaded_phase(engine, probes: list[GenerationRequest], make_load: Callable[[int, int], GenerationRequest],
                 sessions: int, turns: int) -> tuple[list[dict], list[dict], float]:
    """The sweep's highest point replayed with the probes interleaved: ``sessions`` closed-loop
    sessions, each sending a load request (``make_load(session, turn % turns)``, the sweep's own) then
    the next probe of a shared queue, until every probe was sent (a session that finds the queue empty
    ends after its load request). Every request of it is an output under that load.

    Returns:
        ``(probe rows in the given order, load rows, wall seconds)``.
    """
    queue = deque(probes)
    by_id: dict[str, dict] = {}
    load_rows: list[dict] = []

    async def session(i: int) -> None:
        turn = 0
        while True:
            req = make_load(i, turn % turns)
            load_rows.append({**request_row(req, await run_request(engine, req, session=i)), "session": i})
            if not queue:
                return
            p = queue.popleft()
            by_id[p.request_id] = request_row(p, await run_request(engine, p, session=i))
            turn += 1

    async def main() -> float:
        t0 = time.monotonic()
        try:
            await asyncio.gather(*(session(i) for i in range(sessions)))
        finally:
            await engine.aclose()
        return time.monotonic() - t0

    wall = asyncio.run(main())
    return [by_id[p.request_id] for p in probes], load_rows, wall


async def _cancelled(engine, req: GenerationRequest, after_tokens: int) -> dict[str, Any]:
    """Stream ``req`` and stop reading after ``after_tokens`` content events (module helper of
    :func:`cancelled_streams`)."""
    got, text = 0, ""
    events = engine.stream(req)
    try:
        async for ev in events:
            if ev.text or ev.token_ids:
                got += 1
                text += ev.text
            if got >= after_tokens:
                break
    except Exception as exc:  # noqa: BLE001 - a failed stream is evidence, never a crash of the check
        return {"id": req.request_id, "status": "error", "error": f"{type(exc).__name__}: {exc}", "events": got}
    finally:
        await events.aclose()
    return {"id": req.request_id, "status": "cancelled", "events": got, "text": text}


def cancelled_streams(engine, reqs: list[GenerationRequest], after_tokens: int) -> list[dict[str, Any]]:
    """Stream ``reqs`` at once and stop reading each after ``after_tokens`` content events: the requests
    cancelled by their client (the connection closed, as a client that goes away closes it). Returns what
    came of each, in order."""
    async def main() -> list[dict[str, Any]]:
        try:
            return list(await asyncio.gather(*(_cancelled(engine, r, after_tokens) for r in reqs)))
        finally:
            await engine.aclose()
    return asyncio.run(main())


def cancelled_stream(engine, req: GenerationRequest, after_tokens: int) -> dict[str, Any]:
    """One request cancelled by its client after ``after_tokens`` content events (:func:`cancelled_streams`)."""
    return cancelled_streams(engine, [req], after_tokens)[0]
