"""The verdict's rules on hand-made cases: McNemar's exact test, the tie rule, the NLL judge,
the known-answer match rule (the generic probes: ``tests/test_generic_probes.py``)."""

from __future__ import annotations

import math

import pytest

from bakeoff.analysis.judge import NLL_GAP_NATS, divergence, kl_topk, nll_verdict, pooled_nll
from bakeoff.analysis.paired import (binomial_below, decide, mcnemar_exact_p, min_detectable_drop, paired_interval)
from bakeoff.analysis.sanity import agreement, agreement_unjudgeable, compare_tie_aware, jsonable_logprobs, probe_correct


# ---- McNemar's exact test -------------------------------------------------------------------

@pytest.mark.parametrize("b, c, p", [
    (7, 0, 1 / 128),                       # 0.5^7
    (5, 1, 7 / 64),                        # P(X >= 5 | n=6) = (6 + 1) / 64
    (10, 2, 79 / 4096),                    # (C(12,10) + C(12,11) + 1) / 2^12
    (0, 0, 1.0),                           # no discordant probe: no evidence
    (0, 5, 1.0),                           # only gains: P(X >= 0) = 1
    (2, 0, 0.25),
])
def test_mcnemar_exact_one_sided_p(b, c, p):
    assert mcnemar_exact_p(b, c) == pytest.approx(p, rel=1e-12)


def test_mcnemar_rejects_negative_counts():
    with pytest.raises(ValueError):
        mcnemar_exact_p(-1, 2)


def test_two_probes_never_decide():
    """The issue's case: 2 of 48 probes lost (66.7% vs 68.8%) is within noise, not a regression."""
    ref = [True] * 33 + [False] * 15
    cand = [True] * 31 + [False] * 17
    d = decide(ref, cand)
    assert (d.b, d.c) == (2, 0) and d.p_value == pytest.approx(0.25)
    assert not d.regression
    assert d.min_detectable_drop == pytest.approx(7 / 48)
    lo, hi = d.ci95
    assert lo < d.difference < hi and hi > 0  # the interval includes "no difference"


def test_a_large_significant_drop_is_a_regression():
    ref = [True] * 240
    cand = [True] * 220 + [False] * 20
    d = decide(ref, cand)
    assert d.b == 20 and d.p_value == pytest.approx(0.5 ** 20) and d.regression
    assert d.ci95[1] < 0
    assert "McNemar" in d.sentence("reference") and "smallest detectable drop" in d.sentence("reference")


def test_a_significant_drop_inside_the_tolerance_is_not_a_regression():
    """Thousands of probes make a 1-point drop significant; the 2-point tolerance keeps it."""
    n = 5000
    ref = [True] * n
    cand = [True] * (n - 50) + [False] * 50
    d = decide(ref, cand)
    assert d.p_value < 1e-10 and -d.difference == pytest.approx(0.01) and not d.regression


def test_ties_count_as_agreement():
    ref = [True] * 10
    cand = [False] * 7 + [True] * 3
    assert decide(ref, cand).regression
    d = decide(ref, cand, ties=[True] * 7 + [False] * 3)
    assert d.ties_excluded == 7 and d.b == 0 and not d.regression and d.difference == 0


def test_decide_checks_its_input():
    with pytest.raises(ValueError):
        decide([True], [True, False])
    with pytest.raises(ValueError):
        decide([], [])


def test_interval_and_power():
    lo, hi = paired_interval(0, 0, 100)
    assert lo < 0 < hi and hi - lo < 0.05
    assert min_detectable_drop(240) == pytest.approx(7 / 240)
    assert min_detectable_drop(5) is None  # 5 probes can never be significant at 1%


def test_binomial_floor():
    below, p = binomial_below(0, 240, 0.95)
    assert below and p < 1e-100
    below, p = binomial_below(229, 240, 0.95)  # 95.4%: not below 93%
    assert not below and p > 0.5


# ---- the tie rule ---------------------------------------------------------------------------

def _out(ids, tops, text="t"):
    """An output with a logprob entry per token: ``tops[i]`` = {token: logprob}."""
    return {"id": "p", "text": text, "token_ids": ids,
            "logprobs": [(t, top.get(t, -9.0), top) for t, top in zip(ids, tops)]}


