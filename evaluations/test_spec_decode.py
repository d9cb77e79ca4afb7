"""Speculative decoding: acceptance per fresh start and over the run, from the engine's counters.

Runs when the run configures speculative decoding (:meth:`backends.base.Backend.speculation`: vLLM's
``speculative_config``, llama.cpp's ``draft_gguf``) or when an attached server's counters show drafts;
otherwise a skip with that reason. The workload is greedy generation of ``MAX_TOKENS`` tokens (long
enough for drafts to happen) on prompts whose continuations repeat text from the prompt (fixture
copy/count tasks; a repeated list for other models), where an n-gram drafter can be right.

Counters (vLLM ``vllm/v1/spec_decode/metrics.py``; llama.cpp's server the same names under
``llamacpp:``), deltas over the workload: ``<engine>:spec_decode_num_drafts_total``,
``..._num_draft_tokens_total``, ``..._num_accepted_tokens_total``,
``..._num_accepted_tokens_per_pos_total{position="i"}``. Mean acceptance length = 1 + accepted /
drafts (vLLM's own definition: tokens emitted per verification step); per-position acceptance =
accepted at position i / drafts.

**Per fresh start** (openvino.genai #4425: 3 of 50 fresh pipelines accepted no draft): the workload
runs on ``--spec-starts`` starts of the engine (3 by default) (the run's own, then restarts; an attached server, which
bakeoff cannot restart, has one); each start is judged. **Over the run** (vLLM #41838: acceptance
decays over hours with prefix caching): the counters since the engine started, before the workload,
give the acceptance of every request the run sent with speculation on (probes, sweep, load replay,
prefix traffic, needles), reported beside the workload's.

Failure (``ineffective-option``): a start that drafted nothing, or accepted fewer than
``MIN_ACCEPTANCE_RATE`` of its drafted tokens: with nothing accepted every step emits one token, as
without speculation, while the drafting costs time. Where the draft model is the served model itself,
greedy drafts are the target's own tokens: a start accepting fewer than ``SELF_DRAFT_FLOOR`` of them
has broken speculation. Whether speculation changed the outputs: ``spec_decode.lossless``
(``evaluations/test_judge.py``, against the reference, with the engine stopped).
"""

from __future__ import annotations

import numpy as np
import pytest

from bakeoff.api.errors import EngineFailure
from bakeoff.api.specs import GenerationRequest
from evaluations.measuring import decode_tokens_per_s, is_fixture, read_metrics, send

SUFFIXES = {"drafts": "spec_decode_num_drafts_total", "draft_tokens": "spec_decode_num_draft_tokens_total",
            "accepted": "spec_decode_num_accepted_tokens_total", "per_pos": "spec_decode_num_accepted_tokens_per_pos_total"}
# "Near zero": fewer than 1 accepted token per 100 drafted.
MIN_ACCEPTANCE_RATE = 0.01
# The served model as its own draft: greedy drafts are the target's own choices, rejected only where the
# draft's single-token step and the target's verification batch round a near-tie apart.
SELF_DRAFT_FLOOR = 0.9
MAX_TOKENS = 64
REQUESTS = "requests.json"


def _prompts(fixture: bool, n: int) -> list[str]:
    if fixture:
        base = ["copy: abc dde fgh =>", "count: 20 21 22 23 =>", "copy: hgd hcd hjc =>", "count: 41 42 43 44 =>",
                "reverse: k m p =>", "copy: pa bo ci dd =>", "count: 7 8 9 10 =>", "copy: mn op mn op =>"]
    else:
        base = [("Repeat after me: " + " ".join(["red green blue yellow"] * 4) + ". Again: red green")] * 2 + [
            "Count from one to twenty: one, two, three, four, five,", "List the weekdays: Monday, Tuesday, Wednesday,"]
    return [base[i % len(base)] for i in range(n)]


def spec_counters(metrics: dict[str, float]) -> dict[str, float]:
    """The spec-decode counters of any engine's prefix (``vllm:``, ``llamacpp:``), keyed by their
    :data:`SUFFIXES` name (``per_pos{position="i"}`` per position)."""
    out: dict[str, float] = {}
    for key, value in metrics.items():
        name, _, labels = key.partition("{")
        for short, suffix in SUFFIXES.items():
            if name.endswith(":" + suffix) or name == suffix:
                out[short + ("{" + labels if labels else "")] = out.get(short + ("{" + labels if labels else ""), 0.0) + value
    return out


