"""Long-context prompts sized from the engine's measured prefill rate and a time budget.

The prefix-cache, needles and agents checks sized their prompts from the engine's context alone
(fractions of ``max_model_len``). On a slow engine that is minutes per request: SmolLM2-135M on a
2-core CPU prefills about 116 tokens/s (51 s for a 5,924-token prompt), and nine needles of up to
90% of its 8,192-token context took longer than the progress timeout. Each check now states its
prompts as weights times one scale (needles: fraction x context; prefix cache: its long prompt,
sent ``2 x reps + 2`` times; agents: turn number x tokens per turn, per agent), and the scale is
the largest that fits all of:

- the context (the lengths as before);
- each prompt's prefill within ``Budget.request_s`` seconds (``--prefill-budget``);
- the check's prompts' prefill together within ``Budget.check_s`` seconds (``--check-prefill-budget``),
  counting every prompt in full (no prefix-cache hit assumed, no left padding counted);

at the prefill time :func:`evaluations.measuring.calibrate` measured on two prompts about 1:2 long
(:meth:`~evaluations.measuring.Calibration.prefill_s`: ``a n + b n^2`` through both, so that longer
prompts are estimated slower, as attention makes them; the budget is an estimate, not a bound). Where the rate could not be measured the context decides, as before.
The fixtures are tiny and fast: on them the budgets never cut (thousands of tokens per second
against a 2,048-token context), so their lengths, and the needle record they are judged
against, stay as they were. Each check records which lengths it used and why (:meth:`Scale.values`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from evaluations.measuring import Calibration


@dataclass(frozen=True)
class Budget:
    """Seconds of prefill a long-context check may spend (``evaluations/inputs.py DEFAULTS``).

    Attributes:
        request_s: each prompt's estimated prefill at most (``prefill_budget_s``).
        check_s: the check's prompts' estimated prefill together at most (``check_prefill_budget_s``).
    """

    request_s: float
    check_s: float

    @classmethod
    def of(cls, settings) -> "Budget":
        return cls(settings.prefill_budget_s, settings.check_prefill_budget_s)


@dataclass(frozen=True)
class Scale:
    """The scale a check's prompt lengths are weights of, and why it is what it is."""

    tokens: int
    context_tokens: int
    capped: bool
    why: str
    calibration: Calibration
    budget: Budget

    def values(self) -> dict[str, Any]:
        """For the check's values: the lengths' scale, the context's, the rate, the budgets, why."""
        return {"scale_tokens": self.tokens, "context_tokens": self.context_tokens, "capped_by_budget": self.capped,
                **self.calibration.values(), "request_prefill_budget_s": self.budget.request_s,
                "check_prefill_budget_s": self.budget.check_s, "sizing": self.why}


def fit(context_tokens: int, weights: list[float], cal: Calibration, budget: Budget, what: str = "context") -> Scale:
    """The largest scale up to ``context_tokens`` whose prompts (``weight x scale`` tokens each)
    fit ``budget`` at the measured prefill rate.

    Args:
        context_tokens: the scale the context alone gives (the lengths before budgets).
        weights: each prompt's length as a multiple of the scale.
        cal: the engine's calibration (its ``prefill_tokens_per_s``).
        budget: the seconds allowed.
        what: what the scale is, for the reason (``max_model_len``, ``tokens per turn``).

    Returns:
        The :class:`Scale`, ``why`` e.g. ``capped at 3,636 tokens (max_model_len 8,192): prefill
        150 tok/s x 120 s for the check's 9 prompts (4.95 x the scale)``.
    """
    rate = cal.prefill_tokens_per_s
    if not rate or not weights:
        return Scale(context_tokens, context_tokens, False, f"the context's lengths ({what} {context_tokens:,}): the "
                     "prefill rate was not measured, so no time budget applies", cal, budget)

    def longest_s(scale: float) -> float:
        return cal.prefill_s(max(weights) * scale)

    def all_s(scale: float) -> float:
        return sum(cal.prefill_s(w * scale) for w in weights)

    def fits(scale: float) -> bool:
        return longest_s(scale) <= budget.request_s and all_s(scale) <= budget.check_s

    if fits(context_tokens):
        return Scale(context_tokens, context_tokens, False, f"the context's lengths ({what} {context_tokens:,}): prefill "
                     f"{rate:,.0f} tok/s fits them within {budget.request_s:g} s per prompt and {budget.check_s:g} s "
                     "per check", cal, budget)
    lo, hi = 0, context_tokens  # the largest scale that fits (prefill time grows with length)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    tokens = lo
    at = f"{max(weights) * max(tokens, 1) / max(longest_s(max(tokens, 1)), 1e-9):,.0f} tok/s at the longest"
    if longest_s(tokens + 1) > budget.request_s:
        why = (f"capped at {tokens:,} tokens ({what} {context_tokens:,}): prefill {at} x {budget.request_s:g} s "
               f"budget per prompt for the longest ({max(weights):g} x the scale)")
    else:
        why = (f"capped at {tokens:,} tokens ({what} {context_tokens:,}): prefill {at} x {budget.check_s:g} s "
               f"budget for the check's {len(weights)} prompts ({sum(weights):g} x the scale together)")
    return Scale(tokens, context_tokens, True, why, cal, budget)