def test_tie_when_each_token_is_in_the_others_top_k():
    a = _out([5, 7, 1], [{5: -0.1}, {7: -0.69, 8: -0.70}, {1: -0.1}])
    b = _out([5, 8, 2], [{5: -0.1}, {8: -0.69, 7: -0.70}, {2: -0.1}])
    row = compare_tie_aware(a, b)
    assert row["outcome"] == "tie" and row["first_divergence"] == 1
    assert row["at_divergence"]["output_token"] == 7 and row["at_divergence"]["reference_token"] == 8


def test_real_divergence_when_a_token_is_outside_the_others_top_k():
    a = _out([5, 7], [{5: -0.1}, {7: -0.01, 3: -5.0}])
    b = _out([5, 8], [{5: -0.1}, {8: -0.01, 7: -6.0}])  # 7 is in b's top, 8 is not in a's
    assert compare_tie_aware(a, b)["outcome"] == "real"


def test_top_k_limits_the_tie():
    top = {t: -0.1 * i for i, t in enumerate(range(10, 20))}  # 10 tokens; 19 is 10th
    a = _out([19], [{**top}])
    b = _out([10], [{**top}])
    assert compare_tie_aware(a, b, top_k=5)["outcome"] == "real"
    assert compare_tie_aware(a, b, top_k=10)["outcome"] == "tie"


def test_exact_and_trailing_eos_and_missing_logprobs():
    a = {"id": "p", "text": " 7", "token_ids": [9, 0]}
    b = {"id": "p", "text": " 7", "token_ids": [9]}
    assert compare_tie_aware(a, b)["outcome"] == "exact"  # one trailing EOS id, same text
    c = {"id": "p", "text": " 8", "token_ids": [4]}
    row = compare_tie_aware(c, b)
    assert row["outcome"] == "undetermined"  # no logprobs: cannot call it a tie
    assert row["undetermined_because"] == "no logprobs at the divergence"
    row = compare_tie_aware({"id": "p", "text": "ab"}, {"id": "p", "text": "ac"})
    assert row["unit"] == "char" and row["undetermined_because"] == "no token ids in the stream"


def test_an_undetermined_divergence_says_what_was_missing():
    """Logprobs without token ids are not "no logprobs" (issue 38: 240/240 streams carried logprobs
    and the report said none): the agreement counts each reason."""
    lp = [(" 8", -0.1, {" 8": -0.1, " 7": -0.3})]
    ref = {"id": "p", "text": " 7", "token_ids": [7], "logprobs": [(7, -0.1, {7: -0.1, 8: -0.3})]}
    no_ids = {"id": "p", "text": " 8", "logprobs": lp}
    agr = agreement([no_ids, no_ids, {"id": "p", "text": " 8", "token_ids": [8]}], [ref, ref, ref])
    assert agr["undetermined"] == 3
    assert agr["undetermined_because"] == {"no token ids in the stream": 2, "no logprobs at the divergence": 1}


def test_tie_rule_survives_json_storage():
    """Stored logprobs have list-of-pairs tops (JSON object keys would turn ids into strings)."""
    import json

    a = _out([5, 7], [{5: -0.1}, {7: -0.69, 8: -0.70}])
    b = _out([5, 8], [{5: -0.1}, {8: -0.69, 7: -0.70}])
    a2 = {**a, "logprobs": json.loads(json.dumps(jsonable_logprobs(a["logprobs"])))}
    b2 = {**b, "logprobs": json.loads(json.dumps(jsonable_logprobs(b["logprobs"])))}
    assert compare_tie_aware(a2, b2)["outcome"] == "tie"
    agr = agreement([a2, a2], [b2, a2])
    assert (agr["exact"], agr["tie"], agr["real"]) == (1, 1, 0) and agr["logprobs"]


