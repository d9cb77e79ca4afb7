"""Agents benchmark: N agents, T turns each, each turn appending a tool result to its context.

Each agent keeps its own growing transcript: turn t sends ``transcript + tool_result_t +
question``, then appends the question and the model's answer to the transcript, so every
turn's prompt extends the previous turn's prompt plus answer (what a coding or browsing
agent does). Agents run concurrently (closed loop: an agent sends its next turn when its
previous one ends). Reported: per-stream decode tok/s, aggregate output tok/s, TTFT of the
first turn (cold) and of later turns (warm: the transcript is a cached prefix), and the
engine's prefix-cache hit rate over the benchmark (``vllm:prefix_cache_hits_total`` /
``..._queries_total`` deltas) where the engine exposes it, else the sum of each response's cached
prompt tokens over its prompt tokens where every response states them (llama-server's ``timings``).

Report only: passes unless requests fail (their failure class). Each turn asks the top-k logprobs of
its tokens, so that ``served.twin`` can judge the turns against a twin run's turn by turn (a quantized
KV cache fine on turn 1 and wrong by turn 4). Sizes per profile are in
``SIZES`` (quick: 2 agents x 4 turns x ~160-token tool results: a few seconds on 2 CPU cores with vLLM).
"""

from __future__ import annotations

import asyncio
import random
import time

import numpy as np
import pytest

from bakeoff.analysis.sanity import TIE_TOP_K, jsonable_logprobs
from bakeoff.loadgen.sweep import run_request
from bakeoff.api.specs import GenerationRequest
from bakeoff.models.fixtures.corpus import KV_KEYS, kv_pair, kv_question, kv_value
from evaluations.measuring import (GENERIC_FILLER, PREFIX_HITS, PREFIX_QUERIES, decode_tokens_per_s, delta,
                                   is_fixture, read_metrics, serves_one_at_a_time, ttft_ms, wait_counter)
from evaluations.sizing import Budget, fit

# quick: contexts grow past vLLM's CPU KV block (128 tokens) from the second turn, so warm turns can hit.
SIZES = {"quick": {"agents": 2, "turns": 4, "tool_tokens": 160, "max_tokens": 16},
         "full": {"agents": 8, "turns": 6, "tool_tokens": 256, "max_tokens": 64}}
CONTEXT_BUDGET = 0.9  # the longest transcript stays under 90% of max_model_len


def tool_result(agent: int, turn: int, n_units: int, fixture: bool) -> str:
    """A tool-result-sized chunk: fixture kv pairs, or generic JSON-like filler."""
    rng = random.Random(agent * 1000 + turn)
    if fixture:
        return " " + " ".join(kv_pair(rng.choice(KV_KEYS), kv_value(rng)) for _ in range(n_units))
    return f' tool_result[{turn}] = "' + " ".join([GENERIC_FILLER.strip()] * n_units) + '"'


def question(agent: int, turn: int, fixture: bool) -> str:
    rng = random.Random(-(agent * 1000 + turn))
    return kv_question(rng.choice(KV_KEYS)) if fixture else "\nNext step:"


def fit_turns(size: dict, max_len: int, prompt_calibration, settings):
    """Shrink ``size["tool_tokens"]`` so the last turn fits the context and every turn's prompt the
    prefill budgets; returns the :class:`evaluations.sizing.Scale` it fitted."""
    per_turn = size["tool_tokens"] + size["max_tokens"] + 8
    if size["turns"] * per_turn > CONTEXT_BUDGET * max_len:  # keep the last turn inside the context
        size["tool_tokens"] = max(16, int(CONTEXT_BUDGET * max_len / size["turns"]) - size["max_tokens"] - 8)
    # turn t of each agent sends t + 1 turns' tokens: within the prefill budgets (no prefix-cache hit assumed)
    scale = fit(size["tool_tokens"] + size["max_tokens"] + 8, [t + 1 for _ in range(size["agents"])
                                                                for t in range(size["turns"])],
                prompt_calibration, Budget.of(settings), "tokens per turn")
    if scale.capped:
        size["tool_tokens"] = max(16, scale.tokens - size["max_tokens"] - 8)
    return scale


def turn_row(a: int, t: int, rec, prompt: str = "") -> dict:
    """One agent turn's record: status, token counts, cached prompt tokens, TTFT and decode rate, and
    what it was sent and answered (ids and top-k logprobs: ``served.twin`` judges turns against a twin run)."""
    return {"agent": a, "turn": t, "status": rec.status, "error": rec.error,
            "error_class": rec.error_class, "prompt_tokens": rec.input_tokens,
            "output_tokens": rec.output_tokens, "cached_prompt_tokens": rec.cached_prompt_tokens,
            "ttft_ms": ttft_ms(rec),
            "decode_tokens_per_s": decode_tokens_per_s(rec), "output": rec.output_text,
            "prompt": prompt, "token_ids": rec.output_token_ids, "logprobs": jsonable_logprobs(rec.output_logprobs)}


