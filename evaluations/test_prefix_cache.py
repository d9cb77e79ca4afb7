"""Prefix cache: prefill cold vs warm, proven by the engine's counters, and output equality.

- ``prefix_cache.prefill``: the same long prompt twice, one token each; TTFT of the first
  (miss) and second (hit) give prefill tokens/s cold and warm. The engine's counters
  ``vllm:prefix_cache_queries_total`` / ``vllm:prefix_cache_hits_total`` (tokens) are read
  before and after each request: their deltas prove what the cache did. A repeated prompt
  with zero hits while prefix caching is on is an ``ineffective-option`` (docs/design.md failure
  classes). Where the engine has no counters but each response states its cached prompt tokens
  (OpenAI's ``usage.prompt_tokens_details.cached_tokens``, llama-server's ``timings.cache_n``:
  :func:`cache_proof`), those are the queries and hits of that request. Engines with neither get
  timings only (kept in values) and the check ends ``skip``: a faster second request is not
  proof of a cache.
- ``prefix_cache.correctness``: every hit's greedy output against its miss's after the traffic that
  broke engines in 2026 (:mod:`evaluations.prefix_traffic`: cold, cold again under a fresh
  ``cache_salt`` where the server takes one, stop-string and cancelled requests, then warm at
  concurrency), judged by the served rule (:mod:`bakeoff.analysis.served`: the tie rule of the
  reference agreement, vLLM's ``check_logprobs_close``, and real divergences by an exact binomial
  test, so one near-tie never decides); ``cache-correctness`` with both outputs and the tokens at
  the difference as evidence. Without counters or cached-token statements proving the hits, or
  with caching off, there is no hit to compare: the check skips, saying why.

"Long" is ``LONG_FRACTION`` of the engine's context: 0.73 x 2,048 = 1,500 tokens on the
fixture (the issue's example), long enough that prefill dominates TTFT; on an engine whose
measured prefill rate would take longer than the budgets (``evaluations/sizing.py``: each prompt,
and the ``2 x reps + 2`` prompts together), shorter, saying so in the values (``sizing``). An engine caches whole
KV blocks only: where it states a block longer than that (vLLM's hybrid allocator on the
Qwen3.5 fixture: ``Setting attention block size to 384 tokens``, ``BackendInfo.notes``
``kv_block_size_tokens``), the prompt is one block plus ``BLOCK_MARGIN`` tokens, so that a hit
is possible at all; where no prompt that fits the context can fill a block, both checks skip
saying so (a miss would then prove nothing about the cache).
"""

from __future__ import annotations

import time
import zlib

import pytest

from bakeoff.analysis.sanity import TIE_TOP_K, compare_tie_aware, jsonable_logprobs
from bakeoff.analysis.served import compare_served, counts, first_difference, judge_real
from bakeoff.api.specs import GenerationRequest
from evaluations.measuring import (PREFIX_HITS, PREFIX_QUERIES, delta, is_fixture, long_prompt, read_metrics, send,
                                   summarize_ms, ttft_ms, wait_counter)
from evaluations.prefix_traffic import SEQUENCE_PROMPTS, TOKENS, run_sequence
from evaluations.sizing import Budget, Scale, fit

LONG_FRACTION = 0.73
# Without prefix-cache counters neither check can verify a hit (both end ``skip``): the prefill check
# then times one pair on a prompt of at most this many tokens, kept as information, and the
# correctness check sends nothing (on SmolLM2-135M through the transformers worker the full-length
# pairs took 3.5 min of a run to end in the same two skips).
UNVERIFIABLE_PROMPT_TOKENS = 1024
BLOCK_MARGIN = 32  # prompt tokens past one whole KV block: vLLM never caches a prompt's last token
REPS = {"quick": 3, "full": 6}
CORRECTNESS_TOKENS = 24