def test_agreement_on_a_model_the_reference_cannot_answer():
    """A random-weight model: both sides answer 0% of the probes, so McNemar's 'within noise' is
    two zeros. Undetermined divergences (the H200's 1.7B run: 285 of 300 without logprobs) leave
    agreement unverified; all exact-or-tie verifies it; a reference that answers judges as before."""
    same = {"id": "p", "text": " 7", "token_ids": [9]}
    other = {"id": "p", "text": " 8", "token_ids": [4]}
    unverified = agreement([same, other], [same, same])
    assert (unverified["exact"], unverified["undetermined"]) == (1, 1)
    reason = agreement_unjudgeable(unverified, 0.0, 0.5)
    assert reason and "0%" in reason and "1 undetermined" in reason
    assert agreement_unjudgeable(unverified, 0.9, 0.5) is None  # the paired test can judge
    a = _out([5, 7], [{5: -0.1}, {7: -0.69, 8: -0.70}])
    b = _out([5, 8], [{5: -0.1}, {8: -0.69, 7: -0.70}])
    assert agreement_unjudgeable(agreement([a, same], [b, same]), 0.0, 0.5) is None  # a tie and an exact: verified
    blank = agreement([{"id": "p", "text": "", "token_ids": None}], [{"id": "p", "text": "", "token_ids": [0, 7]}])
    assert blank["exact"] == 1 and "1 blank texts" in agreement_unjudgeable(blank, 0.0, 0.5)  # '' == '' proves nothing
    assert agreement_unjudgeable(agreement([], []), 0.0, 0.5)  # no probe compared: nothing verified


# ---- the NLL judge and KL --------------------------------------------------------------------

def test_nll_judge_rule():
    assert pooled_nll([[-0.5, -1.5], [-1.0]]) == (1.0, 3)
    status, line = nll_verdict(8.0, 100, 0.4, 100)
    assert status == "fail" and "+7.60" in line
    assert nll_verdict(0.9, 100, 0.4, 100)[0] == "pass"
    assert nll_verdict(0.4 + NLL_GAP_NATS + 0.01, 100, 0.4, 100)[0] == "fail"
    assert nll_verdict(9.0, 3, 0.4, 100)[0] == "skip"  # too few tokens to judge


def test_kl_topk_and_top1_agreement():
    same = {1: math.log(0.7), 2: math.log(0.2), 3: math.log(0.1)}
    assert kl_topk(same, same) == pytest.approx(0.0, abs=1e-12)
    other = {1: math.log(0.2), 2: math.log(0.7), 3: math.log(0.1)}
    # full support on both sides: the exact KL, 0.7 ln(0.7/0.2) + 0.2 ln(0.2/0.7) = 0.5 ln 3.5
    assert kl_topk(same, other) == pytest.approx(0.5 * math.log(3.5), rel=1e-9)
    div = divergence([[(1, math.log(0.7)), (2, math.log(0.2))], [(2, -0.1)]],
                     [(1, math.log(0.7), same), (2, -0.5, other)], top_k=1)
    assert div["positions"] == 2 and div["top1_agreement"] == 1.0 and div["mean_kl_nats"] is not None


def test_kl_is_not_measurable_from_the_chosen_token_alone():
    """OpenVINO reports only the chosen token's logprob: a 1-entry "top" map. Identical greedy
    outputs (the reference's top token is the backend's at every position) must not read as
    a KL of ln(k)-ish nats; KL is "not measurable" and top-1 agreement still counts."""
    k = 20
    ref = [[(t, math.log(0.9))] + [(100 + j, math.log(0.1 / (k - 1))) for j in range(k - 1)] for t in range(30)]
    chosen_only = [(t, math.log(0.9), {t: math.log(0.9)}) for t in range(30)]
    div = divergence(ref, chosen_only, top_k=k)
    assert div["mean_kl_nats"] is None and div["kl_positions"] == 0 and div["kl_short_positions"] == 30
    assert "at most 1 per position" in div["kl_not_measurable"]
    assert div["positions"] == 30 and div["top1_agreement"] == 1.0
    full = [(t, math.log(0.9), dict(r)) for t, r in zip(range(30), ref)]
    both = divergence(ref, full, top_k=k)
    assert both["mean_kl_nats"] == pytest.approx(0.0, abs=1e-9) and both["kl_positions"] == 30
    assert both["kl_not_measurable"] is None
    from evaluations.test_judge import _divergence_line

    line = _divergence_line(div)  # the check's summary: words, never a number
    assert "KL not measurable" in line and "mean KL" not in line and "top-1 agreement 100.0%" in line
    mixed = divergence(ref, full[:10] + chosen_only[10:], top_k=k)  # short positions never enter the mean
    assert mixed["kl_positions"] == 10 and mixed["kl_short_positions"] == 20 and mixed["mean_kl_nats"] == pytest.approx(0.0, abs=1e-9)


# ---- known answers: the match rule -----------------------------------------------------------

