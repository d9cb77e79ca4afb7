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


def needle_context(engine, record: dict | None) -> int:
    """The context the needles fill: the engine's ``max_model_len`` (2048 unknown), no longer than the
    context the fixture's builder recorded its needle recall at."""
    max_len = (engine.info.max_model_len if engine.info else None) or 2048
    if record and record.get("context_tokens"):  # the lengths the fixture's builder measured
        max_len = min(max_len, int(record["context_tokens"]))
    return max_len


def needle_grid(fracs: list, depths: list, record: dict | None, profile: str) -> list[tuple[int, int]]:
    """The (length, depth) cells to send: the diagonal in a report-only quick run, else every cell."""
    if not record and profile == "quick":
        return report_only_grid(fracs, depths)
    return [(fi, di) for fi in range(len(fracs)) for di in range(len(depths))]


def needle_requests(fracs: list, depths: list, grid: list, n_tokens: int, per_unit: float,
                    fixture: bool) -> tuple[list[dict], list[GenerationRequest]]:
    """One needle prompt per (length, depth) cell of ``grid``: the cases and their greedy requests."""
    cases, reqs = [], []
    for fi, f in enumerate(fracs):
        n_units = max(4, int((f * n_tokens - 12) / per_unit))
        for di, d in enumerate(depths):
            if (fi, di) not in grid:
                continue
            prompt, expected = needle_prompt(n_units, d, fixture, seed=fi * 100 + di)
            cases.append({"fraction": f, "depth": d, "expected": expected})
            reqs.append(GenerationRequest(request_id=f"needle-{fi}-{di}", prompt=prompt, max_tokens=ANSWER_TOKENS,
                                          temperature=0.0))
    return cases, reqs


def needle_rows(cases: list[dict], recs: list, reqs: list[GenerationRequest], fixture: bool) -> list[dict]:
    """Each needle's outcome: its case, the request's status and output, and whether it was found."""
    rows = []
    for case, r, q in zip(cases, recs, reqs):
        rows.append({**case, "prompt_tokens": r.input_tokens, "status": r.status, "error": r.error, "error_class": r.error_class,
                     "output": r.output_text, "found": r.status == "ok" and found(r.output_text, case["expected"], fixture),
                     "prompt_head": q.prompt[:80], "prompt_tail": q.prompt[-60:]})
    return rows


def needle_tables(rows: list[dict], fracs: list) -> dict:
    """The check's ``table`` (found per length and depth) and its ``rows`` (each needle's outcome)."""
    table = {f"{f:g}": {f"{r['depth']:g}": r["found"] for r in rows if r["fraction"] == f} for f in fracs}
    return {"table": table,
            "rows": [{k: r[k] for k in ("fraction", "depth", "prompt_tokens", "found", "output", "expected")}
                     for r in rows]}


def needle_where(rows: list[dict], fracs: list, depths: list, n_found: int, scale) -> str:
    """The summary's words for what was found: needles found, at which prompt lengths, over which grid."""
    lens = sorted({r["prompt_tokens"] for r in rows if r["prompt_tokens"]})
    shape = f"x {len(depths)} depths" if len(rows) == len(fracs) * len(depths) else "(one depth each: the grid's diagonal)"
    return (f"{n_found}/{len(rows)} needles found at {len(fracs)} lengths "
            f"({lens[0] if lens else '?'}-{lens[-1] if lens else '?'} tokens) {shape}"
            + (f" (lengths {scale.why})" if scale.capped else ""))


def judge_recall(c, record: dict | None, fixture: bool, rows: list[dict], n_found: int, where: str) -> None:
    """Judge the recall against the fixture's recorded rate (exact binomial test), or skip as report only."""
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


@pytest.mark.check("needles.retrieval")
def test_needles(run, settings, engine, prompt_calibration):
    fixture = is_fixture(settings)
    record = recorded_rate(settings) if fixture else None
    with run.check("needles.retrieval", "runtime-crash") as c:
        max_len = needle_context(engine, record)
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
        grid = needle_grid(fracs, depths, record, settings.profile)
        cases, reqs = needle_requests(fracs, depths, grid, scale.tokens, per_unit, fixture)
        # one at a time: retrieval is judged, not throughput, and the prefill budget counts each prompt
        # alone (4 at once in an engine's static batch padded each to the longest: ORT GenAI int4 on
        # SmolLM2-135M took 103 s of a 60 s budget)
        recs = send(engine, reqs, concurrency=1)
        rows = needle_rows(cases, recs, reqs, fixture)
        c.evidence("needles.json", rows)
        errs = [r for r in rows if r["status"] != "ok"]
        n_found = sum(r["found"] for r in rows)
        c.values.update({"format": "fixture kv recall" if fixture else "generic secret number",
                         "max_model_len": max_len, "token_calibration": src, "tokens_per_unit": round(per_unit, 3),
                         "fractions": fracs, "depths": depths, "found": n_found, "cases": len(rows),
                         **needle_tables(rows, fracs)})
        if errs:
            c.evidence("engine.log.tail", engine.log_tail(150))
            c.fail(f"{len(errs)}/{len(rows)} needle requests failed: {errs[0]['error']}",
                   errs[0]["error_class"] or "runtime-crash")
        judge_recall(c, record, fixture, rows, n_found, needle_where(rows, fracs, depths, n_found, scale))
