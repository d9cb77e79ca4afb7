"""prefix_cache.correctness judges a hit against a miss with the reference agreement's tie rule.

Seen on the H200 (vLLM 0.26.0, a random-weight Qwen3-1.7B, 2026-12-02): the hit's greedy output
left the miss's at token 14 of 24, a numerical tie of a model whose logits are near-uniform;
the strict comparison of the time disqualified the run on it.
"""

from __future__ import annotations

from evaluations.test_prefix_cache import _tie_words, hit_vs_miss, unproven_hits


def _row(phase, ids, tops):
    """A request row as ``_pair`` records it; ``tops``: per token, {token: logprob}."""
    lps = [[t, top[t], [[k, v] for k, v in top.items()]] for t, top in zip(ids, tops)]
    return {"phase": phase, "output_text": "", "output_token_ids": ids, "output_logprobs": lps}


FLAT = {1: -0.1, 2: -3.0}


def test_equal_outputs_are_exact():
    cold = _row("cold", [1, 1, 1], [FLAT] * 3)
    assert hit_vs_miss(cold, _row("warm", [1, 1, 1], [FLAT] * 3))["outcome"] == "exact"


def test_a_near_tied_divergence_is_a_tie():
    cold = _row("cold", [1, 7, 1], [FLAT, {7: -1.00, 8: -1.05}, FLAT])
    warm = _row("warm", [1, 8, 1], [FLAT, {8: -1.01, 7: -1.03}, FLAT])
    cmp = hit_vs_miss(cold, warm)
    assert cmp["outcome"] == "tie" and cmp["first_divergence"] == 1
    assert "hit token 8 vs miss token 7" in _tie_words(cmp)


def test_a_token_outside_the_other_sides_top_k_is_real():
    cold = _row("cold", [1, 7], [FLAT, {7: -0.01, 9: -6.0}])
    warm = _row("warm", [1, 8], [FLAT, {8: -0.01, 7: -7.0}])  # 8 is not among the miss's candidates
    assert hit_vs_miss(cold, warm)["outcome"] == "real"


def test_a_far_second_choice_is_real_even_inside_the_top_k():
    cold = _row("cold", [1, 7], [FLAT, {7: -0.01, 8: -5.0}])
    warm = _row("warm", [1, 8], [FLAT, {8: -0.01, 7: -5.0}])  # each in the other's top-k, 5 nats behind
    assert hit_vs_miss(cold, warm)["outcome"] == "real"


def test_without_logprobs_a_divergence_is_undetermined():
    cold = {"phase": "cold", "output_text": "", "output_token_ids": [1, 7], "output_logprobs": None}
    warm = {"phase": "warm", "output_text": "", "output_token_ids": [1, 8], "output_logprobs": None}
    assert hit_vs_miss(cold, warm)["outcome"] == "undetermined"  # the check fails it: nothing shows a tie


def test_hits_claimed_on_every_send_prove_no_cache():
    """A lying server (a breaker's double): the full prompt claimed cached on first sends too, or 1
    token every time, passed the prefill check; a repeat must count more hits than its first send."""
    assert unproven_hits([0, 16, 0], [1499, 1500, 1472]) is None  # vLLM: a shared first block at most
    assert "not above their first sends'" in unproven_hits([1500] * 3, [1500] * 3)
    assert unproven_hits([1] * 3, [1] * 3) is not None
    assert unproven_hits([0, 0, 900], [1500, 1500, 900]) is not None  # one pair proves nothing: named
