"""The run against its twin: the same engine and model with one configuration choice at its default.

A twin is the run passed as ``--baseline-run``: ``bakeoff qualify --matrix`` passes each cell the
cell that differs from it in one choice only, set to its default (:func:`bakeoff.analysis.matrix.baseline_cell`:
``kv_cache_dtype`` auto for a quantized KV cache, no speculation for a speculative cell, the engine's
own chunked-prefill budget for a small ``max_num_batched_tokens``, a determinism switch off). Each of
those choices claims to leave greedy outputs as they were (up to numerical ties: a quantized cache
within them), which is what vLLM's own tests assert of an fp8 KV cache against auto
(``tests/models/quantization/test_fp8.py``, ``check_logprobs_close``).

``served.twin`` compares what both runs recorded on the same requests, by the served rule
(:mod:`bakeoff.analysis.served`: the tie rule with both sides' logprobs, real divergences by an exact
binomial test):

- the sanity probes (``evidence/sanity.outputs.json``);
- the sweep's prompts served alone (``evidence/served.under_load/quiet.json``);
- the agents' conversations, **turn by turn**: the twin's (``evidence/agents.multiturn/turns.json``) are
  replayed here, each turn sent the prompt the twin sent it, which holds the twin's own earlier answers,
  so every turn is compared on the same prompt whatever this run answered before it (a near-tie on turn 1
  would otherwise part the transcripts and end the comparison there: seen with fp8 KV on SmolLM2-135M);
  the agents at once, the turns in order, so each turn extends the previous one's cached prefix as in the
  benchmark. A failure names the first turn whose answers diverge, so a cache that is fine on turn 1 and
  wrong by turn 4 is named at turn 4.

Fails ``accuracy-regression`` naming the workload (and turn); a workload the twin did not record is
left out, saying so; without ``--baseline-run``, or with a baseline of another engine or model, skip.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from bakeoff.analysis.matrix import load_baseline
from bakeoff.analysis.sanity import TIE_TOP_K
from bakeoff.analysis.served import compare_served, counts, first_difference, judge_real
from bakeoff.api.specs import GenerationRequest
from bakeoff.host.artifacts import read_json
from bakeoff.loadgen.sweep import run_request
from evaluations.serving import request_row

WORKLOADS = (("probes", "evidence/sanity.outputs.json"), ("sweep prompts alone", "evidence/served.under_load/quiet.json"))
TURNS = "evidence/agents.multiturn/turns.json"


def _rows(path: Path, rel: str) -> list[dict] | None:
    """A run's rows of one workload (a list, or the ``outputs`` of an object), None when absent."""
    try:
        data = read_json(path / rel)
    except (OSError, ValueError):
        return None
    rows = data.get("outputs") if isinstance(data, dict) else data
    return rows if isinstance(rows, list) else None


def _pairs(mine: list[dict], theirs: list[dict]) -> list[tuple[dict, dict]]:
    """Rows of the same request (same id and prompt) that ended ok on both sides."""
    by_id = {r.get("id"): r for r in theirs if r.get("status") == "ok"}
    return [(r, by_id[r["id"]]) for r in mine if r.get("status") == "ok" and r.get("id") in by_id
            and r.get("prompt") == by_id[r["id"]].get("prompt")]


def replay_turns(engine, theirs: list[dict]) -> list[dict]:
    """The twin's conversations replayed: each agent's turns in order, each sent the prompt the twin sent
    it (its transcript holds the twin's own earlier answers), as many tokens as the twin generated, with
    top-k logprobs; the agents at once, as the agents benchmark runs them. Returns one row a turn."""
    rows: list[dict] = []

    async def agent(a: int) -> None:
        for t in sorted((r for r in theirs if r["agent"] == a and r.get("status") == "ok" and r.get("prompt")),
                        key=lambda r: r["turn"]):
            n = len(t.get("token_ids") or []) or int(t.get("output_tokens") or 16)
            req = GenerationRequest(request_id=f"twin-agent{a}-turn{t['turn']}", prompt=t["prompt"], max_tokens=n,
                                    temperature=0.0, ignore_eos=True, logprobs=TIE_TOP_K)
            rows.append({**request_row(req, await run_request(engine, req, session=a)), "agent": a, "turn": t["turn"]})

    async def main() -> None:
        try:
            await asyncio.gather(*(agent(a) for a in sorted({r["agent"] for r in theirs})))
        finally:
            await engine.aclose()
    asyncio.run(main())
    return rows


