"""Is the output text or garbage? (docs/design.md "Sanity"): known answers, reference agreement,
model-free degeneration detectors.
"""

from __future__ import annotations

import re
import unicodedata
from collections import Counter
from typing import Any

# Thresholds of the degeneration detectors. A repeated run of one token over 60% of a
# 32+-token output, or distinct-2 below 0.2, is the usual signature of a broken decode
# (see HELM / "neural text degeneration", Holtzman et al. 2020, on repetition).
MAX_REPEAT_FRACTION = 0.6
MIN_DISTINCT2 = 0.2
MIN_TOKENS_FOR_REPEAT = 32


def probe_correct(output: str, expected: str, match: str = "prefix") -> bool:
    """Whether an output gives a probe's known answer.

    ``prefix``: the output starts with the expected continuation, and the answer ends at a
    boundary (end of output, or a character that is not a letter or digit), so " 1" does not
    pass for an expected " 12" nor " 12" for " 1". ``contains``: the answer appears as a whole
    word anywhere (chat replies wrap answers in prose). Whitespace at the ends is normalised
    (engines differ in a leading space after detokenization); inner text must match exactly.
    """
    out, exp = output.strip(), expected.strip()
    if not exp:
        return not out
    if match == "contains":
        return re.search(r"(?<![0-9A-Za-z])" + re.escape(exp) + r"(?![0-9A-Za-z])", out) is not None
    return out.startswith(exp) and (len(out) == len(exp) or not out[len(exp)].isalnum())


def longest_run(tokens: list[Any]) -> int:
    best = cur = 0
    prev = object()
    for t in tokens:
        cur = cur + 1 if t == prev else 1
        best = max(best, cur)
        prev = t
    return best


def distinct_n(tokens: list[Any], n: int = 2) -> float:
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 1.0


def scripts(text: str) -> Counter:
    """Count letters by Unicode script (the first word of the character name: LATIN, CJK...)."""
    c: Counter = Counter()
    for ch in text:
        if ch.isalpha():
            name = unicodedata.name(ch, "UNKNOWN")
            c[name.split()[0]] += 1
    return c


def detectors(text: str, token_ids: list[int] | None, max_tokens: int, finish_reason: str | None) -> dict[str, Any]:
    """Model-free degeneration scores of one output.

    Args:
        text: the output text.
        token_ids: output token ids when known (else whitespace tokens are used).
        max_tokens: the request's limit.
        finish_reason: ``stop`` / ``length`` / None.

    Returns:
        Scores plus ``flags``: the names of the detectors that fired.
    """
    toks = token_ids if token_ids else text.split()
    run = longest_run(toks)
    d2 = distinct_n(toks, 2)
    fffd = text.count("\ufffd")
    ctrl = sum(1 for ch in text if unicodedata.category(ch) == "Cc" and ch not in "\n\t\r")
    sc = scripts(text)
    major = sum(sc.values())
    mixing = 1 - (sc.most_common(1)[0][1] / major) if major else 0.0
    flags = []
    if len(toks) >= MIN_TOKENS_FOR_REPEAT and run / len(toks) > MAX_REPEAT_FRACTION:
        flags.append("repetition")
    if len(toks) >= MIN_TOKENS_FOR_REPEAT and d2 < MIN_DISTINCT2:
        flags.append("low-distinct-2")
    if fffd:
        flags.append("replacement-char")
    if ctrl:
        flags.append("control-char")
    if major >= 20 and mixing > 0.3:
        flags.append("script-mixing")
    return {"tokens": len(toks), "longest_repeat_run": run, "distinct_2": round(d2, 3), "u_fffd": fffd,
            "control_chars": ctrl, "script_mixing": round(mixing, 3),
            "eos_before_max": finish_reason == "stop" or (len(toks) < max_tokens and finish_reason != "length"),
            "flags": flags}


# vLLM's HF-vs-vLLM model tests compare greedy outputs with 5 top logprobs per token
# (tests/models/utils.py ``check_logprobs_close``; NUM_LOG_PROBS = 5 in the language-model tests).
TIE_TOP_K = 5
# Logprobs asked of every backend on the probes: the tie rule uses the top TIE_TOP_K, the KL
# estimate all of them (20 is vLLM's default --max-logprobs and OpenAI's top_logprobs cap).
PROBE_LOGPROBS = 20
# bakeoff's addition to that rule: at a tie each side's own token may lead the other's by at
# most this many nats in its own distribution (a near-tie). Membership alone would call a
# decoder that always takes the second-best token (-0.01 vs -5 nats) a string of ties.
TIE_MAX_GAP_NATS = 1.0


