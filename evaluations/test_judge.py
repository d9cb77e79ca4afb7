"""The model-based garbage judge: the reference scores the backend's outputs (``bakeoff.analysis.judge``).

- ``sanity.nll_judge``: the reference model's teacher-forced mean NLL per token of the
  backend's open-ended outputs (``sanity.degeneration``'s, read from the run directory) beside
  that of the reference's own greedy outputs on the same prompts; more than
  ``NLL_GAP_NATS`` above is ``garbage-output``. It also reports, over the probe outputs that
  came with top-k logprobs, the mean KL divergence from the reference and the top-1
  agreement (report only).

- ``served.nll_judge``: the same judge on what the engine served under load: the throughput sweep's
  outputs at its highest point and the load of ``served.under_load``'s replay (at most
  ``SERVED_JUDGED``, cut at their first end-of-sequence token: the sweep asks ``ignore_eos``) against
  the reference's own greedy outputs of the same prompts; more than ``NLL_GAP_NATS`` above is
  ``garbage-output`` naming the sessions in flight. A configuration that repeats or mangles tokens
  under load (and reads faster for it) is caught here even where no logprobs tell ties apart.
- ``spec_decode.lossless``: speculative decoding must not change greedy outputs. The outputs of
  ``spec_decode.acceptance`` (every fresh start, 64 tokens each, cut at end-of-sequence) against the
  reference's greedy outputs of the same prompts, by the served rule (:mod:`bakeoff.analysis.served`:
  the one-sided tie rule on the reference's teacher-forced top-k, real divergences by an exact
  binomial test); ``accuracy-regression`` naming the first difference.

Runs last: the engine under test is stopped first, so the reference and the engine never
hold the device at once; one reference serves the module's checks (:class:`Judge`). It reads what the sanity checks wrote, so it also judges a resumed
run, and a run whose engine died after its sanity checks. The reference's answers are kept on
disk (:mod:`evaluations.judging`): it starts only for a question no earlier run asked.
"""

from __future__ import annotations

import json
import math

import pytest

import backends
from bakeoff.api.errors import EngineFailure
from bakeoff.host.run import CheckSkipped
from bakeoff.analysis.judge import NLL_GAP_NATS, divergence, nll_verdict, pooled_nll
from bakeoff.analysis.sanity import PROBE_LOGPROBS
from bakeoff.api.specs import GenerationRequest
from evaluations.judging import ReferenceAnswers
from evaluations.measuring import send
from evaluations.reference import _model_stamp, is_reference_run, reference_config
from evaluations.tokenizing import reference_tokenizer
from evaluations.test_sanity import OPEN_ENDED_TOKENS, as_served
from evaluations.test_spec_decode import MAX_TOKENS as SPEC_MAX_TOKENS
from evaluations.test_throughput import OUTPUTS
from bakeoff.analysis.sanity import TIE_TOP_K
from bakeoff.analysis.served import answer_span, compare_served, counts, eos_ids, first_difference, judge_real
from evaluations.session import KEY_ENGINE


def _score(base_url: str, prompt: str, ids: list[int] | None, text: str, top_k: int = 0) -> dict:
    import httpx

    body = {"prompt": prompt, "top_k": top_k, "drop_trailing_eos": True}  # both sides scored alike, EOS or not
    body.update({"continuation_ids": ids} if ids else {"continuation": text})
    r = httpx.post(base_url + "/v1/score", json=body, timeout=300.0)
    r.raise_for_status()
    return r.json()


def _read(run, rel: str):
    path = run.dir.path / rel
    try:
        return json.loads(path.read_text()) if path.is_file() else None
    except (OSError, ValueError):
        return None


def _generate(scorer, prompts: list[tuple[str, str, int]]) -> list[dict]:
    # all at once: the reference's static batches generate them together (one at a time, SmolLM2-135M's
    # 8 x 48 tokens took 21.8 s of the first judge's 40 s on 2 cores, 2026-12-05); left padding moves
    # float32 logits by rounding only, as for the reference's probes
    recs = send(scorer, [GenerationRequest(request_id=f"judge-{i}", prompt=p, max_tokens=n) for i, p, n in prompts],
                concurrency=max(1, len(prompts)))
    return [{"status": r.status, "output_token_ids": r.output_token_ids, "output_text": r.output_text} for r in recs]