def _pair(engine, prompt: str, rid: str, max_tokens: int, logprobs: int | None = None) -> list[dict]:
    """Send ``prompt`` twice (miss, then hit); counters read around each request; ``logprobs``:
    top-k log-probabilities of each output token (the tie rule's evidence)."""
    rows = []
    for phase in ("cold", "warm"):
        before = read_metrics(engine)
        rec = send(engine, [GenerationRequest(request_id=f"{rid}-{phase}", prompt=prompt, max_tokens=max_tokens,
                                              temperature=0.0, ignore_eos=max_tokens > 1, logprobs=logprobs)])[0]
        after = (wait_counter(engine, PREFIX_QUERIES, before.get(PREFIX_QUERIES, 0.0), 1.0)
                 if PREFIX_QUERIES in before else read_metrics(engine))
        d = delta(before, after, "vllm:prefix_cache")
        queries, hits = d.get(PREFIX_QUERIES), d.get(PREFIX_HITS)
        if queries is None and rec.cached_prompt_tokens is not None and rec.input_tokens is not None:
            queries, hits = rec.input_tokens, rec.cached_prompt_tokens  # the server's own word on this request
        t = ttft_ms(rec)
        rows.append({"phase": phase, "status": rec.status, "error": rec.error, "error_class": rec.error_class,
                     "prompt_tokens": rec.input_tokens, "ttft_ms": t,
                     "prefill_tokens_per_s": (rec.input_tokens / (t / 1e3)) if (t and rec.input_tokens) else None,
                     "queries_delta": queries, "hits_delta": hits,
                     "output_text": rec.output_text, "output_token_ids": rec.output_token_ids,
                     "output_logprobs": jsonable_logprobs(rec.output_logprobs)})
    return rows


@pytest.fixture(scope="module")
def long_len(engine, settings, prompt_calibration):
    """(target prompt tokens, tokens per haystack unit, calibration source, :class:`Scale`); the
    target covers one stated KV block (module docstring) within the prefill budgets
    (``evaluations/sizing.py``: the checks send it ``2 x reps + 2`` times), or is None when no
    prompt in the context, or in the budget, can."""
    max_len = (engine.info.max_model_len if engine.info else None) or 2048
    cal = prompt_calibration
    target = prompt_target(max_len, kv_block_tokens(engine))
    sends = 2 * REPS.get(settings.profile, 3) + 2
    scale = fit(target or 0, [1.0] * sends, cal, Budget.of(settings), "long prompt")
    block = kv_block_tokens(engine)
    if target is not None and scale.capped and block and scale.tokens < block + BLOCK_MARGIN:
        target = None  # no hit is possible within the budget
    return (scale.tokens if target is not None else None), cal.tokens_per_unit, cal.source, scale


def prompt_target(max_len: int, block: int | None) -> int | None:
    """Prompt tokens for the checks: ``LONG_FRACTION`` of the context, or one KV block plus
    ``BLOCK_MARGIN`` where the block is longer; None when that leaves no room for the answer."""
    target = int(LONG_FRACTION * max_len)
    if block and target < block + BLOCK_MARGIN:
        room = max_len - CORRECTNESS_TOKENS - 8  # the correctness check's answer must fit too
        target = block + BLOCK_MARGIN if block + BLOCK_MARGIN <= room else None
    return target


def kv_block_tokens(engine) -> int | None:
    """The KV block size the engine stated, in tokens (``BackendInfo.notes``), else None."""
    try:
        return int((engine.info.notes or {}).get("kv_block_size_tokens")) if engine.info else None
    except (TypeError, ValueError):
        return None


def _no_room(c, engine, scale: Scale) -> None:
    where = (f"no prompt within the prefill budgets ({scale.why})" if scale.capped else
             f"no prompt within max_model_len {engine.info.max_model_len} leaves room to fill one and answer")
    c.skip(f"the engine's KV blocks hold {kv_block_tokens(engine)} tokens (stated at start) and it caches whole blocks "
           f"only; {where}, so no prefix-cache hit is possible here")


def _caching_disabled(run) -> bool:
    v = run.verdict.options.get("enable_prefix_caching")
    return v is False or (isinstance(v, str) and v.strip().lower() in ("false", "0", "off", "no"))