def turn_by_turn(mine: list[dict], theirs: list[dict]) -> tuple[list[dict], dict[int, dict]]:
    """Replayed turns (:func:`replay_turns`) against the twin's: ``(rows, {turn: counts})``, turns 1-based.
    Every turn is compared: its prompt is the twin's, whatever this run answered before it."""
    key = {(r["agent"], r["turn"]): r for r in theirs}
    rows: list[dict] = []
    per_turn: dict[int, dict] = {}
    for r in sorted(mine, key=lambda r: (r["agent"], r["turn"])):
        other = key.get((r["agent"], r["turn"]))
        if r.get("status") != "ok" or other is None:
            continue
        cmp = compare_served({**r, "id": f"agent {r['agent']} turn {r['turn'] + 1}"}, {**other, "text": other.get("output")})
        cmp["turn"] = r["turn"] + 1
        rows.append(cmp)
        n = per_turn.setdefault(r["turn"] + 1, {"exact": 0, "tie": 0, "real": 0, "undetermined": 0})
        n[cmp["outcome"]] += 1
    return rows, per_turn


def _twin_of(c, run, base_dir: str) -> tuple[dict, Path, list[str]]:
    """The baseline run as this run's twin: ``(baseline, its folder, options that differ)``; skip when it is
    another engine's or model's."""
    base = load_baseline(Path(base_dir))
    theirs = Path(base["path"])
    twin_model = (read_json(theirs / "verdict.json") or {}).get("model_path")
    if base["backend"] != run.verdict.backend or twin_model != run.verdict.model_path:
        c.skip(f"the baseline run {base['run_id']} is {base['backend']} on {twin_model}, not this run's engine and "
               "model: not a twin")
    differs = sorted(k for k in set(run.verdict.options) | set(base["options"])
                     if run.verdict.options.get(k) != base["options"].get(k))
    return base, theirs, differs


def _compare_workloads(c, engine, mine_path: Path, theirs_path: Path) -> tuple[list[tuple], list[str], dict]:
    """Every workload both runs recorded, compared, and the twin's conversations replayed here: ``([(name,
    rows, counts, decision)], left out, per turn)``."""
    verdicts, left_out = [], []
    for name, rel in WORKLOADS:
        mine, theirs = _rows(mine_path, rel), _rows(theirs_path, rel)
        if not mine or not theirs:
            left_out.append(f"{name} ({'this run' if not mine else 'the twin'} recorded none)")
            continue
        rows = [compare_served(a, b) for a, b in _pairs(mine, theirs)]
        c.evidence(f"{name.split()[0]}.json", rows)
        n = counts(rows)
        verdicts.append((name, rows, n, judge_real(n["real"], n["compared"])))
    theirs = _rows(theirs_path, TURNS)
    per_turn: dict[int, dict] = {}
    if theirs:
        replayed = replay_turns(engine, theirs)
        c.evidence("replayed_turns.json", replayed)
        rows, per_turn = turn_by_turn(replayed, theirs)
        c.evidence("turns.json", rows)
        n = counts(rows)
        verdicts.append(("agents' turns", rows, n, judge_real(n["real"], n["compared"])))
    else:
        left_out.append("agents' turns (the twin recorded none)")
    return verdicts, left_out, per_turn


def _fail_first(c, verdicts: list[tuple], base: dict, differs: list[str]) -> None:
    """Fail on the first workload whose real divergences fail the rule, naming it (and the turn)."""
    for name, rows, n, d in verdicts:
        if not d["fails"]:
            continue
        real = [r for r in rows if r["outcome"] == "real"]
        turn = f" from turn {min(r['turn'] for r in real)} on" if name == "agents' turns" and real else ""
        c.fail(f"{name}{turn}: {n['real']}/{n['compared']} outputs diverge from twin run {base['run_id']} "
               f"(differs in {', '.join(differs) or 'nothing recorded'}) past the tie rule; e.g. "
               f"{first_difference(real[0], 'twin', 'this run') if real else ''}")


@pytest.mark.check("served.twin")
def test_twin(run, pytestconfig, engine):
    with run.check("served.twin", "accuracy-regression") as c:
        base_dir = pytestconfig.getoption("--baseline-run", None)
        if not base_dir:
            c.skip("no twin run to compare with (bakeoff qualify --matrix passes each cell the cell with its choice at "
                   "the default, e.g. --matrix kv_cache_dtype=auto,fp8; by hand: --baseline-run DIR)")
        base, theirs_path, differs = _twin_of(c, run, base_dir)
        c.values.update({"twin_run": base["run_id"], "differs_in": differs})
        verdicts, left_out, per_turn = _compare_workloads(c, engine, run.dir.path, theirs_path)
        c.values.update({"workloads": {name: {**n, "decision": d} for name, _, n, d in verdicts},
                         "turns": {str(t): n for t, n in sorted(per_turn.items())}, "left_out": left_out})
        _fail_first(c, verdicts, base, differs)
        if not verdicts or not any(n["compared"] for _, _, n, _ in verdicts):
            c.skip(f"no output of the same request in both runs to compare ({'; '.join(left_out) or 'none ended ok'})")
        c.summary = (f"against twin run {base['run_id']} (differs in {', '.join(differs) or 'nothing recorded'}): "
                     + "; ".join(f"{name} {n['exact']} exact, {n['tie']} tie, {n['real']} real" for name, _, n, _ in verdicts)
                     + (f"; left out: {', '.join(left_out)}" if left_out else ""))