def top_map(entry) -> dict:
    """``{token: logprob}`` of one logprob entry, whose third item is a dict or, once stored as
    JSON (whose object keys are strings), a list of ``[token, logprob]`` pairs."""
    if entry is None or len(entry) < 3 or not entry[2]:
        return {}
    top = entry[2]
    return dict(top) if isinstance(top, dict) else {t: v for t, v in top}


def jsonable_logprobs(lps: list | None) -> list | None:
    """Logprob entries as JSON-safe lists: ``[token, logprob, [[token, logprob], ...]]``."""
    if not lps:
        return None
    return [None if e is None else [e[0], round(float(e[1]), 6), [[k, round(float(v), 6)] for k, v in top_map(e).items()]]
            for e in lps]


def top_tokens(entry, k: int) -> set | None:
    """The k most likely tokens of one logprob entry (None when it has none)."""
    top = top_map(entry)
    if not top:
        return None
    return {t for t, _ in sorted(top.items(), key=lambda kv: -kv[1])[:k]}


def compare_tie_aware(out: dict[str, Any], ref: dict[str, Any], top_k: int = TIE_TOP_K) -> dict[str, Any]:
    """Compare one greedy output with the reference's, token by token, with vLLM's tie rule.

    The rule of ``check_logprobs_close`` in vLLM's tests: at the first position where the two
    greedy sequences differ, if each side's token is among the other side's ``top_k`` logprobs,
    the two are numerically tied there (bf16 vs fp32, one CPU vs another) and the comparison
    stops: a **tie** divergence. bakeoff adds a bound: each side's own token leads the other's
    by at most ``TIE_MAX_GAP_NATS`` in its own distribution. Otherwise it is a **real**
    divergence. Without comparable logprobs on both sides (none, or ids on one side and token
    strings on the other) the divergence is **undetermined** (and counts as real in decisions).

    Args:
        out / ref: ``{"id", "text", "token_ids", "logprobs"}``; ``logprobs`` a list of
            ``(token, logprob, {token: logprob})``, one per token of ``token_ids``.
        top_k: how many of each side's top logprobs make a tie.

    Returns:
        ``{"id", "outcome": exact|tie|real|undetermined, "first_divergence", "unit",
        "output", "reference", "at_divergence"}``; ``at_divergence`` holds both tokens and each
        side's logprobs of both, as evidence; an undetermined row says why in
        ``undetermined_because``.
    """
    a, b, unit = _compared_sequences(out, ref)
    n = min(len(a), len(b))
    first = next((i for i in range(n) if a[i] != b[i]), None)
    row: dict[str, Any] = {"id": out.get("id"), "unit": unit, "output": out.get("text"), "reference": ref.get("text"),
                           "first_divergence": first, "at_divergence": None}
    if first is None:
        if _same_output(a, b, unit, out, ref):
            row["outcome"] = "exact"
            return row
        row["first_divergence"] = first = n  # one side stopped where the other went on
    row["outcome"] = "undetermined"
    if unit != "token":
        row["undetermined_because"] = "no token ids in the stream" if not out.get("token_ids") else \
            "no token ids in the reference's output"
        return row
    _judge_divergence(row, a, b, out.get("logprobs") or [], ref.get("logprobs") or [], first, top_k)
    return row


def _compared_sequences(out: dict[str, Any], ref: dict[str, Any]) -> tuple[Any, Any, str]:
    """``(output, reference, unit)``: both sides' token ids (``token``), else both texts (``char``)."""
    a, b = out.get("token_ids"), ref.get("token_ids")
    if not a or not b:
        return out.get("text", "") or "", ref.get("text", "") or "", "char"
    return a, b, "token"


def _same_output(a, b, unit: str, out: dict[str, Any], ref: dict[str, Any]) -> bool:
    """Sequences without a differing position that are the same output: the same length, or token ids
    one apart with identical text (engines differ in whether the final EOS id is streamed)."""
    return len(a) == len(b) or (unit == "token" and abs(len(a) - len(b)) == 1 and out.get("text") == ref.get("text"))


