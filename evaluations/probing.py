"""Helpers the check modules share: greedy probe runs and throughput prompts."""

from __future__ import annotations

import asyncio
import random

from bakeoff.loadgen.sweep import UNFINISHED, run_request
from bakeoff.api.specs import GenerationRequest
from bakeoff.analysis.sanity import jsonable_logprobs


# Tokens a completion probe gets beyond its expected text's own token count: room for the answer in a
# less usual split of the same text (the check is a prefix match on the decoded text). SmolLM2-135M-Instruct's
# 240 completion probes: the character bound asked for 2,934 tokens, of which vLLM's right answers needed
# 1-4 each (81% of what it generated came after the answer); this budget asks for 1,260 (2026-12-05).
PROBE_SLACK_TOKENS = 3


def probe_max_tokens(expected: str, match: str = "prefix", tokenizer=None) -> int:
    """Tokens to generate for a probe: enough for the expected text plus slack.

    With the reference model's tokenizer (the same vocabulary the engine under test serves), a
    completion probe gets the expected text's token count plus :data:`PROBE_SLACK_TOKENS`.
    Without one, a character-level upper bound: BPE tokens cover at least one character, so
    ``len(expected) + 4`` always suffices; never more than that either way. A chat probe
    (``contains``) gets 48 tokens: the answer may come after a few words of prose.
    """
    if match == "contains":
        return 48
    bound = min(64, len(expected) + 4)
    if tokenizer is None:
        return bound
    return min(bound, len(tokenizer(expected, add_special_tokens=False)["input_ids"]) + PROBE_SLACK_TOKENS)


def budget(p) -> int:
    """A probe's token budget: its own (set from the reference tokenizer, see
    :func:`evaluations.reference.probe_set_of`), else the character bound."""
    return p.max_tokens or probe_max_tokens(p.expected, p.match)


# Probes in flight: enough for a batching engine to batch them (the transformers worker's static
# batches, og.Engine's, vLLM's scheduler); greedy outputs of a correct engine do not depend on it
# beyond numerical ties, which the agreement's tie rule names. 4 left SmolLM2-135M's 300 probes at
# 1.5 min through the transformers worker on 2 cores; 32 made the static-batching engines (batches of
# 16) slower, not faster: optimum-ort 3 min 07 s -> 3 min 25 s of its run, vLLM no faster (2026-12-05).
# The reference sends as many as its batches hold (evaluations/reference.py).
PROBE_CONCURRENCY = 16


def run_probes(backend, probes, max_tokens: int | None = None, concurrency: int = PROBE_CONCURRENCY,
               logprobs: int | None = None, order: str = "shortest", id_prefix: str = "probe") -> list[dict]:
    """Greedy outputs for each probe, in order.

    Args:
        backend: a started backend.
        probes: :class:`bakeoff.models.resolve.Probe` items.
        max_tokens: tokens per probe (default: each probe's :func:`budget`).
        concurrency: probes in flight.
        logprobs: ask for the top-k logprobs of each token (the tie rule's evidence).
        order: the order they are sent in: ``shortest`` first (the usual), or ``longest`` first (the same
            probes in other batches: ``served.batch_invariance``).
        id_prefix: each request's id is ``{id_prefix}-{probe id}``.

    Returns:
        ``[{"id", "task", "prompt", "expected", "match", "text", "token_ids", "logprobs",
        "finish_reason", "status", "error", "error_class", "max_tokens"}]``; ``logprobs`` in
        the JSON-safe form of :func:`bakeoff.analysis.sanity.jsonable_logprobs`.
    """

    async def main():
        sem = asyncio.Semaphore(concurrency)

        async def one(p):
            # a chat API is sent a chat probe's raw messages (its server renders them once), a completions
            # API the rendered prompt (bakeoff/loadgen/client.py OpenAIClient.body)
            req = GenerationRequest(request_id=f"{id_prefix}-{p.id}", prompt=p.prompt, messages=getattr(p, "messages", None),
                                    max_tokens=max_tokens or budget(p), temperature=0.0,
                                    logprobs=logprobs)
            async with sem:
                rec = await run_request(backend, req)
            return {"id": p.id, "task": p.task, "prompt": p.prompt, "expected": p.expected, "match": p.match,
                    "text": rec.output_text, "token_ids": rec.output_token_ids,
                    "logprobs": jsonable_logprobs(rec.output_logprobs), "finish_reason": rec.finish_reason, "status": rec.status,
                    "error": rec.error, "error_class": rec.error_class, "max_tokens": req.max_tokens}
        # sent shortest first (tokens to generate, then prompt length), answered in the given order: a
        # static batch runs to its longest row, so alike probes batched together waste less (SmolLM2-135M's
        # 300 probes through the reference's static batches: 98 s in the given order, 88 s sorted)
        sent = sorted(range(len(probes)), key=lambda i: (budget(probes[i]), len(probes[i].prompt)),
                      reverse=order == "longest")
        try:
            done = await asyncio.gather(*(one(probes[i]) for i in sent))
            # a stream the server ended without a finish_reason because others were in flight (llama-cpp-python's
            # interrupt_requests) is no answer: sent again alone, which is what such a server serves; the first
            # error is kept (``cut_under_concurrency``) and the throughput checks meet the cut streams themselves
            for k, row in enumerate(done):
                if row["status"] != "ok" and UNFINISHED in (row["error"] or ""):  # one at a time: awaited in turn
                    done[k] = {**await one(probes[sent[k]]), "cut_under_concurrency": row["error"]}
        finally:
            await backend.aclose()
        out: list[dict] = [{}] * len(probes)
        for i, row in zip(sent, done):
            out[i] = row
        return out

    return asyncio.run(main())


# Free-text openings for the degeneration detectors and the NLL judge, beside probe prompts: a
# broken engine shows itself in running text more than in a short answer.
OPEN_ENDED_TEXTS = ("Once upon a time, in a small village by the sea,", "The three most important things to know about",
                    "Here is a short summary of the history of the bicycle:", "def fibonacci(n):")


def open_ended_prompts(items, n: int = 8, fixture: bool | None = None) -> list[str]:
    """``n`` prompts for open-ended generation: probe prompts spread over every task family
    (every ``len/n``-th probe, not the first ``n`` of one family); for models with generic
    probes, half of them free-text openings (:data:`OPEN_ENDED_TEXTS`)."""
    prompts = [items[round(i * len(items) / n)].prompt for i in range(n)] if items else []
    generic = fixture is False or (fixture is None and items and items[0].id.startswith("g-"))
    if generic:
        prompts = prompts[: n - len(OPEN_ENDED_TEXTS)] + list(OPEN_ENDED_TEXTS)
    return prompts


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
        return "count: " + " ".join(str(start + i) for i in range(4)) + " =>"
    return "Continue this list: " + " ".join(rng.choice(WORDS) for _ in range(12))
