"""Throughput: a closed-loop session sweep with TTFT / TPOT / ITL / E2E per point.

The measurement is :class:`bakeoff.loadgen.throughput.ThroughputSweep`; the checks here record
what it measured: the sweep's figures, the stream's shape (``throughput.transport``) and the
token counts (``throughput.accounting``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bakeoff.api.specs import GenerationRequest
from bakeoff.host.artifacts import SWEEP_POINTS_LOG, RunDir
from bakeoff.loadgen.accounting import ABS_TOLERANCE_TOKENS, REL_TOLERANCE
from bakeoff.loadgen.stats import per_request
from bakeoff.loadgen.throughput import SweepPlan, ThroughputSweep
from evaluations.measuring import client_token_counter, is_fixture
from evaluations.gpu_telemetry import gpu_sampler
from evaluations.plugin import attach_engine_evidence
from evaluations.probing import throughput_prompt

TOKEN_COUNTS = "token_counts.json"
TRANSPORT = "transport.json"
OUTPUTS = "outputs.json"  # every sweep response's output, judged where it was served (evaluations/test_served.py)


def output_rows(sweep: ThroughputSweep, sent: dict[str, GenerationRequest]) -> list[dict]:
    """Every measured request's output (warm-up apart): the point's sessions, its id and prompt, how it
    ended, its text and token ids (no logprobs: the sweep asks for none, so that what it measures is what
    the engine serves); ``sent``: the requests by id."""
    return [{"sessions": n, "id": r.request_id, "session": r.session, "prompt": sent[r.request_id].prompt,
             "max_tokens": sent[r.request_id].max_tokens, "status": r.status, "error_class": r.error_class,
             "finish_reason": r.finish_reason, "text": r.output_text, "token_ids": r.output_token_ids, "ignore_eos": True}
            for n, recs in sweep.records.items() for r in recs if r.request_id in sent]


def append_point(run_path: Path, point: dict) -> None:
    """The point's headline figures as one line of ``SWEEP_POINTS_LOG``, for the live view."""
    RunDir(run_path).append_jsonl(SWEEP_POINTS_LOG, [{
        "sessions": point.get("sessions"), "output_tokens_per_s": point.get("output_tokens_per_s"),
        "ttft_p50_ms": point.get("ttft_p50_ms"), "valid": point.get("valid", True), "errors": point.get("errors")}])


def _recorder(run, c, settings, sent: dict[str, GenerationRequest]):
    """``on_point`` of the sweep: each point's figures, counts and outputs written as they land."""
    cfg = settings.profile_cfg

    def on_point(sweep: ThroughputSweep, point: dict, recs: list) -> None:
        append_point(run.dir.path, point)
        if sweep.first_errors:
            c.values["first_errors"] = list(sweep.first_errors)
        c.evidence("sweep.json", {"points": sweep.points, "profile": settings.profile, "max_tokens": cfg["max_tokens"]})
        c.evidence(TOKEN_COUNTS, sweep.counts_rows)
        c.evidence(OUTPUTS, output_rows(sweep, sent))
        if settings.requests_log:
            run.dir.append_jsonl("requests.jsonl", [{**per_request(r), "output_text": r.output_text} for r in recs])
    return on_point


@pytest.mark.check("throughput.sweep")
def test_sweep(run, settings, engine, pytestconfig):
    cfg = settings.profile_cfg
    fixture = is_fixture(settings)  # a fixture by name or its folder: its counting prompts
    cal = run.get("loadgen.calibration")
    plan = SweepPlan(sessions=list(cfg["sessions"]), requests_per_session=cfg["requests_per_session"],
                     warmup=cfg["warmup"], max_tokens=cfg["max_tokens"],
                     repeats=max(1, int(pytestconfig.getoption("--repeats", 1) or 1)),
                     calibrated_concurrency=cal.values.get("calibrated_concurrency")
                     if cal is not None and cal.status == "pass" else None)

    sent: dict[str, GenerationRequest] = {}

    def make(session: int, turn: int) -> GenerationRequest:
        req = GenerationRequest(request_id=f"s{session}-t{turn}", prompt=throughput_prompt(session, turn, fixture),
                                max_tokens=cfg["max_tokens"], temperature=0.0, ignore_eos=True)
        sent[req.request_id] = req
        return req

    with run.check("throughput.sweep", "runtime-crash") as c:
        count_tokens, c.values["client_tokenizer"] = client_token_counter(settings, engine)
        (run.dir.path / SWEEP_POINTS_LOG).unlink(missing_ok=True)  # a resumed run's sweep starts it again
        sweep = ThroughputSweep(engine, make, plan, count_tokens, gpu_sampler(pytestconfig), _recorder(run, c, settings, sent))
        res = sweep.run(settings.model.path if settings.model.local else None)
        c.values["output_tokens_sources"] = res.sources()  # which count the figures use, per request
        c.evidence(TRANSPORT, res.transport)
        c.values.update(transport_distorted=res.transport["distorted"], warmup=res.warmup, points=res.point_values(),
                        repeats=plan.repeats, roofline=res.roofline)
        if res.gpu:
            c.values.update(gpu=res.gpu, joules_per_output_token=res.gpu["joules_per_output_token"])
        c.evidence("sweep.json", {"warmup": res.warmup, "points": res.points, "profile": settings.profile,
                                  "max_tokens": cfg["max_tokens"], "roofline": res.roofline})
        c.values.update(res.peak())
        c.values["serving_bound_sessions"] = [p["sessions"] for p in res.points if p.get("serving_bound")]
        classes, errs = res.errors_by_class()
        if errs:
            worst = max(classes, key=classes.get)
            attach_engine_evidence(c, engine, worst)
            first = res.first_errors[0] if res.first_errors else worst
            c.fail(f"{sum(classes.values())} requests failed across {len(errs)} sweep points "
                   f"(first at {errs[0]['sessions']} sessions): {first}", worst)
        c.require(len(res.points) == len(plan.sessions), "the sweep stopped early")
        if not res.ok_points():
            why = next((p.get("invalid_reason") for p in res.points if p.get("invalid_reason")), None)
            c.skip("no sweep point was measured within the load generator's error budget"
                   + (f" ({why})" if why else "") + ": this host could not measure the engine (its figures are kept "
                   "in values, marked invalid); rerun on an idle host")
        c.summary = res.summary()