@pytest.fixture(scope="module")
def cache_proof(engine) -> str | None:
    """How a prefix-cache hit is proven on this engine, the only proof there is (a faster second
    request is not one): ``counters`` (its metrics count prefix-cache queries and hits, vLLM's
    names), ``responses`` (each response states its cached prompt tokens: OpenAI's
    ``usage.prompt_tokens_details.cached_tokens``, llama-server's ``timings.cache_n``; asked with
    one 1-token request), or None."""
    if PREFIX_QUERIES in read_metrics(engine):
        return "counters"
    rec = send(engine, [GenerationRequest(request_id="pc-proof", prompt="The cache", max_tokens=1, temperature=0.0)])[0]
    return "responses" if rec.status == "ok" and rec.cached_prompt_tokens is not None else None


PROOF_WORDS = {"counters": "the engine's prefix-cache counters",
               "responses": "each response's cached prompt tokens (the server's usage or timings)"}


def _cold_warm_pairs(c, engine, settings, reps: int, target: int, per_unit: float, salt: int) -> list[dict]:
    """``reps`` cold/warm pairs of long prompts, one token each; the rows written as evidence after each pair."""
    rows = []
    for i in range(reps):
        prompt, _ = long_prompt(target, per_unit, is_fixture(settings), seed=salt * 100 + i)
        rows += [{**r, "rep": i} for r in _pair(engine, prompt, f"pc{i}", 1)]
        c.evidence("requests.json", rows)
    return rows


def _fail_on_errors(c, engine, rows: list[dict]) -> None:
    """Fail the check, with the engine's log tail, when any request failed."""
    errs = [r for r in rows if r["status"] != "ok"]
    if errs:
        c.evidence("engine.log.tail", engine.log_tail(150))
        c.fail(f"{len(errs)}/{len(rows)} requests failed: {errs[0]['error']}", errs[0]["error_class"] or "runtime-crash")


def _prefill_rates(tok: int | None, cs: dict, ws: dict) -> dict:
    """Prefill tokens/s cold and warm from the median TTFTs, and the warm speedup (None where unknown)."""
    return {
        "cold_prefill_tokens_per_s": round(tok / (cs["median"] / 1e3), 1) if tok and cs.get("median") else None,
        "warm_prefill_tokens_per_s": round(tok / (ws["median"] / 1e3), 1) if tok and ws.get("median") else None,
        "warm_speedup": round(cs["median"] / ws["median"], 2) if cs.get("median") and ws.get("median") else None,
    }


def _hit_values(cold_hits: list, hits: list, warm: list[dict]) -> dict:
    """The prefix-cache hit tokens of each send and the warm requests' hit rate."""
    return {"cold_hits_tokens": cold_hits, "warm_hits_tokens": hits,
            "warm_queries_tokens": [r["queries_delta"] for r in warm],
            "warm_hit_rate": round(sum(hits) / max(1.0, sum(r["queries_delta"] or 0 for r in warm)), 3)}


