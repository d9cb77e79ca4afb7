"""Sanity: known answers, model-free degeneration detectors, agreement with the reference."""

from __future__ import annotations

import asyncio

import pytest

from bakeoff.loadgen.sweep import run_request
from bakeoff.sanity import agreement, detectors, probe_correct
from bakeoff.specs import GenerationRequest
from evaluations.plugin import attach_engine_evidence
from evaluations.probing import run_probes

# Known-answer thresholds: fixture probes are trained to >= 90% (fixture.json); generic probes
# are easy for any instruction-free LM but not all of them, so 3 of 5.
DEFAULT_MIN_ACCURACY = {"model": 0.8, "generic": 0.6}
# On a bakeoff fixture: at least 90% of what its builder measured (the untrained twin scores ~0).
FIXTURE_RATIO = 0.9
# MLPerf closed-division rule: a quantized / other-engine result must reach at least 99% of
# the reference's accuracy (mlcommons inference rules, "accuracy target 99% of FP32").
REFERENCE_ACCURACY_RATIO = 0.99
# Degeneration: fail when more than a quarter of the outputs trip a detector.
MAX_FLAGGED_FRACTION = 0.25
OPEN_ENDED_TOKENS = 48


@pytest.fixture(scope="module")
def probe_outputs(engine, probes, run):
    items, source = probes
    outs = run_probes(engine, items)
    run.dir.write_json("evidence/sanity.outputs.json", {"source": source, "outputs": outs})
    return outs


def _default_threshold(settings, source: str) -> float:
    """Known-answer threshold: for a bakeoff fixture, FIXTURE_RATIO of the accuracy its builder
    measured with transformers on the saved weights (``fixture.json``), so the bar follows the
    fixture actually built; otherwise the fixed default of the probe source."""
    import json
    from pathlib import Path

    meta = Path(settings.model.path) / "fixture.json" if settings.model.local else None
    if source == "model" and meta is not None and meta.is_file():
        built = (json.loads(meta.read_text()).get("probe_results") or {}).get("prefix_accuracy")
        if built:
            return round(FIXTURE_RATIO * built, 3)
    return DEFAULT_MIN_ACCURACY[source]


def _accuracy(outs: list[dict]) -> float:
    return sum(probe_correct(o["text"], o["expected"]) for o in outs) / len(outs) if outs else 0.0


@pytest.mark.check("sanity.known_answers")
def test_known_answers(run, settings, engine, probes, probe_outputs):
    items, source = probes
    with run.check("sanity.known_answers", "garbage-output") as c:
        errors = [o for o in probe_outputs if o["status"] != "ok"]
        rows = [{**o, "correct": probe_correct(o["text"], o["expected"])} for o in probe_outputs]
        c.evidence("probes.json", rows)
        acc = _accuracy(probe_outputs)
        threshold = settings.min_probe_accuracy if settings.min_probe_accuracy is not None else _default_threshold(settings, source)
        per_task: dict[str, list[bool]] = {}
        for r in rows:
            per_task.setdefault(r["task"], []).append(r["correct"])
        c.values.update({"probes": len(rows), "probe_source": source, "accuracy": round(acc, 4),
                         "threshold": threshold, "errors": len(errors),
                         "accuracy_by_task": {k: round(sum(v) / len(v), 3) for k, v in per_task.items()}})
        if errors:
            attach_engine_evidence(c, engine, errors[0].get("error_class"))
            c.fail(f"{len(errors)}/{len(rows)} probe requests failed: {errors[0]['error']}",
                   errors[0].get("error_class") or "runtime-crash")
        bad = [r for r in rows if not r["correct"]][:3]
        examples = "; ".join(f"{r['prompt']!r} -> {r['text'][:40]!r} (expected {r['expected']!r})" for r in bad)
        c.require(acc >= threshold, f"probe accuracy {acc:.0%} below {threshold:.0%} on {source} probes; e.g. {examples}")
        c.summary = f"probe accuracy {acc:.0%} ({len(rows)} {source} probes)"


@pytest.mark.check("sanity.degeneration")
def test_degeneration(run, engine, probes, probe_outputs):
    items, _ = probes
    with run.check("sanity.degeneration", "garbage-output") as c:
        async def open_ended():
            try:
                return [await run_request(engine, GenerationRequest(request_id=f"open-{i}", prompt=p.prompt,
                                                                    max_tokens=OPEN_ENDED_TOKENS))
                        for i, p in enumerate(items[:8])]
            finally:
                await engine.aclose()
        recs = asyncio.run(open_ended())
        rows = []
        for r in recs:
            d = detectors(r.output_text, r.output_token_ids, OPEN_ENDED_TOKENS, r.finish_reason)
            rows.append({"id": r.request_id, "text": r.output_text, "finish_reason": r.finish_reason,
                         "status": r.status, "error": r.error, **d})
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


@pytest.mark.check("sanity.reference_agreement")
def test_reference_agreement(run, settings, reference, probe_outputs):
    with run.check("sanity.reference_agreement", "accuracy-regression") as c:
        if reference is None:
            c.skip("the backend under test is the transformers reference")
        if not reference.get("ok"):
            c.evidence("reference_error.txt", reference.get("error", "") + "\n\n" + reference.get("log_tail", ""))
            c.skip(f"the transformers reference could not run: {reference.get('error')}")
        ref_outs = reference["outputs"]
        errors = [o for o in probe_outputs if o["status"] != "ok"]
        if errors:
            c.fail(f"{len(errors)}/{len(probe_outputs)} probe requests failed: {errors[0]['error']}",
                   errors[0].get("error_class") or "runtime-crash")
        agr = agreement(probe_outputs, ref_outs)
        c.evidence("agreement.json", agr)
        acc, ref_acc = _accuracy(probe_outputs), _accuracy(ref_outs)
        c.values.update({"exact_match_rate": agr["exact_match_rate"], "mean_first_divergence": agr["mean_first_divergence"],
                         "accuracy": round(acc, 4), "reference_accuracy": round(ref_acc, 4),
                         "required_ratio": REFERENCE_ACCURACY_RATIO})
        c.require(acc >= REFERENCE_ACCURACY_RATIO * ref_acc,
                  f"probe accuracy {acc:.1%} < {REFERENCE_ACCURACY_RATIO:.0%} of the reference's {ref_acc:.1%} "
                  f"(exact match {agr['exact_match_rate']:.0%})")
        c.summary = f"exact match {agr['exact_match_rate']:.0%}, accuracy {acc:.0%} vs reference {ref_acc:.0%}"
