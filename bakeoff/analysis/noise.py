"""Repeats and noise: bootstrap confidence intervals (numpy, seeded) and "real or within noise".

A measured figure (aggregate tok/s at 8 sessions, TTFT p50) varies from repeat to repeat.
With ``--repeats R`` each sweep point is measured R times; the spread of those R values is
the noise. A difference between two configs is called real only when the bootstrap
confidence interval of the difference of their means excludes zero (percentile bootstrap,
Efron & Tibshirani 1993, ch. 13; 95% by default, 2,000 resamples, seed 0), otherwise it is
"within noise". With fewer than 2 values on either side the noise is unknown and no call
is made.
"""

from __future__ import annotations

import math

from typing import Literal

import numpy as np

from bakeoff.api.specs import Spec

CONFIDENCE = 0.95
RESAMPLES = 2000
SEED = 0

Call = Literal["real", "within noise", "unknown"]


class Interval(Spec):
    """A bootstrap interval of a mean.

    Attributes:
        mean: the sample mean.
        low / high: interval bounds (equal to the mean with one value).
        n: number of values.
    """

    mean: float
    low: float
    high: float
    n: int


class Difference(Spec):
    """``b - a`` with its bootstrap interval, absolute and in % of ``a``'s mean.

    Attributes:
        delta: mean(b) - mean(a).
        delta_pct: delta / mean(a) * 100 (None when mean(a) is 0).
        low / high: the interval of delta.
        call: ``real`` when the interval excludes 0, ``within noise`` when it holds 0,
            ``unknown`` with fewer than 2 values on a side.
    """

    delta: float
    delta_pct: float | None
    low: float | None = None
    high: float | None = None
    call: Call


def _finite(v) -> float | None:
    """``v`` as a finite float, or None (None, NaN, infinities, non-numbers, ints past any float)."""
    try:
        x = float(v)
    except (TypeError, ValueError, OverflowError):
        return None
    return x if math.isfinite(x) else None


def _clean(values) -> np.ndarray:
    """The finite numbers of ``values`` (a damaged run's 10**4000 or text is left out, not raised)."""
    return np.asarray([x for x in map(_finite, values) if x is not None], dtype=np.float64)


def bootstrap_mean(values, confidence: float = CONFIDENCE, resamples: int = RESAMPLES, seed: int = SEED) -> Interval | None:
    """Percentile-bootstrap interval of the mean of ``values`` (None values dropped).

    Returns:
        The interval, or None when there is no value.
    """
    x = _clean(values)
    if x.size == 0:
        return None
    if x.size == 1:
        return Interval(mean=float(x[0]), low=float(x[0]), high=float(x[0]), n=1)
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, x.size, size=(resamples, x.size))].mean(axis=1)
    alpha = (1 - confidence) / 2
    lo, hi = np.quantile(means, [alpha, 1 - alpha])
    return Interval(mean=float(x.mean()), low=float(lo), high=float(hi), n=int(x.size))


def compare(a, b, confidence: float = CONFIDENCE, resamples: int = RESAMPLES, seed: int = SEED) -> Difference | None:
    """Difference of means ``b - a`` with a bootstrap interval (both sides resampled apart).

    Args:
        a: values of the baseline (e.g. aggregate tok/s of each repeat).
        b: values of the other config.

    Returns:
        The difference and its call, or None when a side has no value.
    """
    xa, xb = _clean(a), _clean(b)
    if xa.size == 0 or xb.size == 0:
        return None
    delta = float(xb.mean() - xa.mean())
    pct = delta / float(xa.mean()) * 100 if xa.mean() != 0 else None
    if xa.size < 2 or xb.size < 2:
        return Difference(delta=delta, delta_pct=pct, call="unknown")
    rng = np.random.default_rng(seed)
    ma = xa[rng.integers(0, xa.size, size=(resamples, xa.size))].mean(axis=1)
    mb = xb[rng.integers(0, xb.size, size=(resamples, xb.size))].mean(axis=1)
    alpha = (1 - confidence) / 2
    lo, hi = np.quantile(mb - ma, [alpha, 1 - alpha])
    call: Call = "real" if (lo > 0 or hi < 0) else "within noise"
    return Difference(delta=delta, delta_pct=pct, low=float(lo), high=float(hi), call=call)


# Student's t, two-sided 95% (the 0.975 quantile) by degrees of freedom; past 30, the normal's.
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
        11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093,
        20: 2.086, 21: 2.080, 22: 2.074, 23: 2.069, 24: 2.064, 25: 2.060, 26: 2.056, 27: 2.052, 28: 2.048,
        29: 2.045, 30: 2.042}


def ratio_interval(ratios) -> Interval | None:
    """95% interval of a ratio from paired measurements: Student's t on the log ratios, back-
    transformed (the mean is the geometric mean). Few pairs (3 to 10) are what a benchmark has,
    where a percentile bootstrap is too narrow; the t interval is exact for log-normal noise.

    Returns:
        The interval (``mean`` the geometric mean); None with fewer than 2 finite positive ratios.
    """
    x = np.log([r for r in _clean(ratios) if r > 0])
    if x.size < 2:
        return None
    t = T975.get(int(x.size) - 1, 1.96)
    half = t * float(x.std(ddof=1)) / math.sqrt(x.size)
    m = float(x.mean())
    return Interval(mean=math.exp(m), low=math.exp(m - half), high=math.exp(m + half), n=int(x.size))