@pytest.mark.check("prefix_cache.prefill")
def test_prefill_cold_warm(run, settings, engine, long_len, cache_proof):
    target, per_unit, src, scale = long_len
    salt = zlib.crc32(run.dir.run_id.encode()) % 10_000
    with run.check("prefix_cache.prefill", "ineffective-option") as c:
        c.values.update(scale.values())
        if target is None:
            _no_room(c, engine, scale)
        reps = REPS.get(settings.profile, 3)
        if cache_proof is None:  # the check can only skip: one pair, a shorter prompt, for the record
            reps, target = 1, min(target, UNVERIFIABLE_PROMPT_TOKENS)
        rows = _cold_warm_pairs(c, engine, settings, reps, target, per_unit, salt)
        _fail_on_errors(c, engine, rows)
        cold = [r for r in rows if r["phase"] == "cold"]
        warm = [r for r in rows if r["phase"] == "warm"]
        counters = all(r["queries_delta"] is not None for r in rows)
        cs, ws = summarize_ms([r["ttft_ms"] for r in cold]), summarize_ms([r["ttft_ms"] for r in warm])
        tok = cold[0]["prompt_tokens"]
        c.values.update({
            "prompt_tokens": tok, "target_prompt_tokens": target, "token_calibration": src, "pairs": len(cold),
            "kv_block_size_tokens": kv_block_tokens(engine),
            "cold_ttft_ms": cs, "warm_ttft_ms": ws, **_prefill_rates(tok, cs, ws),
            "counters": PROOF_WORDS[cache_proof] if counters else "unavailable (the engine exposes no prefix-cache counters)",
            "prefix_caching_option": run.verdict.options.get("enable_prefix_caching", "engine default"),
        })
        if not counters:
            c.skip(f"cold {cs.get('median')} ms vs warm {ws.get('median')} ms TTFT on {tok} prompt tokens, one pair (kept "
                   "in values); the engine exposes no prefix-cache counters, so whether the warm request hit a cache is "
                   "unproven")
        hits = [r["hits_delta"] or 0 for r in warm]
        cold_hits = [r["hits_delta"] or 0 for r in cold]
        c.values.update(_hit_values(cold_hits, hits, warm))
        if _caching_disabled(run):
            c.require(sum(hits) == 0, f"prefix caching is off, yet a repeated {tok}-token prompt got {sum(hits):.0f} "
                                      "hit tokens", "ineffective-option")
            c.summary = f"prefix caching off, verified: 0 hit tokens; TTFT cold {cs['median']} / warm {ws['median']} ms"
            return
        c.require(min(hits) > 0, f"prefix cache on but a repeated {tok}-token prompt got {min(hits):.0f} hit tokens "
                                 f"(queries {warm[0]['queries_delta']:.0f})")
        unproven = unproven_hits(cold_hits, hits)
        c.require(unproven is None, f"{unproven}: {PROOF_WORDS[cache_proof]} do not show the repeat served from a cache")
        c.summary = (f"prefill {c.values['cold_prefill_tokens_per_s']} tok/s cold vs "
                     f"{c.values['warm_prefill_tokens_per_s']} tok/s warm ({c.values['warm_speedup']}x) on {tok} tokens; "
                     f"warm hit rate {c.values['warm_hit_rate']:.0%}" + (f" (prompt {scale.why})" if scale.capped else ""))


def _sequence_prompts(settings, target: int, per_unit: float, k: int) -> list[str]:
    """``k`` prompts of about ``target`` tokens, each its own from its first tokens (no shared block)."""
    return [long_prompt(target, per_unit, is_fixture(settings), seed=777_777 + i)[0] for i in range(k)]


# The sequence's prompts where the engine states no KV block (a token-granular cache, llama-server's): about
# two of vLLM CPU's blocks, and at least this many tokens for a hit to be worth comparing.
SEQUENCE_TOKENS = 2 * 128 + BLOCK_MARGIN
MIN_SEQUENCE_TOKENS = 64


def _sequence_target(engine, settings, long_len, k: int) -> tuple[int | None, Scale | None]:
    """Prompt tokens of the sequence: two KV blocks and a margin (:data:`SEQUENCE_TOKENS` where the engine
    states no block), within the long prompt's target and the prefill budgets for its ``5 k`` sends; None
    when that leaves less than one block and the margin (:data:`MIN_SEQUENCE_TOKENS` without a block)."""
    target, _, _, _ = long_len
    if target is None:
        return None, None
    block = kv_block_tokens(engine)
    want = min(target, 2 * block + BLOCK_MARGIN if block else SEQUENCE_TOKENS)
    scale = fit(want, [1.0] * (5 * k), settings_calibration(long_len), Budget.of(settings), "sequence prompt")
    if scale.tokens < (block + BLOCK_MARGIN if block else MIN_SEQUENCE_TOKENS):
        return None, scale
    return scale.tokens, scale


def settings_calibration(long_len):
    """The prompt calibration the long prompt was sized with (its :class:`Scale`'s)."""
    return long_len[3].calibration


