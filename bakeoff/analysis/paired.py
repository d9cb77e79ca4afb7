"""Paired decisions on per-probe correctness: McNemar's exact test with a tolerance.

Two systems (a backend and the reference, or a backend and the fixture builder's record)
answer the same probes. Only the discordant probes carry information about a difference:
``b`` = the baseline right and the candidate wrong, ``c`` = the reverse. Under "no
difference" each discordant probe is a fair coin, so ``b ~ Binomial(b + c, 1/2)``; the
one-sided exact p-value of a drop is ``P(X >= b)`` (McNemar 1947, exact conditional form;
the test used for paired classifier comparisons, Dietterich 1998, and by lm-eval-harness
style paired comparisons).

Decision rule (bakeoff's, documented in docs/concepts/verdicts.md): a candidate **regresses** only when
the drop is significant (one-sided ``p < ALPHA``) *and* larger than ``TOLERANCE`` (absolute,
on the probe accuracy). Anything else is "within noise": one probe never decides a verdict,
and a significant but tiny drop on thousands of probes does not disqualify either.

The 95% interval of the accuracy difference is the Agresti-Min adjusted Wald interval for
paired proportions (Agresti & Min 2005, "Simple improved confidence intervals for comparing
matched proportions", Stat. Med. 24: add 1/2 to each cell of the 2x2 table).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Sequence

ALPHA = 0.01
TOLERANCE = 0.02  # absolute accuracy drop tolerated (2 percentage points)
Z95 = 1.959963984540054


def mcnemar_exact_p(b: int, c: int) -> float:
    """One-sided exact McNemar p-value that the candidate is worse.

    Args:
        b: probes the baseline got right and the candidate wrong.
        c: probes the candidate got right and the baseline wrong.

    Returns:
        ``P(X >= b)`` for ``X ~ Binomial(b + c, 1/2)``; 1.0 when there is no discordant probe.
    """
    if b < 0 or c < 0:
        raise ValueError("counts must be non-negative")
    n = b + c
    if n == 0:
        return 1.0
    return min(1.0, sum(math.comb(n, i) for i in range(b, n + 1)) / 2 ** n)


def paired_interval(b: int, c: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Agresti-Min interval of ``acc(candidate) - acc(baseline) = (c - b) / n``.

    Args:
        b, c: discordant counts (see :func:`mcnemar_exact_p`).
        n: all paired probes.
        z: normal quantile (1.96 for 95%).

    Returns:
        ``(low, high)``, clipped to [-1, 1].
    """
    if n <= 0:
        return (-1.0, 1.0)
    bs, cs, ns = b + 0.5, c + 0.5, n + 2.0
    d = (cs - bs) / ns
    var = ((bs + cs) - (cs - bs) ** 2 / ns) / ns ** 2
    half = z * math.sqrt(max(var, 0.0))
    return (max(-1.0, d - half), min(1.0, d + half))


def min_detectable_drop(n: int, alpha: float = ALPHA, tolerance: float = TOLERANCE) -> float | None:
    """The smallest accuracy drop ``n`` paired probes can call a regression (best case: no
    probe goes the other way), or None when no drop can be (too few probes)."""
    for k in range(1, n + 1):
        if k / n > tolerance and mcnemar_exact_p(k, 0) < alpha:
            return k / n
    return None


