"""Outputs judged where they were served: one engine's greedy output under a condition against its
own output of the same request in the quiet case.

A condition is what a serving engine does that a lone probe never meets: other streams in flight
(the sweep's load), another batch or order, a warm prefix cache after stop strings and cancelled
requests, speculation, a quantized KV cache over turns. A correct engine's greedy output does not
depend on any of them beyond numerical ties (bf16 rounding differs with the batch shape), so the
rule is the reference agreement's, applied to the engine against itself:

- **Comparison** (:func:`compare_served`): token by token; at the first difference the tie rule of
  vLLM's ``check_logprobs_close`` (:func:`bakeoff.analysis.sanity.compare_tie_aware`: each side's
  token in the other's top-k and within ``TIE_MAX_GAP_NATS`` of it) where both sides carry
  logprobs. Where only the quiet side does (the sweep asks for none: logprobs would change what is
  measured), the rule is one-sided: a **tie** when the condition's token is among the quiet side's
  top-k and the quiet side's own token leads it by at most ``TIE_MAX_GAP_NATS``; otherwise **real**.
  Without logprobs at the difference it is **undetermined** (counted apart, never as agreement).
- **Decision** (:func:`judge_real`): real divergences are counted over the comparable outputs
  (exact + tie + real). A correct engine has none, but one probe never decides a verdict: the
  condition fails only when there are at least ``MIN_REAL_DIVERGENCES`` and more than the
  ``NULL_REAL_RATE`` (1%) a tie-rule miss allows, by an exact one-sided binomial test at
  ``ALPHA`` (0.01). With ``exact=True`` (an engine's determinism switch is on, vLLM's
  ``VLLM_BATCH_INVARIANT=1``) any difference at all fails.
- **The response contract** (MLPerf's compliance TEST06 and TEST09, :func:`response_contract`,
  :func:`length_ratio`): every response ends with a finish reason, holds at most one
  end-of-sequence token and only as its last (where the request did not ask ``ignore_eos``), and
  the mean output length under the condition is within ``LENGTH_TOLERANCE`` (10%) of the quiet
  run's on the same prompts.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Iterable

from bakeoff.analysis.paired import ALPHA
from bakeoff.analysis.sanity import TIE_MAX_GAP_NATS, TIE_TOP_K, compare_tie_aware, top_map, top_tokens

NULL_REAL_RATE = 0.01  # real divergences per comparable output a tie-rule miss can explain
MIN_REAL_DIVERGENCES = 2  # one output never decides
LENGTH_TOLERANCE = 0.10  # MLPerf TEST09: mean output length within 10% of the accuracy run's
# Outputs flagged by the model-free degeneration detectors under a condition may exceed the share
# flagged alone by at most this much (sanity.degeneration's own 25% bar, held against the quiet run).
MAX_FLAGGED_GAP = 0.25


def compare_served(out: dict[str, Any], quiet: dict[str, Any], top_k: int = TIE_TOP_K) -> dict[str, Any]:
    """One output under a condition against the same request's quiet output (module docstring).

    Args:
        out / quiet: ``{"id", "text", "token_ids", "logprobs"}`` (logprobs as
            :func:`bakeoff.analysis.sanity.jsonable_logprobs` keeps them, or tuples).
        top_k: the tie rule's k.

    Returns:
        :func:`compare_tie_aware`'s row; ``rule`` says ``both sides`` or ``one-sided`` where the tie rule ran.
    """
    row = compare_tie_aware(out, quiet, top_k)
    if row["outcome"] != "undetermined" or row["unit"] != "token" or out.get("logprobs"):
        if row["outcome"] in ("tie", "real"):
            row["rule"] = "both sides"
        return _too_few_alternatives(row)
    return _one_sided(row, out, quiet, top_k)


def _too_few_alternatives(row: dict[str, Any]) -> dict[str, Any]:
    """A real divergence where a side's logprobs name no alternative to its chosen token (OpenVINO GenAI
    reports the chosen token's only) proves nothing: undetermined, saying so."""
    d = row.get("at_divergence") or {}
    if row["outcome"] == "real" and min(len(d.get("output_logprobs") or {}), len(d.get("reference_logprobs") or {})) < 2:
        row["outcome"] = "undetermined"
        row["undetermined_because"] = "a side's logprobs name no alternative to its chosen token"
    return row