def run_agents(engine, size: dict, n_units: int, fixture: bool, rows: list[dict]) -> float:
    """Run the agents concurrently, each turn's row appended to ``rows`` as it ends; returns the wall time (s)."""
    async def agent(a: int) -> None:
        transcript = ("keys:" if fixture else f"You are agent {a}. Use the tool results below.")
        for t in range(size["turns"]):
            transcript += tool_result(a, t, n_units, fixture)
            prompt = transcript + question(a, t, fixture)
            rec = await run_request(engine, GenerationRequest(
                request_id=f"agent{a}-turn{t}", prompt=prompt, max_tokens=size["max_tokens"], temperature=0.0,
                ignore_eos=True, logprobs=TIE_TOP_K), session=a)
            rows.append(turn_row(a, t, rec, prompt))
            if rec.status != "ok":
                return
            transcript = prompt + rec.output_text

    async def main() -> float:
        t0 = time.monotonic()
        try:
            await asyncio.gather(*(agent(a) for a in range(size["agents"])))
        finally:
            await engine.aclose()
        return time.monotonic() - t0

    return asyncio.run(main())


def median_of(vals) -> float | None:
    """The median of the values given (None ones left out), to 2 places; None when none is left."""
    v = [x for x in vals if x is not None]
    return round(float(np.median(v)), 2) if v else None


def turn_figures(ok: list[dict], wall: float) -> dict:
    """Aggregate output tok/s, per-stream decode tok/s, TTFT cold (first turn) and warm (later turns)."""
    out_tok = sum(r["output_tokens"] or 0 for r in ok)
    return {"aggregate_output_tokens_per_s": round(out_tok / wall, 1) if wall > 0 else None,
            "per_stream_decode_tokens_per_s_p50": median_of([r["decode_tokens_per_s"] for r in ok]),
            "ttft_cold_p50_ms": median_of([r["ttft_ms"] for r in ok if r["turn"] == 0]),
            "ttft_warm_p50_ms": median_of([r["ttft_ms"] for r in ok if r["turn"] > 0]),
            "last_turn_prompt_tokens": max((r["prompt_tokens"] or 0 for r in ok), default=None)}


@pytest.mark.check("agents.multiturn")
def test_agents(run, settings, engine, prompt_calibration):
    fixture = is_fixture(settings)
    size = dict(SIZES.get(settings.profile, SIZES["quick"]))
    with run.check("agents.multiturn", "runtime-crash") as c:
        max_len = (engine.info.max_model_len if engine.info else None) or 2048
        per_unit, src = prompt_calibration.tokens_per_unit, prompt_calibration.source
        scale = fit_turns(size, max_len, prompt_calibration, settings)
        c.values.update(scale.values())
        n_units = max(2, int(size["tool_tokens"] / per_unit))
        before = read_metrics(engine)
        rows: list[dict] = []
        wall = run_agents(engine, size, n_units, fixture, rows)
        expect = sum(r["prompt_tokens"] or 0 for r in rows) * 0.5
        after = (wait_counter(engine, PREFIX_QUERIES, before.get(PREFIX_QUERIES, 0.0), expect)
                 if PREFIX_QUERIES in before else read_metrics(engine))
        d = delta(before, after, "vllm:prefix_cache")
        c.evidence("turns.json", rows)
        ok = [r for r in rows if r["status"] == "ok"]
        c.values.update({
            **size, "tool_result_units": n_units, "token_calibration": src, "requests": len(rows), "ok": len(ok),
            "wall_s": round(wall, 3), **turn_figures(ok, wall),
            "scheduling": "serialized by the engine (one request at a time)" if serves_one_at_a_time(engine) else "concurrent",
        })
        c.values.update(prefix_cache_values(PREFIX_QUERIES in after, d, ok))
        errs = [r for r in rows if r["status"] != "ok"]
        if errs:
            c.evidence("engine.log.tail", engine.log_tail(150))
            c.fail(f"{len(errs)} agent turns failed: {errs[0]['error']}", errs[0]["error_class"] or "runtime-crash")
        hr = c.values["prefix_cache_hit_rate"]
        c.summary = (f"{size['agents']} agents x {size['turns']} turns: {c.values['aggregate_output_tokens_per_s']} "
                     f"output tok/s aggregate, {c.values['per_stream_decode_tokens_per_s_p50']} tok/s per stream; TTFT "
                     f"cold {c.values['ttft_cold_p50_ms']} / warm {c.values['ttft_warm_p50_ms']} ms; prefix-cache hit rate "
                     + (f"{hr:.0%}" if hr is not None else "unavailable"))


def prefix_cache_values(counted: bool, d: dict, ok: list[dict]) -> dict:
    """The benchmark's prefix-cache queries, hits (tokens) and hit rate: from the engine's counter
    deltas ``d`` where it has them (``counted``), else from every response's own cached prompt
    tokens where each states them, else unavailable."""
    said = ok and all(r["cached_prompt_tokens"] is not None and r["prompt_tokens"] is not None for r in ok)
    if not counted and not said:
        return {"prefix_cache_hit_rate": None,
                "prefix_cache": "counters unavailable (the engine exposes no prefix-cache counters)"}
    q, h = ((d.get(PREFIX_QUERIES, 0.0), d.get(PREFIX_HITS, 0.0)) if counted else
            (sum(r["prompt_tokens"] for r in ok), sum(r["cached_prompt_tokens"] for r in ok)))
    return {"prefix_cache_queries_tokens": q, "prefix_cache_hits_tokens": h,
            "prefix_cache_hit_rate": round(h / q, 3) if q else None,
            "prefix_cache": ("the engine's counters" if counted else
                             "each response's cached prompt tokens (the server's usage or timings)")}
