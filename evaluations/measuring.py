"""Helpers of the engine-side measurement checks (capacity, prefix cache, needles, spec
decode, agents): sequential requests, engine counter deltas, prompts sized in tokens.

Prompt sizes are calibrated against the engine's own usage (the prompt tokens it reports for a
prompt of k and 2k repeated units give tokens per unit), not a tokenizer in this process: an
engine may tokenize with one bakeoff cannot load. Output tokens are counted here too, with the
model's ``tokenizer.json`` where there is one (:func:`client_token_counter`), to check the
server's usage (bakeoff/loadgen/accounting.py).
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bakeoff.models.fixtures.corpus import KV_KEYS, kv_haystack, kv_pair, kv_prompt, kv_value
from bakeoff.loadgen.sweep import run_request
from bakeoff.api.specs import GenerationRequest, RequestRecord
from bakeoff.loadgen.accounting import model_token_counter

PREFIX_QUERIES = "vllm:prefix_cache_queries_total"
PREFIX_HITS = "vllm:prefix_cache_hits_total"


def send(engine, reqs: list[GenerationRequest], concurrency: int = 1) -> list[RequestRecord]:
    """Run requests (``concurrency`` at a time, in order) and return their records."""
    async def main() -> list[RequestRecord]:
        sem = asyncio.Semaphore(concurrency)

        async def one(i: int, r: GenerationRequest) -> RequestRecord:
            async with sem:
                return await run_request(engine, r, session=i)
        try:
            return list(await asyncio.gather(*(one(i, r) for i, r in enumerate(reqs))))
        finally:
            await engine.aclose()
    return asyncio.run(main())


def ttft_ms(r: RequestRecord) -> float | None:
    """Time to first token in ms (None when no token came)."""
    return (r.first_token_ns - r.sent_ns) / 1e6 if r.first_token_ns else None


def decode_tokens_per_s(r: RequestRecord) -> float | None:
    """Output tokens after the first, per second of decode time (E2E - TTFT)."""
    if not r.first_token_ns or not r.end_ns or (r.output_tokens or 0) < 2:
        return None
    dt = (r.end_ns - r.first_token_ns) / 1e9
    return (r.output_tokens - 1) / dt if dt > 0 else None


def read_metrics(engine) -> dict[str, float]:
    """``engine.metrics()``, {} when the engine has none or the read fails."""
    try:
        return dict(engine.metrics() or {})
    except Exception:  # counters are evidence, never a reason to crash a check
        return {}


def delta(before: dict[str, float], after: dict[str, float], prefix: str) -> dict[str, float]:
    """``after - before`` of every counter whose name starts with ``prefix``."""
    return {k: after[k] - before.get(k, 0.0) for k in sorted(after) if k.startswith(prefix)}


def wait_counter(engine, key: str, base: float, expect_at_least: float, timeout_s: float = 3.0) -> dict[str, float]:
    """Poll the engine's counters until ``key`` grew by ``expect_at_least`` (engines publish
    counters a scheduler step after the request ends) or ``timeout_s`` passes."""
    t_end = time.monotonic() + timeout_s
    while True:
        m = read_metrics(engine)
        if m.get(key, 0.0) - base >= expect_at_least or time.monotonic() > t_end:
            return m
        time.sleep(0.1)


def client_token_counter(settings, engine) -> tuple[Any, str]:
    """``(count_tokens or None, where it came from)``: the backend's own client tokenizer
    (``--backend-opt tokenizer=DIR`` of the openai backend), else the ``tokenizer.json`` of a
    local ``--model``."""

    own = engine.count_tokens
    if own is not None:
        return own, f"the backend's tokenizer ({getattr(own, 'path', 'tokenizer=')})"
    counter = model_token_counter(settings.model.path if settings.model.local else None)
    if counter is not None:
        return counter, f"the model's tokenizer ({counter.path})"
    return None, "no tokenizer: the model is not a local folder with tokenizer.json (pass --backend-opt tokenizer=DIR)"


def is_fixture(settings) -> bool:
    """A bakeoff fixture: named ``fixture:NAME``, or a folder its builder wrote (``fixture.json``)."""
    return settings.model.fixture is not None or (settings.model.local and (Path(settings.model.path) / "fixture.json").is_file())


def serves_one_at_a_time(engine) -> bool:
    """True for engines that do not batch (the transformers reference)."""
    return bool(engine.info and engine.info.concurrent_requests == 1)


def kv_unit(rng: random.Random, exclude: str = "") -> str:
    """One fixture key-value pair in the corpus's ``kv`` format (:func:`bakeoff.models.fixtures.corpus.kv_pair`)."""
    keys = [k for k in KV_KEYS if k not in exclude]
    return kv_pair(rng.choice(keys), kv_value(rng))