def test_probe_correct_needs_a_boundary():
    assert probe_correct(" 37 38 39", "37 38") and not probe_correct("36", "37")
    assert probe_correct(" 12\n3 +", " 12\n") and not probe_correct(" 123", " 12")
    assert probe_correct(" 7", " 7") and probe_correct(" 7<eos>", " 7") and not probe_correct(" 70", " 7")
    assert probe_correct("The letter after J is K.", "K", "contains")
    assert not probe_correct("OK then", "K", "contains")


def test_a_decoder_taking_the_second_best_token_is_not_a_tie():
    """Membership in the top-k is not enough: each side's token must lead by at most 1 nat."""
    a = _out([5, 8], [{5: -0.1}, {7: -0.01, 8: -5.0}])  # took its own second choice, 5 nats down
    b = _out([5, 7], [{5: -0.1}, {7: -0.01, 8: -5.0}])
    row = compare_tie_aware(a, b)
    assert row["outcome"] == "real" and row["at_divergence"]["reference_gap_nats"] == pytest.approx(4.99)


def test_ids_against_token_strings_is_undetermined():
    a = {"id": "p", "text": "x", "token_ids": [5], "logprobs": [(5, -0.5, {5: -0.5, 6: -0.9})]}
    b = {"id": "p", "text": "y", "token_ids": [6], "logprobs": [("y", -0.5, {"y": -0.5, "x": -0.9})]}
    row = compare_tie_aware(a, b)
    assert row["outcome"] == "undetermined"
    assert row["undetermined_because"] == "logprobs keyed by token text on one side, by token id on the other"


def test_judge_never_passes_on_broken_scores():
    nan, n = pooled_nll([[-0.1, float("nan")]])
    assert nan != nan and nll_verdict(nan, 40, 0.5, 40)[0] == "skip"
    assert kl_topk({1: float("-inf")}, {1: -0.1}) is None


def test_logprobs_stay_aligned_with_token_ids():
    """An event without logprobs keeps its place: later positions are not shifted."""
    from bakeoff.loadgen.accounting import account
    from bakeoff.api.specs import RequestRecord, TokenEvent

    evs = [TokenEvent(1, "a", [1], logprobs=[(1, -0.1, {1: -0.1})]), TokenEvent(2, "bc", [2, 3]),
           TokenEvent(3, "d", [4], logprobs=[(4, -0.2, {4: -0.2})])]
    rec = RequestRecord(request_id="r")
    account(rec, evs, None, None, None)
    assert rec.output_token_ids == [1, 2, 3, 4]
    assert [e[0] if e else None for e in rec.output_logprobs] == [1, None, None, 4]
    assert jsonable_logprobs(rec.output_logprobs)[1] is None


def test_usage_settled_by_the_stream_beats_a_tokenizer_that_is_not_the_servers():
    """Issue 38: the prompt counts agreed by chance, the client's tokenizer counted a 32-event
    stream as 86 tokens, usage said 32. One token an event, 32 events: the stream settles it,
    the figures use 32 and the source names the tokenizer; a stream whose events are fewer than
    usage still disagrees."""
    from bakeoff.loadgen.accounting import account
    from bakeoff.api.specs import RequestRecord, TokenEvent

    evs = [TokenEvent(i, "ab c", None) for i in range(32)]
    wrong_tokenizer = lambda text: 3 if text == "ab c" else len(text.split())  # noqa: E731 - 86 ~ 3 an event
    rec = RequestRecord(request_id="r", status="ok")
    account(rec, evs, 2, 32, wrong_tokenizer, prompt="hi there")
    assert (rec.output_tokens, rec.accounting, rec.accounting_mismatch) == (32, "agree", False)
    assert "agrees with client-events" in rec.output_tokens_source and "counts 96" in rec.output_tokens_source
    assert len(rec.token_times_ns) == 32
    rec = RequestRecord(request_id="r", status="ok")
    account(rec, evs[:20], 2, 32, wrong_tokenizer, prompt="hi there")
    assert (rec.accounting, rec.output_tokens) == ("disagree", 60)  # nothing settles it: the mismatch stands


# ---- failure classes ------------------------------------------------------------------------

def _recording_run(tmp_path):
    from bakeoff.api.verdict import Verdict
    from bakeoff.host.artifacts import RunDir
    from bakeoff.host.run import RunContext

    rundir = RunDir.create(tmp_path, "openai", "m")
    return RunContext(rundir, Verdict(run_id=rundir.run_id, backend="openai", model="m"))


def test_the_failure_classes_are_sixteen():
    from bakeoff.api.verdict import FAILURE_CLASSES

    assert len(FAILURE_CLASSES) == 16 and "unsupported-architecture" in FAILURE_CLASSES