def _item(seq: list, i: int):
    """``seq[i]``, None past its end (a side that stopped)."""
    return seq[i] if i < len(seq) else None


def _shown_logprobs(entry, top_k: int) -> dict[str, float]:
    """The ``top_k`` most likely tokens of one logprob entry with their logprobs (4 places), as evidence."""
    return {str(t): round(v, 4) for t, v in sorted(top_map(entry).items(), key=lambda kv: -kv[1])[:top_k]}


def _judge_divergence(row: dict[str, Any], a: list, b: list, la: list, lb: list, first: int, top_k: int) -> None:
    """The tie rule at the first divergence of two token-id sequences: ``row``'s outcome (``tie``,
    ``real`` or left ``undetermined`` with why) and its ``at_divergence`` evidence."""
    ea, eb = _item(la, first), _item(lb, first)
    ta, tb = _item(a, first), _item(b, first)
    top_a, top_b = top_tokens(ea, top_k), top_tokens(eb, top_k)
    row["at_divergence"] = {"output_token": ta, "reference_token": tb, "output_logprobs": _shown_logprobs(ea, top_k),
                            "reference_logprobs": _shown_logprobs(eb, top_k)}
    if ta is None or tb is None or top_a is None or top_b is None:  # a side stopped, or gave no logprobs there
        row["undetermined_because"] = ("one side stopped where the other went on, without its stop token's logprobs"
                                       if ta is None or tb is None else "no logprobs at the divergence")
        return
    if not all(isinstance(t, type(ta)) for t in (tb, *top_a, *top_b)):
        row["undetermined_because"] = "logprobs keyed by token text on one side, by token id on the other"
        return
    row["outcome"] = _tie_or_real(row["at_divergence"], ta, tb, top_map(ea), top_map(eb), top_a, top_b)


def _tie_or_real(evidence: dict[str, Any], ta, tb, ma: dict, mb: dict, top_a: set, top_b: set) -> str:
    """``tie`` where each side's token is in the other's top k and leads it by at most
    :data:`TIE_MAX_GAP_NATS` in its own distribution (``ma``, ``mb``), else ``real``; the two
    gaps go into ``evidence``."""
    gap_a = ma[ta] - ma[tb] if ta in ma and tb in ma else None
    gap_b = mb[tb] - mb[ta] if ta in mb and tb in mb else None
    evidence.update({"output_gap_nats": gap_a, "reference_gap_nats": gap_b})
    near = gap_a is not None and gap_b is not None and gap_a <= TIE_MAX_GAP_NATS and gap_b <= TIE_MAX_GAP_NATS
    return "tie" if (tb in top_a and ta in top_b and near) else "real"


def agreement(outputs: list[dict[str, Any]], reference: list[dict[str, Any]], top_k: int = TIE_TOP_K) -> dict[str, Any]:
    """Greedy agreement with the reference on the same prompts (tie-aware, see
    :func:`compare_tie_aware`).

    Returns:
        ``prompts``, ``exact``, ``tie``, ``real``, ``undetermined`` counts, ``undetermined_because``
        (why the tie rule could not run, with counts: no token ids in the stream, no logprobs at
        the divergence, logprobs keyed by text on one side), ``exact_match_rate``,
        ``mean_first_divergence`` (over diverging outputs), ``logprobs`` (whether both sides
        gave them on every output), and the per-prompt ``rows``.
    """
    rows = [compare_tie_aware(o, r, top_k) for o, r in zip(outputs, reference)]
    counts = {k: sum(r["outcome"] == k for r in rows) for k in ("exact", "tie", "real", "undetermined")}
    why = Counter(r["undetermined_because"] for r in rows if r.get("undetermined_because"))
    divs = [r["first_divergence"] for r in rows if r["first_divergence"] is not None]
    both = all(o.get("logprobs") for o in outputs) and all(r.get("logprobs") for r in reference)
    return {"prompts": len(rows), **counts, "undetermined_because": dict(why.most_common()), "tie_top_k": top_k,
            "logprobs": both,
            "exact_match_rate": counts["exact"] / len(rows) if rows else None,
            "mean_first_divergence": sum(divs) / len(divs) if divs else None, "rows": rows}