GENERIC_FILLER = ("The grass is green. The sky is blue. The sun is warm. Here we go. There and back again. ")


def filler_units(n: int, fixture: bool, seed: int, exclude: str = "") -> list[str]:
    """``n`` haystack units: fixture kv pairs, or generic sentences."""
    rng = random.Random(seed)
    if fixture:
        return [kv_unit(rng, exclude) for _ in range(n)]
    return [GENERIC_FILLER.strip() for _ in range(n)]


@dataclass(frozen=True)
class Calibration:
    """What two short requests say about an engine's prompts (:func:`calibrate`).

    Attributes:
        tokens_per_unit: prompt tokens per haystack unit.
        source: ``engine-usage`` or ``estimate`` (the engine reported no prompt usage).
        prefill_tokens_per_s: prompt tokens per second of TTFT of the longer request (its fixed
            overhead included: a lower bound at that length; longer prompts prefill slower, by
            attention), None when it could not be timed.
        probe_tokens: that request's prompt tokens.
        probe_ttft_ms: its TTFT in ms.
        short_tokens / short_ttft_ms: the shorter request's (about half as long), when timed: with the
            longer one they give the growth of prefill time with length (:meth:`prefill_s`).
    """

    tokens_per_unit: float
    source: str
    prefill_tokens_per_s: float | None = None
    probe_tokens: int | None = None
    probe_ttft_ms: float | None = None
    short_tokens: int | None = None
    short_ttft_ms: float | None = None

    def prefill_s(self, tokens: float) -> float | None:
        """Estimated prefill seconds of a ``tokens``-token prompt: ``a n + b n^2`` through the two
        timed prompts (attention's share grows with length: SmolLM2-135M through the transformers
        worker prefilled 417 tok/s at 1,600 tokens and 243 at 5,900), ``a, b >= 0``; linear at the
        longer prompt's rate where the two do not show growth (a fixed overhead, noise). None when
        the rate was not measured."""
        if not self.prefill_tokens_per_s:
            return None
        n2, t2 = self.probe_tokens, (self.probe_ttft_ms or 0) / 1e3
        n1, t1 = self.short_tokens, (self.short_ttft_ms or 0) / 1e3
        if n1 and n2 and t1 > 0 and t2 > 0 and n2 > 1.2 * n1:
            den = n1 * n2 * (n2 - n1)
            a, b = (t1 * n2 * n2 - t2 * n1 * n1) / den, (t2 * n1 - t1 * n2) / den
            if b > 0:
                a = max(a, 0.0)
                return a * tokens + b * tokens * tokens
        return tokens / self.prefill_tokens_per_s

    def values(self) -> dict[str, Any]:
        return {"prefill_tokens_per_s": None if self.prefill_tokens_per_s is None else round(self.prefill_tokens_per_s, 1),
                "prefill_measured_on": (f"a {self.probe_tokens}-token prompt, TTFT {self.probe_ttft_ms:.0f} ms"
                                        + (f" (and {self.short_tokens} tokens, {self.short_ttft_ms:.0f} ms)"
                                           if self.short_tokens and self.short_ttft_ms else "")
                                        if self.probe_tokens and self.probe_ttft_ms else "not measured")}


# Haystack units of the calibration's shorter prompt (the longer has twice as many): a fixture's unit is
# one key-value pair (about one token), a generic one a sentence (about 24 tokens). 20 sentences (about
# 480 and 960 tokens) reach the lengths a slow engine's budgets then allow (SmolLM2-135M on 2 cores: needle
# prompts up to ~920 tokens), at half the time of 40 (ORT GenAI: 3.0 + 6.8 s of each run, 2026-12-05); the
# fit through both points (``a n + b n^2``) extrapolates to longer prompts on faster engines.
CALIBRATION_UNITS = {True: 40, False: 20}