def test_recording_an_unknown_failure_class_raises_at_once(tmp_path):
    """A class nobody defined fails the code that names it: when its scope opens, when a check
    fails with it, when an engine failure carrying it ends a scope, when a check is recorded;
    nothing of it is written."""
    from bakeoff.api.errors import EngineFailure
    from bakeoff.api.verdict import Check
    from bakeoff.host.run import CheckFailed

    run = _recording_run(tmp_path)
    with pytest.raises(ValueError, match="unknown failure class 'timeout'.*hang"):
        run.check("x.opened", "timeout")
    with pytest.raises(ValueError, match="'crash'"):
        CheckFailed("crash", "the engine died")
    with pytest.raises(ValueError, match="'segfault'"):
        with run.check("x.engine", "runtime-crash"):
            raise EngineFailure("segfault", "the engine's own word is no class")
    with pytest.raises(ValueError, match="'oom'"):
        run.record(Check(name="x.recorded", status="fail", failure_class="oom"))
    assert run.verdict.checks == [] and not (run.dir.path / "checks").exists()
    with run.check("x.known", "hang"):
        pass
    run.record(Check(name="x.failed", status="fail", failure_class="unsupported-architecture"))
    assert [c.name for c in run.verdict.checks] == ["x.known", "x.failed"]


def _class_literals() -> dict[str, list[str]]:
    """Every string literal the code puts where a failure class goes: the first argument of
    ``EngineFailure``/``CheckFailed``, ``run.check(name, cls)``, ``c.fail(summary, cls)``,
    ``c.require(ok, summary, cls)``, ``failure_class=`` keywords, assignments to and comparisons
    with ``.failure_class`` / ``failure_class`` / ``error_class``, and the classes of
    ``bakeoff/analysis/failures.py PATTERNS``."""
    import ast
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    names = ("failure_class", "error_class", "fclass")
    found: dict[str, list[str]] = {}

    def strings(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node.value
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            for e in node.elts:
                yield from strings(e)
        elif isinstance(node, ast.IfExp):
            yield from strings(node.body)
            yield from strings(node.orelse)
        elif isinstance(node, ast.BoolOp):
            for v in node.values:
                yield from strings(v)

    def named(node) -> bool:
        return (isinstance(node, ast.Name) and node.id in names) or (isinstance(node, ast.Attribute) and node.attr in names)

    for pkg in ("bakeoff", "backends", "adapters", "evaluations", "cli"):
        for path in (repo / pkg).rglob("*.py"):
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                picked = []
                if isinstance(node, ast.Call):
                    f = node.func
                    fname = f.id if isinstance(f, ast.Name) else (f.attr if isinstance(f, ast.Attribute) else "")
                    pos = {"EngineFailure": 0, "CheckFailed": 0, "check": 1, "fail": 1, "require": 2}.get(fname)
                    if pos is not None and len(node.args) > pos:
                        picked.append(node.args[pos])
                    picked += [k.value for k in node.keywords if k.arg in names]
                elif isinstance(node, ast.Assign) and any(named(t) for t in node.targets):
                    picked.append(node.value)
                elif isinstance(node, ast.Compare) and (named(node.left) or any(named(c) for c in node.comparators)):
                    picked += [node.left, *node.comparators]
                elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "PATTERNS" for t in node.targets):
                    picked += [t.elts[0] for t in ast.walk(node.value) if isinstance(t, ast.Tuple) and t.elts]
                for value in picked:
                    for text in strings(value):
                        found.setdefault(text, []).append(f"{path.relative_to(repo)}:{node.lineno}")
    return found


def test_every_failure_class_the_code_names_is_in_the_list():
    from bakeoff.api.verdict import FAILURE_CLASSES

    found = _class_literals()
    classes = {k: v for k, v in found.items() if k and k.replace("-", "").isalpha() and k.islower()}
    unknown = {k: v[:3] for k, v in classes.items() if k not in FAILURE_CLASSES}
    assert not unknown, f"failure classes named in code but not in FAILURE_CLASSES: {unknown}"
    # the scan is not vacuous: it sees the classes the code raises and compares with
    assert {"hang", "runtime-crash", "load-failure", "unsupported-architecture", "incompatible-features",
            "transport-distortion", "client-accounting", "cache-correctness", "ineffective-option"} <= set(classes)