@pytest.mark.check("throughput.transport")
def test_transport(run, engine):
    """Whether the sweep's streams were distorted between engine and client (a buffering proxy):
    the rule of bakeoff/loadgen/distortion.py (bursts, with the first token held back or TTFT
    above the engine's own). Fails ``transport-distortion`` naming the evidence; the sweep's
    figures are then the hop's, not the engine's (the report marks them)."""
    sweep = run.get("throughput.sweep")
    with run.check("throughput.transport", "transport-distortion") as c:
        path = next((p for p in (sweep.evidence if sweep else []) if p.endswith("/" + TRANSPORT)), None)
        if path is None or not (run.dir.path / path).is_file():
            c.skip("no sweep stream to inspect (throughput.sweep did not finish)")
        shape = json.loads((run.dir.path / path).read_text())
        c.values.update({k: v for k, v in shape.items() if k not in ("reasons",)})
        c.evidence("transport.json", shape)
        if shape["distorted"] is None:
            c.skip(f"cannot tell: {shape['reasons'][0]}")
        c.values["hop_possible"] = not engine.serves_on_loopback
        if shape["distorted"] and engine.serves_on_loopback:
            c.skip("streams arrived batched (" + "; ".join(shape["reasons"]) + "), but no hop exists: bakeoff launched "
                   "this server on 127.0.0.1, so the engine's own frontend or a loaded host batched them; the sweep's "
                   "TTFT/ITL are marked distorted, not the engine's")
        c.require(not shape["distorted"], "stream distorted in transit: " + "; ".join(shape["reasons"]))
        c.summary = (f"no buffering hop: median first cluster {shape['first_cluster_events_p50']:g} event(s), "
                     f"median {shape['events_per_cluster_p50']:g} events per arrival cluster over "
                     f"{shape['requests']} streams" + (f"; headers {shape['headers']}" if shape["headers"] else ""))


@pytest.mark.check("throughput.accounting")
def test_accounting(run, engine):
    """Server usage against the client's own count of every sweep request
    (bakeoff/loadgen/accounting.py). Token ids are exact: one disagreement fails. A tokenizer's
    count agrees within 2 tokens + 10% of those in multi-token events; it fails when more than 5% of requests (and at least
    2) disagree beyond that, so one odd detokenization cannot flip the verdict. Without usage, or
    with usage that only an event count could check and exceeds it, nothing was verified: skip;
    likewise when the client's tokenizer counts the prompts otherwise than the server (not the
    server's tokenizer: the counts are disputed)."""
    sweep = run.get("throughput.sweep")
    with run.check("throughput.accounting", "client-accounting") as c:
        path = next((p for p in (sweep.evidence if sweep else []) if p.endswith("/" + TOKEN_COUNTS)), None)
        if path is None or not (run.dir.path / path).is_file():
            c.skip("no sweep request to check (throughput.sweep wrote no token counts)")
        rows = [r for r in json.loads((run.dir.path / path).read_text()) if r["status"] == "ok"]
        by = {k: [r for r in rows if r["accounting"] == k]
              for k in ("agree", "disagree", "unverified", "no-usage", "disputed")}
        basis = _accounting_basis(rows)
        c.values.update(_accounting_values(rows, by, basis, sweep))
        impossible, worst = _disagreeing(by)
        c.evidence("accounting.json", {"rule": test_accounting.__doc__.split("(")[0].strip(), **c.values,
                                       "disagreeing": worst, "requests": rows})
        if not rows:
            c.skip("no request of the sweep ended ok")
        n_bad, n = len(by["disagree"]), len(rows)
        if n_bad:
            _judge_disagreements(c, worst, impossible, basis, n)
        _skip_unverified(c, by, basis, n)
        by_events = [r for r in by["agree"] if "agrees with client-events" in (r.get("output_tokens_source") or "")]
        c.values["agree_by_content_events"] = len(by_events)
        c.summary = _accounting_summary(by, by_events, basis, c.values["tolerance"], n_bad, n)