def calibrate(engine, fixture: bool, k: int | None = None) -> Calibration:
    """Prompt tokens per haystack unit, from the engine's usage on k and 2k units
    (default :data:`CALIBRATION_UNITS`), and the prefill rate from the TTFT of the longer one
    (``max_tokens`` 1, sent alone).

    Returns:
        The :class:`Calibration`; ``tokens_per_unit`` falls back to an estimate (1 token per
        fixture pair, each pair being one token of its tokenizer / 20 per generic sentence) when
        the engine reports no prompt usage, and the probe's tokens are then counted with it.
    """
    k = k or CALIBRATION_UNITS[bool(fixture)]
    # k units, then fewer when the engine refuses the longer prompt: a tokenizer that spends many
    # tokens per word (a fixture's small vocabulary under a real-size model, examples/h200/) puts
    # 2k generic sentences past a 2,048-token context, and the estimate then overshoots it.
    for n_units in (k, max(2, k // 4), 2):
        reqs = [GenerationRequest(request_id=f"calib-{n}-{time.monotonic_ns()}",
                                  prompt=_join(filler_units(n, fixture, 99), fixture), max_tokens=1)
                for n in (n_units, 2 * n_units)]
        recs = send(engine, reqs)
        if all(r.status == "ok" and r.input_tokens for r in recs):
            per_unit = max(0.5, (recs[1].input_tokens - recs[0].input_tokens) / n_units)
            return _with_rate(Calibration(per_unit, "engine-usage"), recs, [r.input_tokens for r in recs])
        if all(r.status == "ok" for r in recs):  # answered without usage: fewer units will not help
            per_unit = 1.0 if fixture else 20.0
            return _with_rate(Calibration(per_unit, "estimate"), recs, [int(per_unit * n_units), int(per_unit * 2 * n_units)])
    return Calibration(1.0 if fixture else 20.0, "estimate")


def _with_rate(cal: Calibration, recs: list[RequestRecord], tokens: list[int]) -> Calibration:
    """``cal`` with the longer request's rate and both requests' timings (the shorter is first)."""
    t, t_short = ttft_ms(recs[1]), ttft_ms(recs[0])
    if not t or not tokens[1]:
        return cal
    return Calibration(cal.tokens_per_unit, cal.source, tokens[1] / (t / 1e3), tokens[1], t,
                       tokens[0] if t_short else None, t_short or None)


def tokens_per_unit(engine, fixture: bool, k: int | None = None) -> tuple[float, str]:
    """``(tokens_per_unit, source)`` of :func:`calibrate`."""
    cal = calibrate(engine, fixture, k)
    return cal.tokens_per_unit, cal.source


def _join(units: list[str], fixture: bool) -> str:
    return kv_haystack(units) if fixture else " ".join(units)


def long_prompt(n_tokens: int, per_unit: float, fixture: bool, seed: int) -> tuple[str, str]:
    """A prompt of about ``n_tokens`` tokens that ends in a question with a known answer.

    Fixture: ``keys: <pairs> ; q`` (answer: q's value, q placed first); generic: filler
    sentences then ``The secret number is N`` asked at the end.

    Returns:
        ``(prompt, expected_answer)``.
    """
    rng = random.Random(seed)
    n = max(4, int(n_tokens / per_unit) - 3)
    if fixture:
        key, val = rng.choice(KV_KEYS), kv_value(rng)
        units = [kv_pair(key, val)] + filler_units(n - 1, True, seed, exclude=key)
        return kv_prompt(units, key), " " + val
    num = str(rng.randint(1000, 9999))
    return (f"The secret number is {num}. " + _join(filler_units(n, False, seed), False)
            + " What is the secret number? The secret number is"), " " + num


def summarize_ms(values: list[float | None]) -> dict[str, Any]:
    """min/median/max of a list of timings in ms (None dropped)."""
    import numpy as np

    v = [x for x in values if x is not None]
    if not v:
        return {"n": 0}
    return {"n": len(v), "min": round(min(v), 3), "median": round(float(np.median(v)), 3), "max": round(max(v), 3)}
