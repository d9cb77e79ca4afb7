"""Sanity: known answers, model-free degeneration detectors, agreement with the reference."""

from __future__ import annotations

import asyncio

import pytest

from bakeoff.loadgen.sweep import run_request
from bakeoff.analysis.generic_probes import chat_template_of, render_chat
from bakeoff.analysis.paired import ALPHA, TOLERANCE, binomial_below, decide, fisher_greater
from bakeoff.analysis.sanity import (MAX_NON_GREEDY_FRACTION, PROBE_LOGPROBS, agreement, agreement_unjudgeable, detectors,
                                     greedy_violated, non_greedy_steps, probe_correct)
from bakeoff.api.specs import GenerationRequest
from evaluations.plugin import attach_engine_evidence
from evaluations.probing import open_ended_prompts, run_probes
from evaluations.reference import MIN_BASELINE_ACCURACY, baseline
from evaluations.tokenizing import map_text_logprobs, reference_tokenizer, uses_chat

# What a run's accuracy depends on, as the engine stated it (BackendInfo.notes): named in an accuracy
# regression's message, so that "ORT GenAI int4 loses 11 points" reads as the configuration's cost
# and not as the engine's fault (the same engine's lossless cell is beside it in the report).
PRECISION_NOTES = ("export_precision", "int4_algo", "dtype", "inference_precision", "kv_cache_dtype", "quantization")


def configuration(engine) -> str:
    """``; configuration: export_precision int4 (observed: int4); int4_algo rtn_last (...)`` or ``""``."""
    notes = (engine.info.notes if getattr(engine, "info", None) else None) or {}
    parts = [f"{k} {str(notes[k])[:80]}" for k in PRECISION_NOTES if notes.get(k)]
    return f"; configuration: {'; '.join(parts)}" if parts else ""


def as_served(engine, settings, prompt: str) -> str | None:
    """The text an engine generates from when sent ``prompt``: itself on a completions API; on a chat
    API, a user message of it rendered with the model's chat template, as its server renders it (None
    where no template renders here: nothing to score its output under)."""
    if not uses_chat(engine):
        return prompt
    template, special = chat_template_of(settings.model.path) if settings.model.local else (None, {})
    return render_chat(template, [{"role": "user", "content": prompt}], special) if template else None


# Degeneration: fail when more than a quarter of the outputs trip a detector.
MAX_FLAGGED_FRACTION = 0.25
OPEN_ENDED_TOKENS = 48


@pytest.fixture(scope="module")
def probe_outputs(engine, probes, run, settings):
    """The engine's greedy outputs of the probes; where it streamed logprobs keyed by token text and
    no ids, the ids mapped with the reference's tokenizer (:func:`evaluations.tokenizing.map_text_logprobs`)."""
    items, source = probes
    outs = run_probes(engine, items, logprobs=PROBE_LOGPROBS)
    record: dict = {"source": source, "outputs": outs}
    if any(not o.get("token_ids") and o.get("logprobs") for o in outs):
        tok, why = reference_tokenizer(settings.reference_model.path,
                                       bool(settings.reference_options.get("trust_remote_code", False)))
        record["text_logprobs"] = map_text_logprobs(outs, tok) if tok is not None else {"not_mapped": why}
    run.dir.write_json("evidence/sanity.outputs.json", record)
    return outs


def _correct(outs: list[dict]) -> list[bool]:
    return [o["status"] == "ok" and probe_correct(o["text"], o["expected"], o.get("match", "prefix")) for o in outs]


GARBAGE_KEPT_SHARE = 0.5  # a regression keeping fewer of the baseline's right answers is garbage-output


def _accuracy_by_task(rows: list[dict]) -> dict[str, float]:
    """Probe accuracy per task, in the order the tasks first appear."""
    per_task: dict[str, list[bool]] = {}
    for r in rows:
        per_task.setdefault(r["task"], []).append(r["correct"])
    return {k: round(sum(v) / len(v), 3) for k, v in per_task.items()}


def _note_sent_again(c, probe_outputs: list[dict]) -> None:
    """Say in the values how many probe streams were cut under concurrency and sent again alone."""
    cut = sum(bool(o.get("cut_under_concurrency")) for o in probe_outputs)
    if cut:  # evaluations/probing.py run_probes
        c.values["sent_again_alone"] = (f"{cut} probe streams the server ended without a finish_reason while others "
                                        "were in flight, sent again one at a time")