def _accounting_basis(rows: list[dict]) -> str:
    """What the client counted the output tokens with: streamed token ids, its tokenizer, or content events."""
    ids = sum(1 for r in rows if r["streamed_token_ids"] is not None)
    return ("streamed token ids" if ids == len(rows) and rows else
            "the client's tokenizer" if all(r["client_tokenizer_tokens"] is not None for r in rows) else
            "content events")


def _accounting_values(rows: list[dict], by: dict[str, list[dict]], basis: str, sweep) -> dict:
    """The accounting check's values: requests, basis, counts per outcome, tolerance and the sweep's client tokenizer."""
    return {"requests": len(rows), "basis": basis, "mismatches": len(by["disagree"]),
            "unverified": len(by["unverified"]), "no_usage": len(by["no-usage"]),
            "disputed": len(by["disputed"]),
            "tolerance": "exact" if basis == "streamed token ids" else
            f"{ABS_TOLERANCE_TOKENS} tokens + {REL_TOLERANCE:.0%} of multi-token events",
            "client_tokenizer": sweep.values.get("client_tokenizer"),
            "output_tokens_sources": sweep.values.get("output_tokens_sources")}


def _disagreeing(by: dict[str, list[dict]]) -> tuple[list[dict], list[dict]]:
    """The requests whose usage no stream can hold, and all disagreeing requests, largest gap first."""
    impossible = [r for r in by["disagree"] if "usage impossible" in (r.get("output_tokens_source") or "")]

    def gap(r) -> float:  # an impossible claim first (it may not even be a number)
        u = r["usage_output_tokens"]
        return float("inf") if r in impossible or not isinstance(u, int) else abs(u - (r["output_tokens"] or 0))
    return impossible, sorted(by["disagree"], key=lambda r: -gap(r))


def _judge_disagreements(c, worst: list[dict], impossible: list[dict], basis: str, n: int) -> None:
    """Fail on an impossible usage, on any disagreement with token ids, or on more than 5% (and 2) disagreeing."""
    n_bad = len(worst)
    r = worst[0]
    own = r["streamed_token_ids"] if r["streamed_token_ids"] is not None else (
        r["client_tokenizer_tokens"] if r["client_tokenizer_tokens"] is not None else r["content_events"])
    msg = (f"{n_bad}/{n} requests: server usage differs from {basis} (e.g. {r['request_id']}: usage "
           f"{r['usage_output_tokens']} vs {own}); the sweep's figures use the client's count")
    if impossible:  # not a count that differs: one no stream can hold (accounting.impossible_count)
        c.fail(f"{len(impossible)}/{n} requests: server usage impossible ({worst[0]['output_tokens_source']}, "
               f"e.g. {worst[0]['request_id']}: usage {worst[0]['usage_output_tokens']} vs {own}); "
               "the sweep's figures use the client's count")
    c.require(basis != "streamed token ids" or n_bad == 0, msg)
    c.require(n_bad < 2 or n_bad <= 0.05 * n, msg)


def _skip_unverified(c, by: dict[str, list[dict]], basis: str, n: int) -> None:
    """Skip when nothing was verified: counts disputed, no usage at all, or no request agreeing."""
    if by["disputed"]:
        r = by["disputed"][0]
        c.skip(f"{len(by['disputed'])}/{n} requests disputed: the client's tokenizer counts the prompt of "
               f"{r['request_id']} as {r['client_prompt_tokens']} tokens, the server's usage "
               f"{r['usage_prompt_tokens']}: it is not the server's tokenizer, so neither count checks the other "
               "(figures use server usage; pass --backend-opt tokenizer=DIR with the server's tokenizer)")
    if len(by["no-usage"]) == n:
        c.skip(f"the server reported no usage: nothing to check; the figures use {basis}")
    if len(by["agree"]) == 0:
        c.skip(f"usage exceeds the content events of {len(by['unverified'])} requests: events may carry several "
               "tokens, so only a tokenizer can tell (pass --backend-opt tokenizer=DIR); figures use server usage, "
               "unverified")


def _accounting_summary(by: dict[str, list[dict]], by_events: list[dict], basis: str, tolerance: str,
                        n_bad: int, n: int) -> str:
    """The accounting summary: requests agreeing with the basis, those outside tolerance, unverified, or settled by events."""
    return (f"server usage agrees with {basis} on {len(by['agree']) - len(by_events)}/{n} requests "
            f"({tolerance})" + (f"; {n_bad} outside tolerance" if n_bad else "")
            + (f"; {len(by['unverified'])} unverified" if by["unverified"] else "")
            + (_by_events(by_events[0], len(by_events)) if by_events else ""))


def _by_events(r: dict, k: int) -> str:
    """The accounting summary's words for requests whose usage their content events settled."""
    return (f"; {k} with their content events, one token each, where the client's tokenizer counted otherwise "
            f"(e.g. {r['request_id']}: usage {r['usage_output_tokens']} = {r['content_events']} events, tokenizer "
            f"{r['client_tokenizer_tokens']}): it is not the server's tokenizer (pass --backend-opt tokenizer=DIR)")