@pytest.mark.check("prefix_cache.correctness")
def test_hit_equals_miss(run, settings, engine, long_len, cache_proof):
    """Every hit's greedy output against its miss's, after the traffic that broke engines
    (:mod:`evaluations.prefix_traffic`): warm at concurrency after stop strings and cancelled requests,
    judged by the served rule (tie rule, real divergences by an exact binomial test:
    :mod:`bakeoff.analysis.served`), ``cache-correctness``; two cold runs that already disagree
    (salted apart) are the engine's, not the cache's (``accuracy-regression``). Hits not proven by
    counters or by each response's cached tokens: skip (nothing is known to be a hit)."""
    _, per_unit, _, scale0 = long_len
    with run.check("prefix_cache.correctness", "cache-correctness") as c:
        c.values.update(scale0.values())
        if long_len[0] is None:
            _no_room(c, engine, scale0)
        if cache_proof is None:
            c.skip("the engine exposes no prefix-cache counters and its responses state no cached tokens, so no "
                   "request is known to be a hit: there is no hit to compare with a miss (nothing sent)")
        if _caching_disabled(run):
            c.skip("prefix caching is off for this run: there is no cache hit to compare with a miss")
        k = SEQUENCE_PROMPTS.get(settings.profile, 4)
        target, scale = _sequence_target(engine, settings, long_len, k)
        if target is None and kv_block_tokens(engine):
            _no_room(c, engine, scale or scale0)
        if target is None:
            c.skip(f"no sequence prompt of {MIN_SEQUENCE_TOKENS} tokens or more fits the prefill budgets "
                   f"({(scale or scale0).why}): nothing long enough to compare a hit on")
        salt = f"bakeoff-{zlib.crc32(run.dir.run_id.encode()):08x}"
        t0 = time.monotonic()
        seq = run_sequence(engine, _sequence_prompts(settings, target, per_unit, k), salt)
        c.values["sequence_s"] = round(time.monotonic() - t0, 2)
        c.evidence("sequence.json", seq)
        _fail_sequence_errors(c, engine, seq)
        cold, warm = seq["cold"]["rows"], seq["warm"]["rows"]
        rows, n = _compared([(w, q) for w, q in zip(warm, cold)])
        c.evidence("agreement.json", rows)
        hits, queries = seq["warm"]["hits_tokens"], seq["warm"]["queries_tokens"]
        c.values.update(_sequence_values(seq, k, n, cache_proof))
        _judge_cold_again(c, seq, cold)
        if not hits or hits <= (seq["cold"]["hits_tokens"] or 0):
            c.skip(f"the warm requests got {hits} hit tokens (cold {seq['cold']['hits_tokens']}): no hit proven, nothing to "
                   f"compare ({n['exact']} exact, {n['tie']} tie, {n['real']} real kept in values)")
        d = c.values["warm"]["decision"]
        real = [r for r in rows if r["outcome"] == "real"]
        c.require(not d["fails"], f"{n['real']}/{n['compared']} prefix-cache hits diverge from their misses past the tie "
                                  f"rule after stop-string and cancelled traffic, {k} warm requests in flight ({hits:.0f} hit "
                                  f"tokens); e.g. {first_difference(real[0], 'miss', 'hit') if real else ''}")
        if n["compared"] < len(rows) / 2:
            c.skip(f"{n['undetermined']}/{len(rows)} hit outputs differ from their misses where no logprobs tell a tie "
                   "from a real divergence: not verified")
        c.summary = (f"{n['exact']} exact, {n['tie']} tie, {n['real']} real of {len(rows)} hits against their misses after "
                     f"{c.values['stopped_on_stop_string']} stop-string and {c.values['cancelled']} cancelled requests, "
                     f"{k} in flight; {hits:.0f}/{queries:.0f} warm prompt tokens from the cache"
                     + ("; two cold runs agree" if "cold_again" in seq else "; no cache salt: cold not repeated"))