def acceptance(before: dict[str, float], after: dict[str, float]) -> dict:
    """The counters' change as figures: drafts, drafted and accepted tokens, the acceptance rate, the
    mean acceptance length (1 + accepted per draft) and each draft position's rate."""
    d = {k: after[k] - before.get(k, 0.0) for k in after}
    drafts, drafted, accepted = d.get("drafts", 0.0), d.get("draft_tokens", 0.0), d.get("accepted", 0.0)
    per_pos = {int(k.split('position="')[1].split('"')[0]): v for k, v in d.items()
               if k.startswith("per_pos") and 'position="' in k}
    return {"drafts": drafts, "draft_tokens": drafted, "accepted_tokens": accepted,
            "acceptance_rate": round(accepted / drafted, 4) if drafted else 0.0,
            "mean_acceptance_length": round(1 + accepted / drafts, 3) if drafts else None,
            "per_position_acceptance": {str(i): round(v / drafts, 4) if drafts else None for i, v in sorted(per_pos.items())}}


def configured(engine, metrics: dict[str, float]) -> dict | None:
    """The run's speculation (:meth:`backends.base.Backend.speculation`), else an attached server's that
    speculates (its per-position acceptance counters exist: vLLM registers its spec-decode counters only
    with a ``speculative_config``, llama-server the per-position ones only with a draft), else None."""
    spec = engine.speculation()
    if spec:
        return spec
    if engine.attaches and any(k.startswith("per_pos") for k in spec_counters(metrics)):
        return {"method": "the server's own (its per-position acceptance counters)", "draft": None, "self_draft": False}
    return None


def _workload(engine, settings, start: int) -> list[dict]:
    """One start's workload: the prompts one at a time (acceptance and single-stream decode speed)."""
    reqs = [GenerationRequest(request_id=f"spec-{start}-{i}", prompt=p, max_tokens=MAX_TOKENS, temperature=0.0,
                              ignore_eos=True) for i, p in enumerate(_prompts(is_fixture(settings), 8))]
    return [{"start": start, "id": q.request_id, "prompt": q.prompt, "text": r.output_text, "token_ids": r.output_token_ids,
             "status": r.status, "error": r.error, "error_class": r.error_class, "output_tokens": r.output_tokens,
             "decode_tokens_per_s": decode_tokens_per_s(r), "max_tokens": MAX_TOKENS, "ignore_eos": True}
            for q, r in zip(reqs, send(engine, reqs))]


def _restart(c, engine, k: int) -> None:
    """A fresh start of the engine; its failure is the check's (the engine's class and log)."""
    try:
        engine.stop()
        engine.start()
    except EngineFailure as exc:
        c.evidence("engine.log.tail", engine.log_tail(150))
        c.fail(f"restart {k} for a fresh measurement failed: {exc.failure_class}: {exc.message}", exc.failure_class)


def _judge_start(c, spec: dict, fig: dict, start: int, starts: int, n: int) -> None:
    """A start that drafted nothing, accepted near nothing, or (a self-draft) less than its floor fails."""
    where = f"start {start} of {starts}"
    c.require(fig["drafts"] > 0, f"speculative decoding configured ({spec['method']}) but the engine made no drafts "
                                 f"over {n} requests at {where}")
    c.require(fig["acceptance_rate"] >= MIN_ACCEPTANCE_RATE,
              f"{fig['accepted_tokens']:.0f}/{fig['draft_tokens']:.0f} drafted tokens accepted at {where} "
              f"({fig['acceptance_rate']:.1%}): no speed-up is possible")
    if spec.get("self_draft"):
        c.require(fig["acceptance_rate"] >= SELF_DRAFT_FLOOR,
                  f"the draft model is the served model itself, yet {fig['accepted_tokens']:.0f}/"
                  f"{fig['draft_tokens']:.0f} drafted tokens were accepted at {where} ({fig['acceptance_rate']:.1%} "
                  f"< {SELF_DRAFT_FLOOR:.0%}): greedy drafts of the same model must be the target's own tokens")