def _judge_by_bar(c, bar: float, acc: float, n: int, source: str, examples: str) -> None:
    """Known answers against the fixed bar of ``--min-probe-accuracy``."""
    c.values.update({"rule": "fixed bar (--min-probe-accuracy)", "threshold": bar})
    c.require(acc >= bar, f"probe accuracy {acc:.0%} below {bar:.0%} on {source} probes; e.g. {examples}")
    c.summary = f"probe accuracy {acc:.0%} >= {bar:.0%} ({n} {source} probes)"


def _judge_by_floor(c, base, correct: list[bool], acc: float, n: int, examples: str) -> None:
    """Known answers against a negative-control twin's floor: exact binomial test."""
    below, p = binomial_below(sum(correct), len(correct), base.accuracy)
    c.values.update({"rule": "exact binomial test against the floor", "floor": base.accuracy,
                     "tolerance": TOLERANCE, "p_value": float(f"{p:.4g}")})
    c.require(not below, f"probe accuracy {acc:.0%} on {n} probes, significantly below the "
                         f"{base.accuracy:.0%} floor ({base.source}; p={p:.2g}); e.g. {examples}")
    c.summary = f"probe accuracy {acc:.0%}, not significantly below the {base.accuracy:.0%} floor (p={p:.2g})"


def _judge_by_self(c, acc: float, n: int, source: str) -> None:
    """The reference under test is its own baseline: skip unless it answers enough probes to judge."""
    c.values["rule"] = f"the reference answers at least {MIN_BASELINE_ACCURACY:.0%}"
    if acc < MIN_BASELINE_ACCURACY:
        c.skip(f"the reference answers only {acc:.0%} of the {n} {source} probes "
               f"(< {MIN_BASELINE_ACCURACY:.0%}): known answers cannot judge this model")
    c.summary = f"probe accuracy {acc:.0%} ({n} {source} probes; the reference itself)"


def _judge_paired(c, engine, base, correct: list[bool], acc: float, n: int, source: str, examples: str) -> None:
    """Known answers against the baseline's, paired (McNemar exact test + tolerance); the failure
    class by the share of the baseline's right answers kept."""
    d = decide(base.correct, correct)
    c.values.update({"rule": "paired McNemar exact test + tolerance (bakeoff.analysis.paired)", "decision": d.as_values()})
    kept = [ok for ok, base_ok in zip(correct, base.correct) if base_ok]
    kept_share = sum(kept) / len(kept) if kept else 0.0
    if base.kind == "reference":
        c.values["accuracy_on_reference_correct"] = round(kept_share, 4) if kept else None
    # a significant drop keeping most of the baseline's answers is an accuracy regression (a lossy
    # quantization); losing most of them is not producing the known answers at all
    fclass = "garbage-output" if kept_share < GARBAGE_KEPT_SHARE else "accuracy-regression"
    c.require(not d.regression, f"known answers regress against {base.source}: {d.sentence(base.kind)}; "
                                f"{kept_share:.0%} of its right answers kept; e.g. {examples}" + configuration(engine),
              fclass)
    c.summary = f"probe accuracy {acc:.0%} ({n} {source} probes), within noise of {base.kind}: {d.sentence(base.kind)}"