def _judge(ref: ReferenceAnswers, opened: list[dict], probe_outs: list[dict]) -> tuple[list, list, list, list]:
    """The reference's greedy outputs on the open-ended prompts, teacher-forced scores of both
    sides' outputs, and its top-k on the backend's probe outputs: ``(table, backend logprobs,
    reference logprobs, [(reference tops, backend logprobs)] per probe)``."""
    refs = ref.generate([(str(i), r["prompt"], OPEN_ENDED_TOKENS) for i, r in enumerate(opened)])
    table, backend_lps, reference_lps = [], [], []
    for r, own_out in zip(opened, refs):
        mine = ref.score(r["prompt"], r.get("token_ids"), r.get("text", ""))
        own = (ref.score(r["prompt"], own_out["output_token_ids"], own_out["output_text"])
               if own_out["status"] == "ok" else None)
        backend_lps.append(mine["logprobs"])
        reference_lps.append(own["logprobs"] if own else [])
        b_nll, b_n = pooled_nll([mine["logprobs"]])
        r_nll, r_n = pooled_nll([own["logprobs"]] if own else [])
        table.append({"prompt": r["prompt"], "backend_output": r.get("text"), "reference_output": own_out["output_text"],
                      "backend_nll_per_token": None if b_nll is None else round(b_nll, 4), "backend_tokens": b_n,
                      "reference_nll_per_token": None if r_nll is None else round(r_nll, 4), "reference_tokens": r_n})
    kl_rows = []
    for o in kl_sample(probe_outs):
        sc = ref.score(o["prompt"], o["token_ids"], o["text"], top_k=PROBE_LOGPROBS)
        kl_rows.append((sc["top_logprobs"], o["logprobs"][:len(o["token_ids"])]))
    return table, backend_lps, reference_lps, kl_rows


# KL divergence and top-1 agreement are reported, not judged: a spread sample of the probe outputs
# gives the mean within noise, and each one scored is a teacher-forced pass of the reference (300 of
# them one by one were 99 s of a SmolLM2-135M run on 2 cores, most of the judge's time; 64 were still
# about 35 s of the first engine's judge, 2026-12-05). 32 outputs are several hundred token positions.
KL_PROBES = 32


