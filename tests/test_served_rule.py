"""The served rule (bakeoff/analysis/served.py): an engine's output under a condition against its own
quiet output; the one-sided tie rule where the condition's requests carry no logprobs; the binomial
decision; MLPerf TEST06/TEST09's response contract."""

from __future__ import annotations

import json

import pytest

from bakeoff.analysis.served import (MIN_REAL_DIVERGENCES, binomial_tail, compare_served, counts, cut_at_eos, eos_ids,
                                     judge_real, length_ratio, response_contract, smallest_failing)


def _lp(ids, tops):
    return [[t, top[t], [[k, v] for k, v in top.items()]] for t, top in zip(ids, tops)]


FLAT = {1: -0.1, 2: -3.0}


def test_identical_outputs_are_exact_with_or_without_logprobs():
    quiet = {"id": "a", "token_ids": [1, 1, 1], "logprobs": _lp([1, 1, 1], [FLAT] * 3)}
    assert compare_served({"id": "a", "token_ids": [1, 1, 1]}, quiet)["outcome"] == "exact"


def test_one_sided_a_near_tie_of_the_quiet_side_is_a_tie():
    quiet = {"id": "a", "token_ids": [1, 7], "logprobs": _lp([1, 7], [FLAT, {7: -0.70, 8: -0.72, 9: -4.0}])}
    row = compare_served({"id": "a", "token_ids": [1, 8]}, quiet)  # no logprobs on the served side (the sweep)
    assert row["outcome"] == "tie" and row["rule"] == "one-sided" and row["first_divergence"] == 1
    assert row["at_divergence"]["reference_gap_nats"] == pytest.approx(0.02)


@pytest.mark.parametrize("top", [{7: -0.01, 9: -6.0}, {7: -0.01, 8: -5.0}], ids=["outside top-k", "far behind"])
def test_one_sided_a_token_outside_or_far_behind_is_real(top):
    quiet = {"id": "a", "token_ids": [1, 7], "logprobs": _lp([1, 7], [FLAT, top])}
    assert compare_served({"id": "a", "token_ids": [1, 8]}, quiet)["outcome"] == "real"


def test_both_sides_with_logprobs_use_the_two_sided_rule():
    quiet = {"id": "a", "token_ids": [1, 7], "logprobs": _lp([1, 7], [FLAT, {7: -0.01, 8: -0.5}])}
    served = {"id": "a", "token_ids": [1, 8], "logprobs": _lp([1, 8], [FLAT, {8: -0.01, 9: -0.2}])}  # 7 not in its top
    row = compare_served(served, quiet)
    assert row["outcome"] == "real" and row["rule"] == "both sides"


def test_without_quiet_logprobs_a_difference_stays_undetermined():
    row = compare_served({"id": "a", "token_ids": [1, 8]}, {"id": "a", "token_ids": [1, 7]})
    assert row["outcome"] == "undetermined"
    assert counts([row]) == {"exact": 0, "tie": 0, "real": 0, "undetermined": 1, "compared": 0}


def test_one_real_divergence_never_decides():
    assert MIN_REAL_DIVERGENCES == 2
    assert not judge_real(1, 1)["fails"] and not judge_real(1, 300)["fails"]
    assert judge_real(2, 8)["fails"]  # 2 of 8: p = 0.0027 against the 1% a tie-rule miss allows


def test_the_binomial_threshold_grows_with_the_outputs_compared():
    assert smallest_failing(16) == 3 and smallest_failing(32) == 3 and smallest_failing(48) == 4
    assert smallest_failing(300) == 9
    assert judge_real(8, 300)["fails"] is False and judge_real(9, 300)["fails"] is True
    assert binomial_tail(0, 10, 0.5) == 1.0 and binomial_tail(11, 10, 0.5) == 0.0


def test_the_determinism_switch_asks_identical_outputs():
    d = judge_real(0, 48, exact=True, differing=1)  # one tie: a tie is a difference once the switch is on
    assert d["fails"] and d["smallest_failing"] == 1
    assert not judge_real(0, 48, exact=True, differing=0)["fails"]