@pytest.mark.check("sanity.known_answers")
def test_known_answers(run, settings, engine, probes, probe_set, probe_outputs, reference):
    """Known answers, judged against a baseline with the paired rule of :mod:`bakeoff.analysis.paired`.

    The baseline (:func:`evaluations.reference.baseline`): a fixture's builder record (paired
    McNemar exact test, tolerance 2 points), the reference's answers on the same probes for
    other models, or the floor a negative-control fixture's trained twin promises (exact
    binomial test). A paired regression is ``accuracy-regression`` while the backend keeps at least
    :data:`GARBAGE_KEPT_SHARE` of the probes the baseline answers, ``garbage-output`` below (the
    untrained twin, a garbage server). ``min_probe_accuracy`` (``--min-probe-accuracy``) replaces the baseline by
    a plain bar. A baseline that fails most probes cannot judge: the check skips, saying so.
    Values ``chat_rendering``: whose chat template rendered the chat probes the engine was sent,
    and, when the reference's own rendering differs, the first differing prompt
    (:class:`evaluations.reference.ProbeSet`).
    """
    items, source = probes
    with run.check("sanity.known_answers", "garbage-output") as c:
        if not items:
            c.skip(f"no probe was sent: {probe_set.rendering.get('left_out_for_api') or 'the probe set is empty'}",
                   required=True)
        errors = [o for o in probe_outputs if o["status"] != "ok"]
        correct = _correct(probe_outputs)
        rows = [{**{k: v for k, v in o.items() if k != "logprobs"}, "correct": ok} for o, ok in zip(probe_outputs, correct)]
        c.evidence("probes.json", rows)
        acc = sum(correct) / len(correct) if correct else 0.0
        c.values.update({"probes": len(rows), "probe_source": source, "accuracy": round(acc, 4), "errors": len(errors),
                         "accuracy_by_task": _accuracy_by_task(rows), "chat_rendering": probe_set.rendering})
        _note_sent_again(c, probe_outputs)
        if errors:
            attach_engine_evidence(c, engine, errors[0].get("error_class"))
            c.fail(f"{len(errors)}/{len(rows)} probe requests failed: {errors[0]['error']}",
                   errors[0].get("error_class") or "runtime-crash")
        bad = [r for r in rows if not r["correct"]][:3]
        examples = "; ".join(f"{r['prompt'][-40:]!r} -> {r['text'][:40]!r} (expected {r['expected']!r})" for r in bad)
        if settings.min_probe_accuracy is not None:
            _judge_by_bar(c, settings.min_probe_accuracy, acc, len(rows), source, examples)
            return
        base = baseline(settings, reference, items)
        c.values.update({"baseline": base.kind, "baseline_source": base.source, "baseline_accuracy": base.accuracy})
        if base.skip_reason:
            c.skip(base.skip_reason)
        if base.kind == "floor":
            _judge_by_floor(c, base, correct, acc, len(rows), examples)
            return
        if base.kind == "self":
            _judge_by_self(c, acc, len(rows), source)
            return
        _judge_paired(c, engine, base, correct, acc, len(rows), source, examples)


@pytest.mark.check("sanity.greedy")
def test_greedy(run, engine, probe_outputs):
    """Temperature 0 is greedy: each chosen token is the top of the engine's own logprobs
    (:func:`bakeoff.analysis.sanity.non_greedy_steps`); an engine whose server samples otherwise
    (its own penalties or truncation) has accepted ``temperature=0`` without its effect
    (``ineffective-option``). Without alternatives in the logprobs it verifies nothing: ``skip``."""
    with run.check("sanity.greedy", "ineffective-option") as c:
        counts = non_greedy_steps(probe_outputs)
        c.values.update({k: counts[k] for k in ("verified", "non_greedy")})
        if counts["examples"]:
            c.evidence("non_greedy_steps.json", counts["examples"])
        if not counts["verified"]:
            c.skip("not verified: the engine's logprobs name no alternatives to the chosen token")
        c.require(not greedy_violated(counts),
                  f"{counts['non_greedy']}/{counts['verified']} probe steps at temperature 0 chose a token below the "
                  f"engine's own top logprob (> {MAX_NON_GREEDY_FRACTION:.0%}): not greedy; e.g. step "
                  f"{counts['examples'][0]['step'] if counts['examples'] else '?'} of "
                  f"{counts['examples'][0]['id'] if counts['examples'] else '?'}")
        c.summary = f"{counts['verified'] - counts['non_greedy']}/{counts['verified']} steps chose the engine's own top token"


@pytest.mark.check("sanity.degeneration")
def test_degeneration(run, settings, engine, probe_texts, probe_outputs):
    items, _ = probe_texts
    prompts = open_ended_prompts(items)
    with run.check("sanity.degeneration", "garbage-output") as c:
        async def open_ended():  # all at once, as the probes go: a batching engine batches them
            try:
                return await asyncio.gather(*(run_request(engine, GenerationRequest(
                    request_id=f"open-{i}", prompt=p, max_tokens=OPEN_ENDED_TOKENS)) for i, p in enumerate(prompts)))
            finally:
                await engine.aclose()
        recs = asyncio.run(open_ended())
        rows = []
        for r, q in zip(recs, prompts):
            d = detectors(r.output_text, r.output_token_ids, OPEN_ENDED_TOKENS, r.finish_reason)
            # "prompt": what the engine generated from, which the judge scores its output under
            rows.append({"id": r.request_id, "prompt": as_served(engine, settings, q), "sent": q,
                         "text": r.output_text, "token_ids": r.output_token_ids,
                         "finish_reason": r.finish_reason, "status": r.status, "error": r.error, **d})
        for o in probe_outputs:
            d = detectors(o["text"], o["token_ids"], o["max_tokens"], o["finish_reason"])
            rows.append({"id": o["id"], "text": o["text"], "finish_reason": o["finish_reason"], "status": o["status"], **d})
        c.evidence("detectors.json", rows)
        failed = [r for r in recs if r.status != "ok"]
        if failed:  # an output that never came is not "not degenerate"
            attach_engine_evidence(c, engine, failed[0].error_class)
            c.fail(f"{len(failed)}/{len(recs)} open-ended requests failed: {failed[0].error}",
                   failed[0].error_class or "runtime-crash")
        flagged = [r for r in rows if r["flags"]]
        frac = len(flagged) / len(rows) if rows else 0.0
        counts: dict[str, int] = {}
        for r in flagged:
            for f in r["flags"]:
                counts[f] = counts.get(f, 0) + 1
        c.values.update({"outputs": len(rows), "flagged": len(flagged), "flagged_fraction": round(frac, 3),
                         "flags": counts, "max_longest_repeat_run": max((r["longest_repeat_run"] for r in rows), default=0),
                         "min_distinct_2": min((r["distinct_2"] for r in rows), default=None)})
        c.require(frac <= MAX_FLAGGED_FRACTION,
                  f"{len(flagged)}/{len(rows)} outputs degenerate ({', '.join(f'{k} x{v}' for k, v in counts.items())}); "
                  f"e.g. {flagged[0]['text'][:60]!r}" if flagged else "")
        c.summary = f"{len(flagged)}/{len(rows)} outputs flagged"