@dataclass
class PairedDecision:
    """The outcome of :func:`decide`.

    Attributes:
        n: paired probes.
        baseline_accuracy / candidate_accuracy: fractions right.
        b: baseline right, candidate wrong (counted discordances).
        c: candidate right, baseline wrong.
        ties_excluded: discordant probes whose outputs first diverged on a numerical tie
            (vLLM's tie rule): counted as agreeing, not as b or c.
        difference: ``candidate - baseline`` accuracy, counting ties as agreement.
        ci95: Agresti-Min 95% interval of the difference.
        p_value: one-sided exact McNemar p-value of a drop.
        min_detectable_drop: smallest drop these probes could call a regression (None: none).
        regression: significant (p < alpha) and larger than the tolerance.
        alpha / tolerance: the rule's parameters.
    """

    n: int
    baseline_accuracy: float
    candidate_accuracy: float
    b: int
    c: int
    ties_excluded: int
    difference: float
    ci95: tuple[float, float]
    p_value: float
    min_detectable_drop: float | None
    regression: bool
    alpha: float = ALPHA
    tolerance: float = TOLERANCE

    def sentence(self, baseline: str, candidate: str = "backend") -> str:
        """One line a verdict can show: the difference, its interval, p, and the power."""
        lo, hi = self.ci95
        mdd = f"{self.min_detectable_drop:.1%}" if self.min_detectable_drop is not None else "none (too few probes)"
        tie = f", {self.ties_excluded} tie divergence(s) counted as agreement" if self.ties_excluded else ""
        return (f"{candidate} {self.candidate_accuracy:.1%} vs {baseline} {self.baseline_accuracy:.1%} on {self.n} probes: "
                f"difference {self.difference:+.1%} (95% CI {lo:+.1%} to {hi:+.1%}), {self.b} lost / {self.c} gained{tie}, "
                f"McNemar exact one-sided p={self.p_value:.3g}; smallest detectable drop {mdd}")

    def as_values(self) -> dict:
        d = asdict(self)
        d["ci95"] = [round(x, 4) for x in self.ci95]
        for k in ("baseline_accuracy", "candidate_accuracy", "difference"):
            d[k] = round(d[k], 4)
        d["p_value"] = float(f"{self.p_value:.4g}")
        if d["min_detectable_drop"] is not None:
            d["min_detectable_drop"] = round(d["min_detectable_drop"], 4)
        return d


def decide(baseline: Sequence[bool], candidate: Sequence[bool], ties: Sequence[bool] | None = None,
           alpha: float = ALPHA, tolerance: float = TOLERANCE) -> PairedDecision:
    """Judge the candidate's per-probe correctness against the baseline's (same probes, same order).

    Args:
        baseline: correctness of the baseline on each probe.
        candidate: correctness of the candidate on each probe.
        ties: per probe, True when the two outputs first diverged on a numerical tie (each
            side's token in the other's top-k logprobs); such a probe is counted as agreeing.
        alpha: significance level of the one-sided test.
        tolerance: absolute accuracy drop tolerated.

    Raises:
        ValueError: the sequences differ in length or are empty.
    """
    if len(baseline) != len(candidate) or (ties is not None and len(ties) != len(baseline)):
        raise ValueError("baseline, candidate and ties must pair up probe by probe")
    n = len(baseline)
    if n == 0:
        raise ValueError("no probes to compare")
    ties = ties or [False] * n
    b = c = excluded = 0
    for base, cand, tie in zip(baseline, candidate, ties):
        if base == cand:
            continue
        if tie:
            excluded += 1
        elif base:
            b += 1
        else:
            c += 1
    p = mcnemar_exact_p(b, c)
    diff = (c - b) / n
    return PairedDecision(
        n=n, baseline_accuracy=sum(map(bool, baseline)) / n, candidate_accuracy=sum(map(bool, candidate)) / n,
        b=b, c=c, ties_excluded=excluded, difference=diff, ci95=paired_interval(b, c, n), p_value=p,
        min_detectable_drop=min_detectable_drop(n, alpha, tolerance),
        regression=p < alpha and -diff > tolerance, alpha=alpha, tolerance=tolerance)


def binomial_below(successes: int, n: int, expected: float, alpha: float = ALPHA,
                   tolerance: float = TOLERANCE) -> tuple[bool, float]:
    """One-sample exact test that a rate is below ``expected - tolerance``.

    For checks with no paired record (needles against the rate the fixture's builder
    measured): ``P(X <= successes)`` for ``X ~ Binomial(n, expected - tolerance)``.

    Returns:
        ``(below, p_value)``; ``below`` when ``p < alpha``.
    """
    p0 = min(1.0, max(0.0, expected - tolerance))
    if n == 0:
        return False, 1.0
    p = sum(math.comb(n, i) * p0 ** i * (1 - p0) ** (n - i) for i in range(0, successes + 1))
    return p < alpha, min(1.0, p)


def fisher_greater(hits_a: int, n_a: int, hits_b: int, n_b: int) -> float:
    """One-sided Fisher exact test that group a's rate exceeds group b's: ``P(X >= hits_a)`` for
    ``X`` hypergeometric (``n_a`` drawn from ``n_a + n_b`` holding ``hits_a + hits_b`` hits).
    For two groups of different probes (not paired): a's probes rendered otherwise than b's."""
    total, hits = n_a + n_b, hits_a + hits_b
    if n_a == 0 or total == 0:
        return 1.0
    denom = math.comb(total, n_a)
    p = sum(math.comb(hits, k) * math.comb(total - hits, n_a - k) for k in range(hits_a, min(hits, n_a) + 1)) / denom
    return min(1.0, p)