def kl_sample(outs: list[dict], n: int = KL_PROBES) -> list[dict]:
    """At most ``n`` outputs, spread evenly over the list (every family of probes, deterministic)."""
    if len(outs) <= n:
        return list(outs)
    return [outs[i * len(outs) // n] for i in range(n)]


def _divergence_line(div: dict) -> str:
    """The summary's words for :func:`bakeoff.analysis.judge.divergence`: KL as a number only
    where it was measured, "not measurable" (with the reason) otherwise."""
    if not div["positions"]:
        return "; no logprobs for top-1 agreement or KL"
    line = f"; top-1 agreement {div['top1_agreement']:.1%} over {div['positions']} probe positions"
    if div["mean_kl_nats"] is None:
        return line + f"; KL not measurable: {div['kl_not_measurable']}"
    short = f" ({div['kl_short_positions']} without top-{PROBE_LOGPROBS} left out)" if div["kl_short_positions"] else ""
    return line + f", mean KL {div['mean_kl_nats']} nats over {div['kl_positions']}{short}"


def _is_open(r: dict) -> bool:
    """Whether a ``sanity.degeneration`` row is one of the open-ended prompts."""
    return str(r.get("id", "")).startswith("open-")


def _open_ended(c, rows: list[dict]) -> list[dict]:
    """The open-ended outputs the judge can score (ok, with a known prompt and an output); skip when none."""
    # a prompt None: sent to a chat API whose rendering is not known here (evaluations/test_sanity.py as_served)
    opened = [r for r in rows if _is_open(r) and r.get("status") == "ok"
              and r.get("prompt") is not None and (r.get("text") or r.get("token_ids"))]
    if not opened:
        c.skip("the open-ended prompts went to a chat API and the model has no chat template here to score "
               "its outputs under" if any(r.get("prompt") is None for r in rows if _is_open(r))
               else "the backend produced no open-ended output to judge")
    return opened


def _probe_outputs(run) -> list[dict]:
    """The backend's probe outputs (``sanity.outputs.json``) that came with logprobs and token ids."""
    return [o for o in ((_read(run, "evidence/sanity.outputs.json") or {}).get("outputs") or [])
            if o.get("status") == "ok" and o.get("logprobs") and o.get("token_ids")]


class JudgeUnavailable(Exception):
    """The reference could not start to judge (its failure class and message)."""


class Judge:
    """The reference as the module's judge: the engine under test stopped first (its device freed), one
    reference started on the first question no earlier run answered (:class:`ReferenceAnswers`), stopped
    when the module ends.

    Attributes:
        why_not: why nothing can be judged (the reference under test, a backend that did not load), or None.
        engine: the stopped backend under test (its API and chat rendering still answer).
    """

    def __init__(self, settings, run, state: dict):
        self.settings, self.run, self.scorer, self.ref = settings, run, None, None
        self.engine = state.get("backend")
        self.why_not = ("the backend under test is the transformers reference" if is_reference_run(settings) else
                        f"backend did not load ({state['error']})" if "error" in state else None)
        if self.why_not:
            return
        if self.engine is not None:  # the engine is done: free its device for the judge
            self.engine.stop()
            state["stopped"] = "the judge stopped the engine to free its device (the judge's checks run last)"
        config = reference_config(settings, run.dir.path / "engine" / "judge", scoring=True)
        self.scorer = backends.resolve("transformers")(config)
        self.ref = ReferenceAnswers([settings.reference_model.path, _model_stamp(settings.reference_model), config.options],
                                    self._start, _score, _generate)

    def _start(self):
        try:
            self.scorer.start()
        except EngineFailure as exc:
            raise JudgeUnavailable(f"{exc.failure_class}: {exc.message}") from None
        return self.scorer

    def ready(self, c) -> "ReferenceAnswers":
        """The reference's answers, or the check skipped saying why there are none."""
        if self.why_not:
            c.skip(self.why_not)
        return self.ref

    def asked(self, c, fn):
        """``fn()`` with the reference's failures as the check's skip (the judge failed, not the backend)."""
        try:
            return fn()
        except CheckSkipped:
            raise
        except JudgeUnavailable as exc:
            c.evidence("reference.log.tail", self.scorer.log_tail(80))
            c.skip(f"the reference could not start to judge: {exc}")
        except Exception as exc:  # noqa: BLE001 - the judge failed, not the backend: no verdict from it
            c.evidence("reference.log.tail", self.scorer.log_tail(80))
            c.skip(f"the reference could not score the outputs: {type(exc).__name__}: {str(exc)[:200]}")

    def stop(self) -> None:
        if self.scorer is not None:
            self.scorer.stop()


@pytest.fixture(scope="module")
def judge(run, settings, pytestconfig):
    """The module's :class:`Judge`; the reference stopped at the end."""
    j = Judge(settings, run, pytestconfig.stash.get(KEY_ENGINE, {}))
    try:
        yield j
    finally:
        j.stop()


def _finite(x: float | None) -> float | None:
    """``x`` rounded to 4 places, None when missing or not finite."""
    return None if x is None or not math.isfinite(x) else round(x, 4)


def _nll_values(b_nll: float | None, b_n: int, r_nll: float | None, r_n: int, outputs: int) -> dict:
    """The check's NLL values: both sides' pooled NLL per token, their gap and the threshold."""
    return {"backend_nll_per_token": _finite(b_nll), "backend_tokens": b_n,
            "reference_nll_per_token": _finite(r_nll), "reference_tokens": r_n,
            "nll_gap_nats": None if b_nll is None or r_nll is None else _finite(b_nll - r_nll),
            "threshold_nats": NLL_GAP_NATS, "outputs": outputs}


@pytest.mark.check("sanity.nll_judge")
def test_nll_judge(run, settings, judge):
    with run.check("sanity.nll_judge", "garbage-output") as c:
        ref = judge.ready(c)
        rows = _read(run, "evidence/sanity.degeneration/detectors.json")
        if rows is None:
            c.skip("no open-ended outputs to judge (sanity.degeneration did not run)")
        opened = _open_ended(c, rows)
        probe_outs = _probe_outputs(run)
        table, backend_lps, reference_lps, kl_rows = judge.asked(c, lambda: _judge(ref, opened, probe_outs))
        c.values["reference_answers"] = {"asked": ref.asked, "from_cache": ref.cached, "reference_started": ref.backend is not None}
        c.evidence("nll.json", table)
        b_nll, b_n = pooled_nll(backend_lps)
        r_nll, r_n = pooled_nll(reference_lps)
        pairs = [(t, e) for tops, lps in kl_rows for t, e in zip(tops, lps)]  # aligned within each output
        div = divergence([t for t, _ in pairs], [e for _, e in pairs], PROBE_LOGPROBS)
        c.values.update(_nll_values(b_nll, b_n, r_nll, r_n, len(opened)))
        c.values.update({"top1_positions": div["positions"], "top1_agreement": div["top1_agreement"],
                         "kl_positions": div["kl_positions"], "kl_short_positions": div["kl_short_positions"],
                         "kl_probe_outputs": f"{len(kl_rows)} of {len(probe_outs)} (spread evenly; report only)",
                         "mean_kl_nats": div["mean_kl_nats"], "kl_not_measurable": div["kl_not_measurable"]})
        status, line = nll_verdict(b_nll, b_n, r_nll, r_n)
        kl = _divergence_line(div)
        if status == "skip":
            c.skip(line)
        worst = max(table, key=lambda t: t["backend_nll_per_token"] or 0.0)
        c.require(status == "pass", f"{line}; e.g. {worst['backend_output']!r:.80}")
        c.summary = line + kl


SERVED_JUDGED = 16  # sweep outputs the reference scores: the highest point's (the quick profile's 8 x 2)


def _served_rows(run, settings, engine) -> tuple[list[dict], int | None]:
    """What the engine served under load, as the judge scores it: the sweep's highest point and the
    served replay's load (spread, at most :data:`SERVED_JUDGED`), each with the prompt it was generated
    from (chat-rendered where the API was chat)."""
    sweep = [r for r in (_read(run, f"evidence/throughput.sweep/{OUTPUTS}") or []) if r.get("status") == "ok"]
    if not sweep:
        return [], None
    top = max(r["sessions"] for r in sweep)
    load = _read(run, "evidence/served.under_load/loaded_load.json") or []
    rows = [{**r, "prompt": as_served(engine, settings, r["prompt"]), "sent": r["prompt"]}
            for r in [r for r in sweep if r["sessions"] == top] + [r for r in load if r.get("status") == "ok"]
            if r.get("prompt") is not None]
    rows = [r for r in rows if r["prompt"] and (r.get("token_ids") or r.get("text"))]
    return kl_sample(rows, SERVED_JUDGED), top


def _served_scores(ref, rows: list[dict], eos: set[int], max_tokens: int) -> tuple[list, list, list]:
    """The reference's own greedy outputs of the served prompts and the teacher-forced scores of both sides'
    answers (:func:`bakeoff.analysis.served.answer_span`; an engine that streamed text only: its text as
    long as the reference's answer): ``(own, served scores, reference scores)``."""
    own = ref.generate([(r["id"], r["prompt"], max_tokens) for r in rows])
    mine, theirs = [], []
    for r, o in zip(rows, own):
        if o["status"] != "ok":
            mine.append([])
            theirs.append([])
            continue
        a, b = answer_span(r.get("token_ids"), o["output_token_ids"], eos)
        text = None if r.get("token_ids") else (r.get("text") or "")[:len(o["output_text"] or "")]
        mine.append(ref.score(r["prompt"], a, "")["logprobs"] if a else
                    ref.score(r["prompt"], None, text)["logprobs"] if text and text.strip() else [])
        theirs.append(ref.score(r["prompt"], b, "")["logprobs"] if b else [])
    return own, mine, theirs


@pytest.mark.check("served.nll_judge")
def test_served_nll_judge(run, settings, judge):
    with run.check("served.nll_judge", "garbage-output") as c:
        ref = judge.ready(c)
        rows, top = _served_rows(run, settings, judge.engine)
        if not rows:
            c.skip("no sweep output with a known prompt to judge (throughput.sweep did not run)")
        eos = eos_ids(settings.model.path if settings.model.local else None)
        own, mine, theirs = judge.asked(c, lambda: _served_scores(ref, rows, eos, settings.profile_cfg["max_tokens"]))
        c.evidence("nll.json", [{"id": r["id"], "sessions": r.get("sessions", "replay"), "prompt": r["sent"],
                                 "served_output": r.get("text"), "reference_output": o["output_text"],
                                 "served_nll_per_token": _finite(pooled_nll([m])[0]),
                                 "reference_nll_per_token": _finite(pooled_nll([t])[0])}
                                for r, o, m, t in zip(rows, own, mine, theirs)])
        b_nll, b_n = pooled_nll(mine)
        r_nll, r_n = pooled_nll(theirs)
        c.values.update(_nll_values(b_nll, b_n, r_nll, r_n, len(rows)))
        c.values["sessions"] = top
        status, line = nll_verdict(b_nll, b_n, r_nll, r_n)
        if status == "skip":
            c.skip(line)
        c.require(status == "pass", f"under load ({top} sessions in flight): {line}; e.g. {rows[0].get('text')!r:.80}")
        c.summary = f"under load ({top} sessions in flight, {len(rows)} outputs): {line}"


def _with_ids(rows: list[dict], reference: dict[str, dict], settings) -> tuple[list[dict], str | None]:
    """Outputs of an engine that streamed text only (llama-server while it drafts: no logprobs, so no ids),
    given ids: the reference's own where the text holds the reference's whole answer, else the text
    tokenized with the model's tokenizer (as a server would have made it; said in the values)."""
    if all(r.get("token_ids") for r in rows):
        return rows, None
    tok, why = reference_tokenizer(settings.reference_model.path,
                                   bool(settings.reference_options.get("trust_remote_code", False)))
    out = []
    for r in rows:
        ref = reference[r["prompt"]]
        if r.get("token_ids"):
            out.append(r)
        elif ref["text"] and (r.get("text") or "").startswith(ref["text"]):
            out.append({**r, "token_ids": list(ref["full_ids"] or [])})  # the whole answer, as the reference said it
        elif tok is not None:
            out.append({**r, "token_ids": list(tok(r.get("text") or "", add_special_tokens=False)["input_ids"])})
        else:
            out.append(r)
    return out, ("the reference's where the text holds its whole answer, else the text tokenized by the model's "
                 "tokenizer" if tok is not None else f"the reference's where the text holds its whole answer ({why})")


@pytest.mark.check("spec_decode.lossless")
def test_spec_lossless(run, settings, judge):
    with run.check("spec_decode.lossless", "accuracy-regression") as c:
        rows = [r for r in (_read(run, "evidence/spec_decode.acceptance/requests.json") or []) if r.get("status") == "ok"]
        if not rows:
            c.skip("no speculative decoding outputs to judge (spec_decode.acceptance sent none: speculation off, or "
                   "its requests failed)")
        ref = judge.ready(c)
        eos = eos_ids(settings.model.path if settings.model.local else None)
        prompts = list(dict.fromkeys(r["prompt"] for r in rows))
        served = {p: as_served(judge.engine, settings, p) for p in prompts}
        if not all(served.values()):
            c.skip("the prompts went to a chat API and the model has no chat template here to generate under")

        def answers() -> dict[str, dict]:
            own = ref.generate([(str(i), served[p], SPEC_MAX_TOKENS) for i, p in enumerate(prompts)])
            out = {}
            for p, o in zip(prompts, own):
                _, ids = answer_span(None, o["output_token_ids"] if o["status"] == "ok" else None, eos)
                sc = ref.score(served[p], ids, o["output_text"], top_k=TIE_TOP_K) if ids else {"logprobs": [], "top_logprobs": []}
                out[p] = {"id": p, "text": o["output_text"], "token_ids": ids, "full_ids": o["output_token_ids"],
                          "logprobs": [[t, lp, top] for t, lp, top in zip(ids, sc["logprobs"], sc["top_logprobs"])]}
            return out
        reference = judge.asked(c, answers)
        rows, mapped = _with_ids(rows, reference, settings)
        cmp = [compare_served({**r, "token_ids": answer_span(r["token_ids"], reference[r["prompt"]]["full_ids"], eos)[0]},
                              reference[r["prompt"]]) for r in rows]
        c.evidence("agreement.json", cmp)
        n = counts(cmp)
        d = judge_real(n["real"], n["compared"])
        c.values.update({**n, "decision": d, "outputs": len(rows), "baseline": "the reference's greedy outputs",
                         "starts": sorted({r.get("start") for r in rows}), "token_ids_from_text": mapped})
        real = [r for r in cmp if r["outcome"] == "real"]
        c.require(not d["fails"], f"speculative decoding changes greedy outputs: {n['real']}/{n['compared']} outputs of "
                                  f"{SPEC_MAX_TOKENS} tokens diverge from the reference's past the tie rule; e.g. "
                                  f"{first_difference(real[0], 'reference', 'speculative') if real else ''}")
        if n["compared"] < len(cmp) / 2:
            c.skip(f"{n['undetermined']}/{len(cmp)} outputs differ from the reference's where no logprobs tell a tie: "
                   "not verified")
        c.summary = (f"{n['exact']} exact, {n['tie']} tie, {n['real']} real of {len(cmp)} speculative outputs "
                     f"({SPEC_MAX_TOKENS} tokens) against the reference's greedy outputs")