TEMPLATE_DIVERGENCE_GAP = 0.25  # how much more often differently rendered probes must diverge (absolute share)
TEMPLATE_MIN_PROBES = 10  # fewer probes rendered otherwise are reported, not judged


def template_effect(rows: list[dict], differing: set) -> dict:
    """Whether a chat template that differs from the reference's changes the outputs.

    Rule: the share of real divergences (past the tie rule; ties and undetermined rows do not
    count) among the probes rendered otherwise is compared with that among the probes both sides
    saw alike, by Fisher's exact test (one-sided, :func:`bakeoff.analysis.paired.fisher_greater`); the
    template changes the answers when ``p < ALPHA`` (0.01) and the gap is at least
    :data:`TEMPLATE_DIVERGENCE_GAP`, over at least :data:`TEMPLATE_MIN_PROBES` probes rendered
    otherwise. A quantized engine diverging everywhere alike is not
    flagged by it (its accuracy is :func:`decide`'s to judge); one probe never decides.
    """
    diff = [r for r in rows if r["id"] in differing]
    alike = [r for r in rows if r["id"] not in differing]
    real_d = sum(r["outcome"] == "real" for r in diff)
    real_a = sum(r["outcome"] == "real" for r in alike)
    p = fisher_greater(real_d, len(diff), real_a, len(alike)) if alike else 1.0
    gap = real_d / max(1, len(diff)) - real_a / max(1, len(alike))
    return {"real_divergences": real_d, "alike_probes": len(alike), "alike_real_divergences": real_a,
            "p_value": p, "template_changes_answers": (len(diff) >= TEMPLATE_MIN_PROBES and bool(alike) and p < ALPHA
                                         and gap >= TEMPLATE_DIVERGENCE_GAP)}