def _one_sided(row: dict[str, Any], out: dict[str, Any], quiet: dict[str, Any], top_k: int) -> dict[str, Any]:
    """The one-sided tie rule at ``row``'s first divergence (module docstring); ``row`` as it was where
    a side stopped there, the quiet side has no logprobs there, or they are keyed otherwise."""
    first = row["first_divergence"]
    a, b = out.get("token_ids") or [], quiet.get("token_ids") or []
    lps = quiet.get("logprobs") or []
    ta = a[first] if first < len(a) else None
    tb = b[first] if first < len(b) else None
    entry = lps[first] if first < len(lps) else None
    top, m = top_tokens(entry, top_k), top_map(entry)
    if ta is None or tb is None or not top or len(m) < 2 or not all(isinstance(t, type(ta)) for t in (tb, *top)):
        return row  # a side stopped, no logprobs (or no alternative) there, or keyed otherwise: undetermined
    gap = m[tb] - m[ta] if ta in m and tb in m else None
    row["at_divergence"] = {**(row.get("at_divergence") or {}), "output_token": ta, "reference_token": tb,
                            "reference_gap_nats": gap}
    row["outcome"] = "tie" if ta in top and gap is not None and gap <= TIE_MAX_GAP_NATS else "real"
    row["rule"] = "one-sided"
    row.pop("undetermined_because", None)
    return row


def counts(rows: Iterable[dict[str, Any]]) -> dict[str, int]:
    """``exact``, ``tie``, ``real``, ``undetermined`` and ``compared`` (the first three) of comparison rows."""
    c = {k: 0 for k in ("exact", "tie", "real", "undetermined")}
    for r in rows:
        c[r["outcome"]] += 1
    c["compared"] = c["exact"] + c["tie"] + c["real"]
    return c


def binomial_tail(k: int, n: int, p: float) -> float:
    """``P(X >= k)`` for ``X ~ Binomial(n, p)``."""
    if k <= 0:
        return 1.0
    if k > n:
        return 0.0
    return min(1.0, sum(math.comb(n, i) * p ** i * (1 - p) ** (n - i) for i in range(k, n + 1)))


def smallest_failing(n: int, alpha: float = ALPHA, null: float = NULL_REAL_RATE) -> int | None:
    """The fewest real divergences among ``n`` comparable outputs that fail (None: none can)."""
    for k in range(MIN_REAL_DIVERGENCES, n + 1):
        if binomial_tail(k, n, null) < alpha:
            return k
    return None


def judge_real(real: int, compared: int, exact: bool = False, differing: int | None = None) -> dict[str, Any]:
    """Whether ``real`` divergences among ``compared`` outputs fail the condition (module docstring).

    Args:
        real: real divergences.
        compared: comparable outputs (exact + tie + real).
        exact: the engine's determinism switch is on: any differing output fails.
        differing: outputs that differ at all (ties included), for ``exact``.

    Returns:
        ``{"rule", "real", "compared", "p_value", "smallest_failing", "fails"}``.
    """
    if exact:
        d = real if differing is None else differing
        return {"rule": "identical outputs (the engine's determinism switch is on)", "real": real,
                "differing": d, "compared": compared, "p_value": None, "smallest_failing": 1, "fails": d > 0}
    p = binomial_tail(real, compared, NULL_REAL_RATE)
    return {"rule": f"exact binomial test: real divergences above {NULL_REAL_RATE:.0%} of comparable outputs "
                    f"(one-sided, alpha {ALPHA}; at least {MIN_REAL_DIVERGENCES})",
            "real": real, "compared": compared, "p_value": float(f"{p:.4g}"),
            "smallest_failing": smallest_failing(compared), "fails": real >= MIN_REAL_DIVERGENCES and p < ALPHA}


def eos_ids(model_path: str | None) -> set[int]:
    """The model's end-of-sequence token ids (``generation_config.json``, then ``config.json``); empty
    when neither names one or the model is not a local folder."""
    out: set[int] = set()
    if not model_path:
        return out
    for name in ("generation_config.json", "config.json"):
        try:
            cfg = json.loads((Path(model_path) / name).read_text())
        except (OSError, ValueError):
            continue
        for holder in (cfg, cfg.get("text_config") or {}) if isinstance(cfg, dict) else ():
            v = holder.get("eos_token_id") if isinstance(holder, dict) else None
            out.update(i for i in (v if isinstance(v, list) else [v]) if isinstance(i, int) and not isinstance(i, bool))
    return out


