"""Long-context needle retrieval at several lengths and depths.

A needle (one fact) sits at a depth (0 = start, 1 = end) of a haystack filling a fraction
of the engine's context; the prompt ends by asking for it. Fixtures get the format of their
training corpus's key-value recall task (``keys: a=5 q=7 z=2 ; q ->`` -> `` 7``, see
bakeoff/fixtures/corpus.py): the haystack is pairs of other keys, the needle ``q=7``. Other
models get the generic haystack "The secret number is N" among filler sentences.

Status: report only (pass with the found/not-found table), failing only on request errors.
Why: the fixture was trained on 64-token sequences, so its recall over 500-2,000 tokens is
weak by construction and says nothing about the engine; a backend-caused loss shows as a
difference against another backend in the same table (``bakeoff compare`` puts the heat
maps side by side), and the sanity checks already judge output quality against the
reference. Judging needles against the reference here would need the reference engine to
run these prompts too, which this check does not do.
"""

from __future__ import annotations

import random

import pytest

from bakeoff.specs import GenerationRequest
from evaluations.measuring import GENERIC_FILLER, KV_KEYS, filler_units, is_fixture, send, serves_one_at_a_time, tokens_per_unit

FRACTIONS = {"quick": [0.25, 0.5, 0.9], "full": [0.1, 0.25, 0.5, 0.75, 0.9]}
DEPTHS = {"quick": [0.0, 0.5, 1.0], "full": [0.0, 0.25, 0.5, 0.75, 1.0]}
ANSWER_TOKENS = 8


def needle_prompt(n_units: int, depth: float, fixture: bool, seed: int) -> tuple[str, str]:
    """A haystack of ``n_units`` units with the needle at ``depth``.

    Returns:
        ``(prompt, expected)``; found when ``expected.strip()`` starts the output (fixture) or
        appears in it (generic).
    """
    rng = random.Random(seed)
    pos = round(depth * n_units)
    if fixture:
        key, val = rng.choice(KV_KEYS), str(rng.randint(0, 9))
        units = filler_units(n_units, True, seed, exclude=key)
        units.insert(pos, f"{key}={val}")
        return "keys: " + " ".join(units) + f" ; {key} ->", " " + val
    num = str(rng.randint(1000, 9999))
    units = [GENERIC_FILLER.strip()] * n_units
    units.insert(pos, f"The secret number is {num}.")
    return " ".join(units) + " What is the secret number? The secret number is", " " + num


def found(output: str, expected: str, fixture: bool) -> bool:
    return output.strip().startswith(expected.strip()) if fixture else expected.strip() in output


@pytest.mark.check("needles.retrieval")
def test_needles(run, settings, engine):
    fixture = is_fixture(settings)
    with run.check("needles.retrieval", "runtime-crash") as c:
        max_len = (engine.info.max_model_len if engine.info else None) or 2048
        per_unit, src = tokens_per_unit(engine, fixture)
        fracs, depths = FRACTIONS.get(settings.profile, FRACTIONS["quick"]), DEPTHS.get(settings.profile, DEPTHS["quick"])
        cases, reqs = [], []
        for fi, f in enumerate(fracs):
            n_units = max(4, int((f * max_len - 12) / per_unit))
            for di, d in enumerate(depths):
                prompt, expected = needle_prompt(n_units, d, fixture, seed=fi * 100 + di)
                cases.append({"fraction": f, "depth": d, "expected": expected})
                reqs.append(GenerationRequest(request_id=f"needle-{fi}-{di}", prompt=prompt, max_tokens=ANSWER_TOKENS,
                                              temperature=0.0))
        recs = send(engine, reqs, concurrency=1 if serves_one_at_a_time(engine) else 4)
        rows = []
        for case, r, q in zip(cases, recs, reqs):
            rows.append({**case, "prompt_tokens": r.input_tokens, "status": r.status, "error": r.error,
                         "output": r.output_text, "found": r.status == "ok" and found(r.output_text, case["expected"], fixture),
                         "prompt_head": q.prompt[:80], "prompt_tail": q.prompt[-60:]})
        c.evidence("needles.json", rows)
        errs = [r for r in rows if r["status"] != "ok"]
        table = {f"{f:g}": {f"{d:g}": next(r["found"] for r in rows if r["fraction"] == f and r["depth"] == d)
                            for d in depths} for f in fracs}
        n_found = sum(r["found"] for r in rows)
        c.values.update({"format": "fixture kv recall" if fixture else "generic secret number",
                         "max_model_len": max_len, "token_calibration": src, "tokens_per_unit": round(per_unit, 3),
                         "fractions": fracs, "depths": depths, "found": n_found, "cases": len(rows),
                         "table": table, "judgement": "report only (see module docstring)",
                         "rows": [{k: r[k] for k in ("fraction", "depth", "prompt_tokens", "found", "output", "expected")}
                                  for r in rows]})
        if errs:
            c.evidence("engine.log.tail", engine.log_tail(150))
            c.fail(f"{len(errs)}/{len(rows)} needle requests failed: {errs[0]['error']}")
        lens = sorted({r["prompt_tokens"] for r in rows if r["prompt_tokens"]})
        c.summary = (f"{n_found}/{len(rows)} needles found at {len(fracs)} lengths "
                     f"({lens[0] if lens else '?'}-{lens[-1] if lens else '?'} tokens) x {len(depths)} depths; report only")