def agreement_unjudgeable(agr: dict[str, Any], reference_accuracy: float, min_accuracy: float) -> str | None:
    """Why greedy agreement cannot be judged on this model, or None when it can.

    The decision of ``sanity.reference_agreement`` is the paired McNemar test on known answers
    (:mod:`bakeoff.analysis.paired`): it says nothing when the reference itself answers fewer than
    ``min_accuracy`` of the probes (a random-weight model answers none, so both sides score 0%).
    Then only the token-level comparison can verify agreement: every output exact or a tie
    (vLLM's ``check_logprobs_close`` rule) verifies it; any real or undetermined divergence, a
    blank text matched as text without token ids, or no probe at all leaves it unverified, and
    the check must skip rather than pass on two zeros.

    Args:
        agr: :func:`agreement`'s result.
        reference_accuracy: the reference's known-answer accuracy on the same probes (0-1).
        min_accuracy: the accuracy below which known answers cannot judge (the known-answers rule's).
    """
    if reference_accuracy >= min_accuracy:
        return None
    # blank texts compared as text (ids missing on a side) prove nothing: special tokens decode to ''
    blank = sum(r["outcome"] == "exact" and r["unit"] == "char" and not (r["output"] or "").strip() for r in agr["rows"])
    unverified = agr["real"] + agr["undetermined"] + blank
    if agr["prompts"] and not unverified:
        return None
    return (f"the reference answers only {reference_accuracy:.0%} of the {agr['prompts']} probes "
            f"(< {min_accuracy:.0%}): the paired accuracy test cannot judge agreement, and {unverified} outputs "
            f"are not proven equal or tied ({agr['real']} real, {agr['undetermined']} undetermined divergences: a tie "
            f"needs both sides' logprobs; {blank} blank texts compared without token ids)")


# Greedy decoding, verified from the engine's own logprobs (sanity.greedy). At temperature 0 a greedy
# engine emits the most likely token of the very distribution it reports: its chosen token's logprob
# is the top of its own top-k at every step, on every host (exact ties included: both are the top).
# A server that applies its own sampler defaults (a repeat penalty, issue 37: llama-cpp-python's 1.1
# chose 153 of 220 divergent tokens that were not its own top logprob) does not.
GREEDY_TOLERANCE_NATS = 0.01  # rounding of reported logprobs (6 decimals) and fp32 log-softmax noise
MAX_NON_GREEDY_FRACTION = 0.01  # of the verified steps; and at least MIN_NON_GREEDY_STEPS of them
MIN_NON_GREEDY_STEPS = 3


def non_greedy_steps(outputs: list[dict]) -> dict[str, Any]:
    """Steps whose chosen token is not the top of the engine's own top-k logprobs.

    Args:
        outputs: greedy probe outputs (``run_probes`` rows, ``logprobs`` in the JSON-safe form).

    Returns:
        ``{"verified": steps with at least two alternatives, "non_greedy": count, "examples":
        [...]}``; a step without alternatives (an engine that reports the chosen token only)
        verifies nothing.
    """
    verified, bad = 0, []
    for o in outputs:
        if o.get("status") != "ok":
            continue
        for i, e in enumerate(o.get("logprobs") or []):
            top = top_map(e)
            if len(top) < 2 or e[1] is None:
                continue
            verified += 1
            best_tok, best_lp = max(top.items(), key=lambda kv: kv[1])
            if float(e[1]) < float(best_lp) - GREEDY_TOLERANCE_NATS:
                bad.append({"id": o.get("id"), "step": i, "chosen": e[0], "chosen_logprob": e[1],
                            "top": best_tok, "top_logprob": best_lp})
    return {"verified": verified, "non_greedy": len(bad), "examples": bad[:20]}


def greedy_violated(counts: dict[str, Any]) -> bool:
    """More non-greedy steps than noise allows: more than :data:`MAX_NON_GREEDY_FRACTION` of the
    verified steps and at least :data:`MIN_NON_GREEDY_STEPS`."""
    n = counts["non_greedy"]
    return n >= MIN_NON_GREEDY_STEPS and n > MAX_NON_GREEDY_FRACTION * counts["verified"]
