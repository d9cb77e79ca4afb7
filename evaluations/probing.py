"""Helpers the check modules share: greedy probe runs and throughput prompts."""

from __future__ import annotations

import asyncio
import random

from bakeoff.loadgen.sweep import run_request
from bakeoff.specs import GenerationRequest


def probe_max_tokens(expected: str) -> int:
    """Tokens to generate for a probe: enough for the expected text plus slack.

    A character-level upper bound (no tokenizer in the parent process): BPE tokens cover at
    least one character, so ``len(expected) + 4`` always suffices.
    """
    return min(64, len(expected) + 4)


def run_probes(backend, probes, max_tokens: int | None = None, concurrency: int = 4) -> list[dict]:
    """Greedy outputs for each probe, in order.

    Returns:
        ``[{"id", "prompt", "expected", "text", "token_ids", "finish_reason", "status", "error"}]``.
    """
    async def main():
        sem = asyncio.Semaphore(concurrency)

        async def one(p):
            req = GenerationRequest(request_id=f"probe-{p.id}", prompt=p.prompt,
                                    max_tokens=max_tokens or probe_max_tokens(p.expected), temperature=0.0)
            async with sem:
                rec = await run_request(backend, req)
            return {"id": p.id, "task": p.task, "prompt": p.prompt, "expected": p.expected, "text": rec.output_text,
                    "token_ids": rec.output_token_ids, "finish_reason": rec.finish_reason, "status": rec.status,
                    "error": rec.error, "error_class": rec.error_class, "max_tokens": req.max_tokens}
        try:
            return await asyncio.gather(*(one(p) for p in probes))
        finally:
            await backend.aclose()

    return asyncio.run(main())


WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
         "quebec romeo sierra tango uniform victor whiskey xray yankee zulu").split()


def throughput_prompt(session: int, turn: int, fixture: bool) -> str:
    """A distinct prompt per (session, turn), so the prefix cache does not flatter results.

    For bakeoff's fixtures it is a counting prompt from a session-specific start (the
    fixture continues it); for other models a short list of random words.
    """
    rng = random.Random(session * 1009 + turn)
    if fixture:
        start = rng.randrange(10, 60)
        return "count: " + " ".join(str(start + i) for i in range(4))
    return "Continue this list: " + " ".join(rng.choice(WORDS) for _ in range(12))