def response_contract(row: dict[str, Any], eos: set[int]) -> list[str]:
    """What one response breaks of MLPerf TEST06's contract (empty when nothing): a finish reason, and,
    where the request stopped at EOS (no ``ignore_eos``), at most one end-of-sequence token, only last."""
    bad = []
    if row.get("status") == "ok" and not row.get("finish_reason"):
        bad.append("no finish reason")
    ids = row.get("token_ids") or []
    if eos and ids and not row.get("ignore_eos"):
        at = [i for i, t in enumerate(ids) if t in eos]
        if len(at) > 1:
            bad.append(f"{len(at)} end-of-sequence tokens")
        elif at and at[0] != len(ids) - 1:
            bad.append(f"tokens after the end-of-sequence token (at {at[0]} of {len(ids)})")
    return bad


def output_length(row: dict[str, Any]) -> int:
    """Output tokens of a row: its token ids, else its text's characters (a proxy both sides share)."""
    ids = row.get("token_ids")
    return len(ids) if ids else len(row.get("text") or "")


def length_ratio(loaded: list[dict[str, Any]], quiet: list[dict[str, Any]]) -> dict[str, Any]:
    """MLPerf TEST09: the mean output length under the condition over the quiet run's, same prompts.

    Returns:
        ``{"mean_tokens", "quiet_mean_tokens", "ratio", "tolerance", "within"}`` (``within`` True with no output).
    """
    a = [output_length(r) for r in loaded]
    b = [output_length(r) for r in quiet]
    ma, mb = (sum(a) / len(a) if a else 0.0), (sum(b) / len(b) if b else 0.0)
    ratio = ma / mb if mb else (1.0 if not ma else None)
    return {"mean_tokens": round(ma, 2), "quiet_mean_tokens": round(mb, 2),
            "ratio": None if ratio is None else round(ratio, 4), "tolerance": LENGTH_TOLERANCE,
            "within": ratio is not None and abs(ratio - 1) <= LENGTH_TOLERANCE}


def first_difference(row: dict[str, Any], base: str = "quiet", served: str = "served") -> str:
    """One line on where an output left its baseline (``base``: the quiet run, a miss, the twin, the
    reference): the position, both tokens, the baseline's gap, both texts' starts."""
    d = row.get("at_divergence") or {}
    gap = d.get("reference_gap_nats")
    return (f"{row.get('id')}: first difference at {row.get('unit', 'token')} {row.get('first_divergence')}, "
            f"{base} {d.get('reference_token')!r} vs {served} {d.get('output_token')!r}"
            + (f" ({base} leads it by {gap:.3f} nats)" if isinstance(gap, (int, float)) else "")
            + f"; {base} {str(row.get('reference') or '')[:40]!r} vs {served} {str(row.get('output') or '')[:40]!r}")


def cut_at_eos(ids: list[int] | None, eos: set[int]) -> list[int] | None:
    """Token ids up to and including the first end-of-sequence token (what the model said before it
    stopped; a request with ``ignore_eos`` goes on past it)."""
    if not ids or not eos:
        return ids
    for i, t in enumerate(ids):
        if t in eos:
            return ids[:i + 1]
    return ids


def answer_span(ids: list[int] | None, reference_ids: list[int] | None, eos: set[int]) -> tuple[list[int], list[int]]:
    """The part of an output that answers its prompt, beside the reference's answer: the reference's greedy
    output (asked without ``ignore_eos``) up to its end-of-sequence token, not included, and the output cut
    at its own first one and to that length. A request with ``ignore_eos`` goes on past where the model
    would stop (one engine masks EOS there, another emits it and continues): what follows is no answer to
    judge on either side. Without a reference answer (None), the output cut at its first end-of-sequence
    token; an empty one (EOS at once) leaves nothing of the output to judge."""
    ref = list(reference_ids or [])
    stop = next((i for i, t in enumerate(ref) if t in eos), None)
    ref = ref[:stop] if stop is not None else ref
    out = list(cut_at_eos(ids, eos) or [])
    return (out if reference_ids is None else out[:len(ref)]), ref
