"""Long-context needle retrieval at several lengths and depths.

A needle (one fact) sits at a depth (0 = start, 1 = end) of a haystack filling a fraction
of the context; the prompt ends by asking for it. Fixtures get the format of their training
corpus's key-value recall task (:func:`bakeoff.models.fixtures.corpus.needle_sample`): the haystack
is pairs of other keys. Other models get the generic haystack "The secret number is N" among
filler sentences.

Judgement: a bakeoff fixture records, in ``fixture.json``, the recall rate its builder measured
with transformers at these lengths and depths (``probe_results.needles``). When that rate is
at least ``MIN_RECORDED_RATE`` (the fixture can find needles), the backend fails
(``accuracy-regression``) when it finds significantly fewer: one-sided exact binomial test
against the recorded rate minus the 2-point tolerance, p < 0.01 (:mod:`bakeoff.analysis.paired`; with
9 needles, 6 or fewer found fail a 100% record: p(7 of 9 | 98%) = 0.013). Without such a record (other models, or a
fixture that cannot find needles) the check ends ``skip``, report only, with the table in its
values: a found/not-found table with nothing to compare it with verifies nothing.
Failing requests are a failed check in either case. A report-only quick run sends the grid's
diagonal (:func:`report_only_grid`), the full profile every cell.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from bakeoff.models.fixtures.corpus import NEEDLE_DEPTHS, NEEDLE_FRACTIONS, needle_sample
from bakeoff.analysis.paired import binomial_below
from bakeoff.analysis.sanity import probe_correct
from bakeoff.api.specs import GenerationRequest
from evaluations.measuring import GENERIC_FILLER, is_fixture, send
from evaluations.sizing import Budget, fit

ANSWER_TOKENS = 8
MIN_RECORDED_RATE = 0.6


def needle_prompt(n_units: int, depth: float, fixture: bool, seed: int) -> tuple[str, str]:
    """A haystack of ``n_units`` units with the needle at ``depth``.

    Returns:
        ``(prompt, expected)``; found when the output starts with ``expected`` (fixture) or
        contains it (generic).
    """
    rng = random.Random(seed)
    if fixture:
        s = needle_sample(rng, n_units, depth)
        return s.prompt, s.expected
    pos = round(depth * n_units)
    num = str(rng.randint(1000, 9999))
    units = [GENERIC_FILLER.strip()] * n_units
    units.insert(pos, f"The secret number is {num}.")
    return " ".join(units) + " What is the secret number? The secret number is", " " + num


def found(output: str, expected: str, fixture: bool) -> bool:
    return probe_correct(output, expected, "prefix" if fixture else "contains")


def recorded_rate(settings) -> dict | None:
    """The fixture builder's needle record (``fixture.json``), or None."""
    if not settings.model.local:
        return None
    try:
        meta = json.loads((Path(settings.model.path) / "fixture.json").read_text())
    except (OSError, ValueError):
        return None
    rec = (meta.get("probe_results") or {}).get("needles")
    return rec if isinstance(rec, dict) and rec.get("accuracy") is not None else None


