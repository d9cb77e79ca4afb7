"""The model-based garbage judge and the divergence figures of a backend against the reference.

Model-free detectors (:mod:`bakeoff.analysis.sanity`) miss fluent garbage: word salad of real
vocabulary tokens has no repeated run, a high distinct-2, one script. The reference model
does not: scored teacher-forced, it gives such text a mean negative log-likelihood per token
far above what it gives its own greedy outputs on the same prompts (the "judge by the model's
likelihood" idea of perplexity-based filtering; the reference plays the judge).

Rule: a backend's open-ended outputs are ``garbage-output`` when their pooled mean NLL per
token under the reference exceeds that of the reference's own greedy outputs on the same
prompts by more than ``NLL_GAP_NATS``. Pooled over every scored token of every output (one
odd output cannot decide), and only with at least ``MIN_SCORED_TOKENS`` scored tokens.

Where the backend returned top-k logprobs, the same scoring gives, at every generated
position (same context on both sides, teacher-forced on the backend's tokens):

- **top-1 agreement**: the reference's most likely token is the backend's greedy token;
- **mean KL divergence** ``KL(P_ref || P_backend)``, estimated on the union of the two top-k
  sets (each side's missing tokens set to its k-th logprob, an upper bound of their mass,
  then both renormalised on the union). With k = 20 this is close to the full-vocabulary KL
  when the top tokens hold most of the mass; the figures llama.cpp's
  ``perplexity --kl-divergence`` reports for a quantized model. Report only.

KL needs the top-k on both sides: a position where either side gave fewer than the ``top_k``
asked for (OpenVINO GenAI reports only the chosen token's logprob: a 1-entry map, whose floor
is that token's own logprob, made every other token as likely as the chosen one and printed
"mean KL 2.98695 nats" beside 240/240 exact matches) is not measurable: it counts in
``kl_short_positions``, never in the mean. With no measurable position the mean is None and
``kl_not_measurable`` says why. Top-1 agreement needs only the backend's chosen token.
"""

from __future__ import annotations

import math
from typing import Any, Iterable

from bakeoff.analysis.sanity import top_map

NLL_GAP_NATS = 2.0  # nats per token above the reference's own outputs
MIN_SCORED_TOKENS = 16


def pooled_nll(scored: Iterable[list[float]]) -> tuple[float | None, int]:
    """Mean NLL per token (nats) pooled over outputs, from per-token logprobs; (None, 0) when empty."""
    total, n = 0.0, 0
    for lps in scored:
        for lp in lps:
            if lp is None or lp != lp:  # NaN: the scorer's numbers are broken; say so, never pass
                return float("nan"), n + 1
            total += -max(lp, -100.0)  # a -inf logprob (token the model rules out) counts as 100 nats
            n += 1
    return (total / n if n else None), n


def kl_topk(ref_top: dict[Any, float], cand_top: dict[Any, float]) -> float | None:
    """``KL(P_ref || P_cand)`` in nats on the union of both top-k sets (see module docstring)."""
    if not ref_top or not cand_top:
        return None
    ref_top = {t: v for t, v in ref_top.items() if math.isfinite(v)}
    cand_top = {t: v for t, v in cand_top.items() if math.isfinite(v)}
    if not ref_top or not cand_top:
        return None
    floor_r, floor_c = min(ref_top.values()), min(cand_top.values())
    union = set(ref_top) | set(cand_top)
    pr = {t: math.exp(ref_top.get(t, floor_r)) for t in union}
    pc = {t: math.exp(cand_top.get(t, floor_c)) for t in union}
    zr, zc = sum(pr.values()), sum(pc.values())
    kl = 0.0
    for t in union:
        p, q = pr[t] / zr, pc[t] / zc
        if p > 0:
            kl += p * (math.log(p) - math.log(max(q, 1e-300)))
    return max(0.0, kl)


def divergence(ref_tops: list[list[tuple[int, float]]], cand_logprobs: list, top_k: int) -> dict[str, Any]:
    """Top-1 agreement and mean KL over positions where both sides have logprobs.

    Args:
        ref_tops: the reference's ``[(id, logprob), ...]`` per position (teacher-forced on the
            candidate's tokens).
        cand_logprobs: the candidate's ``(token, logprob, {token: logprob})`` per position.
        top_k: the top-k both sides were asked for; KL is measured only where each side gave
            at least that many (module docstring).

    Returns:
        ``positions`` and ``top1_agreement`` (positions with the reference's top and the
        candidate's chosen token), ``kl_positions`` and ``mean_kl_nats`` (positions with both
        top-k maps full), ``kl_short_positions`` (where a side gave fewer than ``top_k``) and
        ``kl_not_measurable`` (the reason, when no position was measurable); None where none counted.
    """
    agree = n = short = 0
    cand_sizes: list[int] = []
    kls: list[float] = []
    for rt, ce in zip(ref_tops, cand_logprobs):
        cand_top = top_map(ce)
        chosen = ce[0] if ce is not None and len(ce) >= 2 else None
        if not rt or not isinstance(chosen, int) or not all(isinstance(t, int) for t in cand_top):
            continue
        ref_top = {int(t): float(v) for t, v in rt}
        n += 1
        agree += max(ref_top, key=ref_top.get) == chosen
        if len(ref_top) < top_k or len(cand_top) < top_k:
            short += 1
            cand_sizes.append(len(cand_top))
            continue
        kl = kl_topk(ref_top, cand_top)
        if kl is not None:
            kls.append(kl)
    why = None
    if not kls:
        why = (f"no probe position had top-{top_k} logprobs on both sides (the backend gave at most "
               f"{max(cand_sizes)} per position)" if cand_sizes else "no probe position had logprobs on both sides")
    return {"positions": n, "top1_agreement": round(agree / n, 4) if n else None,
            "kl_positions": len(kls), "kl_short_positions": short,
            "mean_kl_nats": round(sum(kls) / len(kls), 5) if kls else None, "kl_not_measurable": why}


def nll_verdict(backend_nll: float | None, backend_tokens: int, reference_nll: float | None,
                reference_tokens: int) -> tuple[str, str]:
    """``(status, sentence)`` of the judge: ``fail`` when the backend's pooled NLL exceeds the
    reference's by more than ``NLL_GAP_NATS``; ``skip`` when too few tokens were scored."""
    if backend_nll is None or reference_nll is None or not (math.isfinite(backend_nll) and math.isfinite(reference_nll)):
        return "skip", f"the reference gave no finite score (backend {backend_nll}, reference {reference_nll})"
    if min(backend_tokens, reference_tokens) < MIN_SCORED_TOKENS:
        return "skip", (f"too few scored tokens to judge ({backend_tokens} backend, {reference_tokens} reference; "
                        f"at least {MIN_SCORED_TOKENS} each)")
    gap = backend_nll - reference_nll
    line = (f"reference NLL of the backend's outputs {backend_nll:.2f} nats/token vs {reference_nll:.2f} for its own "
            f"({gap:+.2f}; garbage above +{NLL_GAP_NATS:g}) over {backend_tokens} / {reference_tokens} tokens")
    return ("fail" if gap > NLL_GAP_NATS else "pass"), line
