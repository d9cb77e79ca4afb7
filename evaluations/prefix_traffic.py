"""The prefix-cache correctness sequence (``prefix_cache.correctness``): cold, cold again, traffic that
ends on stop strings and requests cancelled mid-stream, then warm at concurrency.

The sequences are the ones engines broke in 2026: vLLM #5543 (a prompt's greedy output changed after a
warm-up batch that stopped on a stop string, prefix caching on), SGLang PR #24175 (cancelled requests
beside a radix cache: targeted outputs diverged), SGLang #34683 (two cold runs identical, the warm hit
flips outputs). For ``SEQUENCE_PROMPTS`` prompts, each long enough to fill whole KV blocks:

1. **cold**: each prompt alone, greedy, ``TOKENS`` tokens with top-k logprobs: the misses;
2. **cold again** (where the server takes a ``cache_salt``, :attr:`backends.base.Backend.cache_salt`):
   the same, all at once, each under a salt no request used, so served cold a second time: two cold
   runs must agree before a warm difference is blamed on the cache;
3. **traffic**: each prompt with a stop string its cold output meets in its first tokens (the request
   ends on it), all at once, then each prompt streamed and cancelled after ``CANCEL_AFTER`` tokens (the
   client closes the connection), all at once;
4. **warm**: every prompt at once, as in 1: the hits, proven by the engine's counters or each
   response's cached prompt tokens.

Each warm output is judged against its cold output (and cold again against cold) by
:func:`bakeoff.analysis.served.compare_served` and :func:`~bakeoff.analysis.served.judge_real`.
"""

from __future__ import annotations

import asyncio
from typing import Any

from bakeoff.analysis.sanity import TIE_TOP_K
from bakeoff.api.specs import GenerationRequest
from bakeoff.loadgen.sweep import run_request
from evaluations.measuring import PREFIX_HITS, PREFIX_QUERIES, delta, read_metrics, wait_counter
from evaluations.serving import cancelled_streams, request_row

SEQUENCE_PROMPTS = {"quick": 4, "full": 8}
TOKENS = 16  # a hit's output against its miss's: 16 greedy tokens (24 cost the real model's quick run 2 s more)
CANCEL_AFTER = 2


def stop_string(text: str) -> str | None:
    """Two characters the cold output meets early, past its first (so the stream ends on them with
    something generated), or None when the output is too short."""
    s = text.lstrip()
    return s[1:3] if len(s) >= 3 and s[1:3].strip() else None


def _req(rid: str, prompt: str, **kw: Any) -> GenerationRequest:
    return GenerationRequest(request_id=rid, prompt=prompt, max_tokens=kw.pop("max_tokens", TOKENS), temperature=0.0,
                             **kw)


def _phase(engine, reqs: list[GenerationRequest], concurrency: int) -> tuple[list[dict], dict[str, float], dict]:
    """Send ``reqs`` and read the prefix-cache counters around them: ``(rows, delta, after)``."""
    before = read_metrics(engine)

    async def main() -> list[dict]:
        sem = asyncio.Semaphore(concurrency)

        async def one(i: int, r: GenerationRequest) -> dict:
            async with sem:
                rec = await run_request(engine, r, session=i)
            return {**request_row(r, rec), "cached_prompt_tokens": rec.cached_prompt_tokens,
                    "prompt_tokens": rec.input_tokens}
        try:
            return list(await asyncio.gather(*(one(i, r) for i, r in enumerate(reqs))))
        finally:
            await engine.aclose()
    rows = asyncio.run(main())
    after = (wait_counter(engine, PREFIX_QUERIES, before.get(PREFIX_QUERIES, 0.0), 1.0)
             if PREFIX_QUERIES in before else read_metrics(engine))
    return rows, delta(before, after, "vllm:prefix_cache"), after


def hits_of(rows: list[dict], d: dict[str, float]) -> tuple[float | None, float | None]:
    """``(hit tokens, queried tokens)`` of a phase: the engine's counters, else the sum of each
    response's cached prompt tokens where every response states them; (None, None) without either."""
    if PREFIX_QUERIES in d:
        return d.get(PREFIX_HITS, 0.0), d.get(PREFIX_QUERIES, 0.0)
    if rows and all(r.get("cached_prompt_tokens") is not None and r.get("prompt_tokens") is not None for r in rows):
        return float(sum(r["cached_prompt_tokens"] for r in rows)), float(sum(r["prompt_tokens"] for r in rows))
    return None, None


def run_sequence(engine, prompts: list[str], salt: str) -> dict[str, Any]:
    """The four phases (module docstring) on ``prompts``; returns every phase's rows and counters.

    Args:
        salt: a run-unique word: the cold-again salts are ``{salt}-{i}`` (vLLM allows 128 characters,
            no ``/``, ``@``, ``\\``).
    """
    k = len(prompts)
    out: dict[str, Any] = {}
    cold, d, _ = _phase(engine, [_req(f"pcc-cold-{i}", p, ignore_eos=True, logprobs=TIE_TOP_K)
                                 for i, p in enumerate(prompts)], 1)
    out["cold"] = {"rows": cold, "hits_tokens": hits_of(cold, d)[0], "queries_tokens": hits_of(cold, d)[1]}
    if engine.cache_salt:  # all at once: cold again (nothing shared), and in another batch than the first
        again, d, _ = _phase(engine, [_req(f"pcc-again-{i}", p, ignore_eos=True, logprobs=TIE_TOP_K,
                                           cache_salt=f"{salt}-{i}") for i, p in enumerate(prompts)], k)
        out["cold_again"] = {"rows": again, "hits_tokens": hits_of(again, d)[0], "queries_tokens": hits_of(again, d)[1]}
    stops = [_req(f"pcc-stop-{i}", p, stop=[s]) for i, (p, r) in enumerate(zip(prompts, cold))
             if r.get("status") == "ok" and (s := stop_string(r.get("text") or ""))]
    stopped, _, _ = _phase(engine, stops, k)
    cancelled = cancelled_streams(engine, [_req(f"pcc-cancel-{i}", p, ignore_eos=True, max_tokens=4 * TOKENS)
                                           for i, p in enumerate(prompts)], CANCEL_AFTER)
    out["traffic"] = {"stopped": stopped, "cancelled": cancelled}
    warm, d, _ = _phase(engine, [_req(f"pcc-warm-{i}", p, ignore_eos=True, logprobs=TIE_TOP_K)
                                 for i, p in enumerate(prompts)], k)
    out["warm"] = {"rows": warm, "hits_tokens": hits_of(warm, d)[0], "queries_tokens": hits_of(warm, d)[1]}
    return out