def report_only_grid(fracs: list, depths: list) -> list[tuple[int, int]]:
    """The (length, depth) cells a report-only quick run sends: the grid's diagonal, every length
    and every depth once (3 prompts of 9). Nothing is judged without a record, and the long
    prompts cost the most: 9 of them took 93 s of a 16-minute qualification of the real model
    (issue 35); a request that fails at any length still fails the check."""
    return [(i, i * (len(depths) - 1) // max(1, len(fracs) - 1)) for i in range(len(fracs))]


@pytest.mark.check("needles.retrieval")
def test_needles(run, settings, engine, prompt_calibration):
    fixture = is_fixture(settings)
    record = recorded_rate(settings) if fixture else None
    with run.check("needles.retrieval", "runtime-crash") as c:
        max_len = (engine.info.max_model_len if engine.info else None) or 2048
        if record and record.get("context_tokens"):  # the lengths the fixture's builder measured
            max_len = min(max_len, int(record["context_tokens"]))
        per_unit, src = prompt_calibration.tokens_per_unit, prompt_calibration.source
        fracs = NEEDLE_FRACTIONS.get(settings.profile, NEEDLE_FRACTIONS["quick"])
        depths = NEEDLE_DEPTHS.get(settings.profile, NEEDLE_DEPTHS["quick"])
        # each needle prompt fills its fraction of a context no longer than the prefill budgets allow
        scale = fit(max_len, [f for f in fracs for _ in depths], prompt_calibration, Budget.of(settings),
                    "the fixture's needle context" if record else "max_model_len")
        c.values.update(scale.values())
        if scale.capped and record:  # the record was measured at the context's lengths: judge at those or not at all
            c.skip(f"not judged: {scale.why}, shorter than the lengths the fixture's builder recorded its needle recall "
                   f"at ({max_len:,}-token context); raise --prefill-budget / --check-prefill-budget to judge them")
        cases, reqs = [], []
        grid = report_only_grid(fracs, depths) if not record and settings.profile == "quick" else \
            [(fi, di) for fi in range(len(fracs)) for di in range(len(depths))]
        for fi, f in enumerate(fracs):
            n_units = max(4, int((f * scale.tokens - 12) / per_unit))
            for di, d in enumerate(depths):
                if (fi, di) not in grid:
                    continue
                prompt, expected = needle_prompt(n_units, d, fixture, seed=fi * 100 + di)
                cases.append({"fraction": f, "depth": d, "expected": expected})
                reqs.append(GenerationRequest(request_id=f"needle-{fi}-{di}", prompt=prompt, max_tokens=ANSWER_TOKENS,
                                              temperature=0.0))
        # one at a time: retrieval is judged, not throughput, and the prefill budget counts each prompt
        # alone (4 at once in an engine's static batch padded each to the longest: ORT GenAI int4 on
        # SmolLM2-135M took 103 s of a 60 s budget)
        recs = send(engine, reqs, concurrency=1)
        rows = []
        for case, r, q in zip(cases, recs, reqs):
            rows.append({**case, "prompt_tokens": r.input_tokens, "status": r.status, "error": r.error, "error_class": r.error_class,
                         "output": r.output_text, "found": r.status == "ok" and found(r.output_text, case["expected"], fixture),
                         "prompt_head": q.prompt[:80], "prompt_tail": q.prompt[-60:]})
        c.evidence("needles.json", rows)
        errs = [r for r in rows if r["status"] != "ok"]
        table = {f"{f:g}": {f"{r['depth']:g}": r["found"] for r in rows if r["fraction"] == f} for f in fracs}
        n_found = sum(r["found"] for r in rows)
        c.values.update({"format": "fixture kv recall" if fixture else "generic secret number",
                         "max_model_len": max_len, "token_calibration": src, "tokens_per_unit": round(per_unit, 3),
                         "fractions": fracs, "depths": depths, "found": n_found, "cases": len(rows),
                         "table": table,
                         "rows": [{k: r[k] for k in ("fraction", "depth", "prompt_tokens", "found", "output", "expected")}
                                  for r in rows]})
        if errs:
            c.evidence("engine.log.tail", engine.log_tail(150))
            c.fail(f"{len(errs)}/{len(rows)} needle requests failed: {errs[0]['error']}",
                   errs[0]["error_class"] or "runtime-crash")
        lens = sorted({r["prompt_tokens"] for r in rows if r["prompt_tokens"]})
        shape = f"x {len(depths)} depths" if len(rows) == len(fracs) * len(depths) else "(one depth each: the grid's diagonal)"
        where = (f"{n_found}/{len(rows)} needles found at {len(fracs)} lengths "
                 f"({lens[0] if lens else '?'}-{lens[-1] if lens else '?'} tokens) {shape}"
                 + (f" (lengths {scale.why})" if scale.capped else ""))
        if not record:
            c.skip(f"{where}; report only: {'no recorded recall rate to judge against' if not fixture else 'the fixture records no needle recall rate'}")
        rate = float(record["accuracy"])
        c.values.update({"recorded_rate": rate, "recorded_by": "the fixture builder (transformers, bf16)"})
        if rate < MIN_RECORDED_RATE:
            c.skip(f"{where}; report only: the fixture itself finds {rate:.0%} of needles at these lengths "
                   f"(< {MIN_RECORDED_RATE:.0%}), so a miss says nothing about the engine")
        below, p = binomial_below(n_found, len(rows), rate)
        c.values["p_value"] = float(f"{p:.4g}")
        c.require(not below, f"{where}, significantly fewer than the fixture's recorded {rate:.0%} (exact binomial "
                             f"p={p:.2g}); e.g. depth {next((r for r in rows if not r['found']), {}).get('depth')}",
                  "accuracy-regression")
        c.summary = f"{where}; the fixture's builder found {rate:.0%} (p={p:.2g}: not significantly fewer)"