def _one_start(c, run, engine, settings, k: int) -> tuple[list[dict], dict]:
    """Start ``k``'s workload and its counters' change; a failed request fails the check, an engine without
    counters skips it."""
    before = spec_counters(read_metrics(engine))
    got = _workload(engine, settings, k)
    errs = [r for r in got if r["status"] != "ok"]
    if errs:
        c.evidence("engine.log.tail", engine.log_tail(150))
        c.evidence(f"requests_start_{k}.json", got)
        c.fail(f"{len(errs)}/{len(got)} requests failed at start {k}: {errs[0]['error']}",
               errs[0]["error_class"] or "runtime-crash")
    after = spec_counters(read_metrics(engine))
    if "drafts" not in after:
        tps = [r["decode_tokens_per_s"] for r in got if r["decode_tokens_per_s"]]
        c.skip(f"speculative decoding configured, but {run.verdict.backend} exposes no spec-decode counters; "
               f"single-stream decode {round(float(np.median(tps)), 1) if tps else None} tok/s "
               "(compare with the run without it)")
    return got, {"start": k, **acceptance(before, after)}


def _pooled(per_start: list[dict], rows: list[dict]) -> dict:
    """Every start's figures pooled (drafts, tokens, rates; per position the mean of the starts'), with the
    median single-stream decode rate."""
    pooled = acceptance({}, {k: sum(s[f] for s in per_start) for k, f in
                             (("drafts", "drafts"), ("draft_tokens", "draft_tokens"), ("accepted", "accepted_tokens"))})
    pos = {p for s in per_start for p in s["per_position_acceptance"]}
    pooled["per_position_acceptance"] = {p: round(float(np.mean([s["per_position_acceptance"].get(p) or 0.0
                                                                 for s in per_start])), 4) for p in sorted(pos)}
    tps = [r["decode_tokens_per_s"] for r in rows if r["decode_tokens_per_s"]]
    return {**pooled, "decode_tokens_per_s_median": round(float(np.median(tps)), 1) if tps else None,
            "fresh_starts": len(per_start)}


@pytest.mark.check("spec_decode.acceptance")
def test_acceptance(run, settings, engine):
    with run.check("spec_decode.acceptance", "ineffective-option") as c:
        at_start = read_metrics(engine)
        spec = configured(engine, at_start)
        if not spec:
            c.skip("speculative decoding is not configured for this run (set --backend-opt speculative_config=... "
                   "or --matrix speculative=ngram; llamacpp: --backend-opt draft_gguf=FILE|self)")
        c.values.update({"speculative_config": run.verdict.options.get("speculative_config") or spec,
                         "self_draft": spec.get("self_draft"), "threshold_acceptance_rate": MIN_ACCEPTANCE_RATE,
                         "self_draft_floor": SELF_DRAFT_FLOOR if spec.get("self_draft") else None,
                         "run_before_workload": acceptance({}, spec_counters(at_start))})  # since the engine started
        starts = 1 if engine.attaches else settings.spec_starts
        rows, per_start = [], []
        for k in range(1, starts + 1):
            if k > 1:
                _restart(c, engine, k)
            got, fig = _one_start(c, run, engine, settings, k)
            rows += got
            per_start.append(fig)
            c.evidence(REQUESTS, rows)
            c.values["starts"] = per_start
        pooled = _pooled(per_start, rows)
        c.values.update(pooled)
        for s in per_start:
            _judge_start(c, spec, s, s["start"], len(per_start), len(rows) // len(per_start))
        run_rate = c.values["run_before_workload"]["acceptance_rate"]
        c.summary = (f"mean acceptance length {pooled['mean_acceptance_length']} ({pooled['acceptance_rate']:.0%} of "
                     f"{pooled['draft_tokens']:.0f} drafted tokens accepted) over {len(per_start)} fresh start(s): "
                     + ", ".join(f"{s['acceptance_rate']:.0%}" for s in per_start)
                     + f"; the run's requests before it {run_rate:.0%}; per position "
                     + ", ".join(f"{k}: {v:.0%}" for k, v in pooled["per_position_acceptance"].items() if v is not None))