@pytest.mark.check("sanity.reference_agreement")
def test_reference_agreement(run, settings, engine, reference, probe_set, probe_outputs):
    """Greedy agreement with the reference, tie-aware (vLLM's ``check_logprobs_close`` rule:
    a first divergence where each side's token is in the other's top-5 logprobs is a numerical
    tie), and the accuracy difference decided by the paired McNemar exact test with the
    2-point tolerance (:mod:`bakeoff.analysis.paired`); a probe whose outputs diverged on a tie counts as
    agreeing. One probe never decides; the verdict line gives the difference, its 95% interval,
    p and the smallest drop the probe count can detect. When the reference answers too few probes
    for that test (a random-weight model), only an all-exact-or-tie comparison passes; otherwise
    the check skips (:func:`bakeoff.analysis.sanity.agreement_unjudgeable`). ``engine`` comes
    before ``reference``: a backend that did not load skips the check without a reference computed.

    Each side's chat probes are rendered with its own model's chat template
    (:class:`evaluations.reference.ProbeSet`); where the two renderings differ, values
    ``rendered_differently`` give both sides' accuracy on those probes beside ``chat_rendering``
    (the first differing prompt), and the template's effect is judged (:func:`template_effect`):
    chat probes rendered otherwise that diverge from the reference far more often than the probes
    rendered alike fail the check (``accuracy-regression``: the output disagrees with the
    reference), even when a few-shot chat form keeps the answers right."""
    with run.check("sanity.reference_agreement", "accuracy-regression") as c:
        if reference is None:
            c.skip("the backend under test is the transformers reference")
        if not probe_outputs:
            c.skip(f"no probe was sent: {probe_set.rendering.get('left_out_for_api') or 'the probe set is empty'}",
                   required=True)
        errors = [o for o in probe_outputs if o["status"] != "ok"]
        if errors:  # the backend's failure, whatever the reference did
            c.fail(f"{len(errors)}/{len(probe_outputs)} probe requests failed: {errors[0]['error']}",
                   errors[0].get("error_class") or "runtime-crash")
        if not reference.get("ok"):
            c.evidence("reference_error.txt", reference.get("error", "") + "\n\n" + reference.get("log_tail", ""))
            # what the run was to be compared with is missing: it cannot qualify (a broken --reference-model
            # left runs `qualified` on the fixture's builder record alone, issue 36)
            c.skip(f"the transformers reference could not run: {reference.get('error')}", required=True)
        ref_outs = reference["outputs"]
        c.values["reference_engine"] = reference.get("engine")  # its device, dtype (float32 on CPU) and options
        agr = agreement(probe_outputs, ref_outs)
        c.evidence("agreement.json", agr)
        mapped = sum(bool(o.get("token_ids_from")) for o in probe_outputs)
        if mapped:  # the engine streamed token texts: ids from the reference's tokenizer (evidence/sanity.outputs.json)
            c.values["token_ids_mapped_from_text"] = mapped
        ties = [r["outcome"] == "tie" for r in agr["rows"]]
        d = decide(_correct(ref_outs), _correct(probe_outputs), ties)
        c.values.update({"exact_match_rate": agr["exact_match_rate"], "exact": agr["exact"], "tie_divergences": agr["tie"],
                         "real_divergences": agr["real"], "undetermined_divergences": agr["undetermined"],
                         "tie_top_k": agr["tie_top_k"], "logprobs": agr["logprobs"],
                         "mean_first_divergence": agr["mean_first_divergence"],
                         "accuracy": round(d.candidate_accuracy, 4), "reference_accuracy": round(d.baseline_accuracy, 4),
                         "decision": d.as_values(), "chat_rendering": probe_set.rendering})
        counts = (f"{agr['exact']} exact, {agr['tie']} tie, {agr['real']} real"
                  + (f", {agr['undetermined']} undetermined ("
                     + "; ".join(f"{why}: {n}" for why, n in agr["undetermined_because"].items()) + ")"
                     if agr["undetermined"] else "")
                  + f" divergences of {agr['prompts']}")
        differing, rendered = probe_set.differing_ids(), ""
        if differing:  # the model under test's chat template renders these otherwise than the reference's
            pairs = [(b, r) for b, r, o in zip(_correct(probe_outputs), _correct(ref_outs), probe_outputs)
                     if o["id"] in differing]
            rd = {"probes": len(pairs), "accuracy": round(sum(b for b, _ in pairs) / len(pairs), 4),
                  "reference_accuracy": round(sum(r for _, r in pairs) / len(pairs), 4)}
            rd.update(template_effect(agr["rows"], differing))
            c.values["rendered_differently"] = rd
            rendered = (f"; {rd['probes']} chat probes rendered with the model under test's chat template, otherwise "
                        f"than with the reference's: {rd['accuracy']:.0%} correct against {rd['reference_accuracy']:.0%}, "
                        f"{rd['real_divergences']} diverge past the tie rule against {rd['alike_real_divergences']}/"
                        f"{rd['alike_probes']} rendered alike")
            c.require(not rd["template_changes_answers"],
                      f"the model under test's chat template changes what it answers: {rd['real_divergences']}/"
                      f"{rd['probes']} chat probes rendered with it diverge from the reference past the tie rule, "
                      f"against {rd['alike_real_divergences']}/{rd['alike_probes']} probes rendered alike (Fisher exact "
                      f"one-sided p={rd['p_value']:.2g}); first differing prompt in values.chat_rendering ({counts})"
                      f"{configuration(engine)}")
        c.require(not d.regression, f"{d.sentence('reference')} ({counts}){rendered}{configuration(engine)}")  # a proven drop fails even then
        unjudgeable = agreement_unjudgeable(agr, d.baseline_accuracy, MIN_BASELINE_ACCURACY)
        if unjudgeable:
            c.skip(f"{unjudgeable}; {counts}")
        c.summary = f"{counts}; within noise: {d.sentence('reference')}{rendered}"
