"""Speculative decoding: acceptance length and per-position acceptance from the engine's counters.

Runs only when the run's options configure speculative decoding (``speculative_config``);
otherwise it is a skip with that reason. The workload is greedy generation on prompts whose
continuations repeat text from the prompt (fixture copy/count tasks; a repeated list for
other models), where an n-gram drafter can be right.

Counters (vLLM, ``vllm/v1/spec_decode/metrics.py``), deltas over the workload:
``vllm:spec_decode_num_drafts_total``, ``..._num_draft_tokens_total``,
``..._num_accepted_tokens_total``, ``..._num_accepted_tokens_per_pos_total{position="i"}``.
Mean acceptance length = 1 + accepted / drafts (vLLM's own definition: tokens emitted per
verification step); per-position acceptance = accepted at position i / drafts.

Failure: acceptance near zero (< ``MIN_ACCEPTANCE_RATE`` of drafted tokens accepted, or no
drafts at all) is ``ineffective-option``: with nothing accepted every step emits one token,
exactly as without speculation, so no speed-up is possible while the drafting costs time.
The speed-up itself is measured by comparing the run with its matrix twin without
speculation (``bakeoff compare``).
"""

from __future__ import annotations

import pytest

from bakeoff.api.specs import GenerationRequest
from evaluations.measuring import decode_tokens_per_s, delta, is_fixture, read_metrics, send

PREFIX = "vllm:spec_decode"
DRAFTS = f"{PREFIX}_num_drafts_total"
DRAFT_TOKENS = f"{PREFIX}_num_draft_tokens_total"
ACCEPTED = f"{PREFIX}_num_accepted_tokens_total"
PER_POS = f"{PREFIX}_num_accepted_tokens_per_pos_total"
# "Near zero": fewer than 1 accepted token per 100 drafted.
MIN_ACCEPTANCE_RATE = 0.01
MAX_TOKENS = 64


def _prompts(fixture: bool, n: int) -> list[str]:
    if fixture:
        base = ["copy: abc dde fgh =>", "count: 20 21 22 23 =>", "copy: hgd hcd hjc =>", "count: 41 42 43 44 =>",
                "reverse: k m p =>", "copy: pa bo ci dd =>", "count: 7 8 9 10 =>", "copy: mn op mn op =>"]
    else:
        base = [("Repeat after me: " + " ".join(["red green blue yellow"] * 4) + ". Again: red green")] * 2 + [
            "Count from one to twenty: one, two, three, four, five,", "List the weekdays: Monday, Tuesday, Wednesday,"]
    return [base[i % len(base)] for i in range(n)]


def _acceptance_values(d: dict[str, float], drafts: float, drafted: float, accepted: float, rate: float) -> dict:
    """The check's figures from the counters' change ``d``: drafts, drafted and accepted tokens, the
    acceptance rate, the mean acceptance length (1 + accepted per draft) and each draft position's rate."""
    per_pos = {int(k.split('position="')[1].split('"')[0]): v for k, v in d.items()
               if k.startswith(PER_POS) and 'position="' in k}
    return {"drafts": drafts, "draft_tokens": drafted, "accepted_tokens": accepted, "acceptance_rate": round(rate, 4),
            "mean_acceptance_length": round(1 + accepted / drafts, 3) if drafts else None,
            "per_position_acceptance": {str(i): round(v / drafts, 4) if drafts else None for i, v in sorted(per_pos.items())},
            "threshold_acceptance_rate": MIN_ACCEPTANCE_RATE}


@pytest.mark.check("spec_decode.acceptance")
def test_acceptance(run, settings, engine):
    with run.check("spec_decode.acceptance", "ineffective-option") as c:
        spec = run.verdict.options.get("speculative_config")
        if not spec:
            c.skip("speculative decoding is not configured for this run (set --backend-opt speculative_config=... "
                   "or --matrix speculative=ngram)")
        c.values["speculative_config"] = spec
        before = read_metrics(engine)
        prompts = _prompts(is_fixture(settings), 8)
        reqs = [GenerationRequest(request_id=f"spec-{i}", prompt=p, max_tokens=MAX_TOKENS, temperature=0.0,
                                  ignore_eos=True) for i, p in enumerate(prompts)]
        recs = send(engine, reqs)  # one stream at a time: acceptance and single-stream decode speed
        after = read_metrics(engine)
        d = delta(before, after, PREFIX)
        rows = [{"prompt": q.prompt, "output": r.output_text, "status": r.status, "error": r.error, "error_class": r.error_class,
                 "output_tokens": r.output_tokens, "decode_tokens_per_s": decode_tokens_per_s(r)} for q, r in zip(reqs, recs)]
        c.evidence("requests.json", rows)
        c.evidence("counters.json", {"before": {k: v for k, v in before.items() if k.startswith(PREFIX)},
                                     "after": {k: v for k, v in after.items() if k.startswith(PREFIX)}, "delta": d})
        errs = [r for r in rows if r["status"] != "ok"]
        if errs:
            c.evidence("engine.log.tail", engine.log_tail(150))
            c.fail(f"{len(errs)}/{len(rows)} requests failed: {errs[0]['error']}", errs[0]["error_class"] or "runtime-crash")
        import numpy as np

        tps = [r["decode_tokens_per_s"] for r in rows if r["decode_tokens_per_s"]]
        c.values["decode_tokens_per_s_median"] = round(float(np.median(tps)), 1) if tps else None
        if DRAFTS not in after:
            c.skip(f"speculative decoding configured, but {run.verdict.backend} exposes no spec-decode counters; "
                   f"single-stream decode {c.values['decode_tokens_per_s_median']} tok/s (compare with the run without it)")
        drafts, drafted, accepted = d.get(DRAFTS, 0.0), d.get(DRAFT_TOKENS, 0.0), d.get(ACCEPTED, 0.0)
        rate = accepted / drafted if drafted else 0.0
        c.values.update(_acceptance_values(d, drafts, drafted, accepted, rate))
        c.require(drafts > 0, f"speculative decoding configured ({spec.get('method')}) but the engine made no drafts "
                              f"over {len(rows)} requests")
        c.require(rate >= MIN_ACCEPTANCE_RATE, f"{accepted:.0f}/{drafted:.0f} drafted tokens accepted ({rate:.1%}): "
                                               f"no speed-up is possible")
        c.summary = (f"mean acceptance length {c.values['mean_acceptance_length']} "
                     f"({rate:.0%} of {drafted:.0f} drafted tokens accepted); per position "
                     + ", ".join(f"{k}: {v:.0%}" for k, v in c.values["per_position_acceptance"].items() if v is not None))