def test_response_contract_mlperf_test06():
    eos = {2}
    assert response_contract({"status": "ok", "finish_reason": "stop", "token_ids": [5, 6, 2]}, eos) == []
    assert response_contract({"status": "ok", "finish_reason": None, "token_ids": [5]}, eos) == ["no finish reason"]
    assert response_contract({"status": "ok", "finish_reason": "stop", "token_ids": [2, 5, 2]}, eos) == \
        ["2 end-of-sequence tokens"]
    assert "tokens after the end-of-sequence token" in response_contract(
        {"status": "ok", "finish_reason": "length", "token_ids": [5, 2, 6]}, eos)[0]
    # ignore_eos asks for tokens past it: not a violation
    assert response_contract({"status": "ok", "finish_reason": "length", "token_ids": [2, 5, 2],
                              "ignore_eos": True}, eos) == []


def test_length_ratio_mlperf_test09():
    quiet = [{"token_ids": [1] * 10}, {"token_ids": [1] * 10}]
    assert length_ratio([{"token_ids": [1] * 10}, {"token_ids": [1] * 11}], quiet)["within"]
    off = length_ratio([{"token_ids": [1] * 20}, {"token_ids": [1] * 20}], quiet)
    assert not off["within"] and off["ratio"] == 2.0


def test_eos_ids_and_cut(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert eos_ids(str(tmp_path)) == {2, 7}
    assert eos_ids(None) == set() and eos_ids(str(tmp_path / "missing")) == set()
    assert cut_at_eos([5, 7, 9, 2], {2, 7}) == [5, 7]
    assert cut_at_eos([5, 6], {2}) == [5, 6] and cut_at_eos(None, {2}) is None


def test_answer_span_judges_what_answers_the_prompt():
    from bakeoff.analysis.served import answer_span

    # the reference stopped at EOS (2) after 3 tokens; the engine masked EOS under ignore_eos and went on
    assert answer_span([5, 6, 7, 9, 9, 9], [5, 6, 7, 2], {2}) == ([5, 6, 7], [5, 6, 7])
    # an engine that emits EOS and continues is cut at it
    assert answer_span([5, 6, 2, 9], [5, 6, 7, 2], {2}) == ([5, 6, 2], [5, 6, 7])
    # the reference ran to max_tokens: the whole output is the answer
    assert answer_span([5, 6, 7, 8], [5, 6, 7, 9], {2}) == ([5, 6, 7, 8], [5, 6, 7, 9])
    assert answer_span([5, 2, 7], None, {2}) == ([5, 2], [])  # no reference answer: cut at EOS only
    assert answer_span([5, 6], [2], {2}) == ([], [])  # the reference stops at once: nothing answers


def test_logprobs_without_alternatives_tell_nothing():
    """OpenVINO GenAI reports only the chosen token's logprob: a 1-entry map cannot show a tie."""
    quiet = {"id": "a", "token_ids": [1, 7], "logprobs": _lp([1, 7], [FLAT, {7: -0.3}])}
    served = {"id": "a", "token_ids": [1, 8], "logprobs": _lp([1, 8], [FLAT, {8: -0.3}])}
    row = compare_served(served, quiet)
    assert row["outcome"] == "undetermined" and "no alternative" in row["undetermined_because"]


def test_text_only_outputs_are_judged_on_the_reference_s_ids_or_their_own_tokens():
    """llama-server streams no ids while it drafts: an output holding the reference's whole answer takes its
    ids (exact); another is tokenized with the model's tokenizer, so the one-sided tie rule can run."""
    from types import SimpleNamespace

    from bakeoff.models.resolve import resolve
    from evaluations.test_judge import _with_ids

    path = resolve("fixture:tiny-qwen3").path
    settings = SimpleNamespace(reference_model=SimpleNamespace(path=path), reference_options={})
    reference = {"p": {"text": " 12 13", "full_ids": [7, 8, 2]}}
    rows, how = _with_ids([{"prompt": "p", "text": " 12 13 14 15"}, {"prompt": "p", "text": " 99"}], reference, settings)
    assert rows[0]["token_ids"] == [7, 8, 2] and rows[1]["token_ids"] and "tokenized" in how
    same, how = _with_ids([{"prompt": "p", "text": "x", "token_ids": [1]}], reference, settings)
    assert same[0]["token_ids"] == [1] and how is None