def _fail_sequence_errors(c, engine, seq: dict) -> None:
    """Fail with the first failed request of the sequence (a cancelled one is no failure)."""
    bad = [r for r in seq["cold"]["rows"] + seq["warm"]["rows"] + seq.get("cold_again", {}).get("rows", [])
           + seq["traffic"]["stopped"] if r["status"] != "ok"] + [
        r for r in seq["traffic"]["cancelled"] if r["status"] == "error"]
    if bad:
        c.evidence("engine.log.tail", engine.log_tail(150))
        c.fail(f"{len(bad)} requests of the sequence failed: {bad[0]['error']}", bad[0].get("error_class") or "runtime-crash")


def _sequence_values(seq: dict, k: int, n: dict, cache_proof: str) -> dict:
    """The check's values: the prompts, the traffic made, the hits proven and the warm comparison's counts."""
    return {"prompts": k, "prompt_tokens": seq["cold"]["rows"][0].get("prompt_tokens"), "tokens": TOKENS,
            "stopped_on_stop_string": sum(r.get("finish_reason") == "stop" for r in seq["traffic"]["stopped"]),
            "cancelled": sum(r["status"] == "cancelled" for r in seq["traffic"]["cancelled"]),
            "warm_hits_tokens": seq["warm"]["hits_tokens"], "warm_queries_tokens": seq["warm"]["queries_tokens"],
            "cold_hits_tokens": seq["cold"]["hits_tokens"], "warm": {**n, "decision": judge_real(n["real"], n["compared"])},
            "proof": PROOF_WORDS[cache_proof]}


def _compared(pairs: list[tuple[dict, dict]]) -> tuple[list[dict], dict]:
    """Comparison rows of ``(served, cold)`` pairs and their counts."""
    rows = [compare_served(s, q) for s, q in pairs]
    return rows, counts(rows)


def _judge_cold_again(c, seq: dict, cold: list[dict]) -> None:
    """Two cold runs (the second salted apart) that disagree past the rule: the engine's, not the cache's."""
    if "cold_again" not in seq:
        c.values["cold_again"] = "not run: the server takes no cache_salt"
        return
    rows, n = _compared([(a, q) for a, q in zip(seq["cold_again"]["rows"], cold)])
    d = judge_real(n["real"], n["compared"])
    c.values["cold_again"] = {**n, "decision": d, "hits_tokens": seq["cold_again"]["hits_tokens"]}
    real = [r for r in rows if r["outcome"] == "real"]
    c.require(not d["fails"], f"two cold runs of the same prompts (the second under a fresh cache_salt) diverge: "
                              f"{n['real']}/{n['compared']} past the tie rule; the engine is not deterministic alone, so "
                              f"a warm difference is not the cache's alone; e.g. {first_difference(real[0], 'cold', 'cold again') if real else ''}",
              "accuracy-regression")


def unproven_hits(cold_hits: list[float], warm_hits: list[float]) -> str | None:
    """Why the hit counts prove no cache, or None: a hit is a repeat served from what its first send
    left, so each repeat must count more hit tokens than its first send; a count as high on the first
    send (an engine or a server claiming hits on every request) proves nothing."""
    flat = [(c, w) for c, w in zip(cold_hits, warm_hits) if not w > c]
    if flat:
        return f"the repeats' hit tokens {list(warm_hits)} are not above their first sends' {list(cold_hits)}"
    return None


def hit_vs_miss(cold: dict, warm: dict) -> dict:
    """The hit's greedy output against the miss's, tie-aware (:func:`compare_tie_aware`; the hit
    is the "output", the miss the "reference")."""
    return compare_tie_aware(*({"id": r["phase"], "text": r["output_text"], "token_ids": r["output_token_ids"],
                                "logprobs": r.get("output_logprobs")} for r in (warm, cold)))


def _tie_words(cmp: dict) -> str:
    """Both tokens at the divergence and each side's logprob gap, for the summary."""
    d = cmp.get("at_divergence") or {}
    gaps = [d.get("output_gap_nats"), d.get("reference_gap_nats")]
    return (f"hit token {d.get('output_token')} vs miss token {d.get('reference_token')}, "
            f"gaps {', '.join('–' if g is None else f'{g:.3f}' for g in gaps)} nats, top-{TIE_TOP_K}")
