"""Broken engines on the real model are still caught: test doubles, each run through the real suite.

On SmolLM2-135M-Instruct (``--model smollm2-135m-instruct``, a real pretrained model), each double
proves a check can fail on a real model, and the healthy control proves the same checks do not
fail a faithful engine:

(0) control: the real engine as it is, attached through the ``openai`` backend: no selected
    check fails;
(1) permuted tokens (``tests/fakes/token_doubles.py permute``, a FAKE proxy in front of the same
    engine reversing each window of 4 content tokens): the engine's own tokens in the wrong order,
    word salad: ``garbage-output`` by the reference's NLL judge, with the agreement's
    ``accuracy-regression`` beside it;
(2) every 5th token replaced (``... replace``, a FAKE proxy): fluent-looking vocabulary tokens
    injected, which the model-free detectors pass: ``garbage-output`` by the NLL judge;
(3) a wrong chat template (``tests/fakes/broken_checkpoints.py wrong_chat_template``, a FAKE
    checkpoint: the real weights under Llama-2's ``[INST]`` template), run as ``--model COPY
    --reference-model REAL``: the engine is sent the chat probes rendered with its model's
    template, the reference computes them with its own: ``accuracy-regression`` on the chat probes;
(4) a truncated ``model.safetensors`` (``... truncated_weights``): ``load-failure`` by the
    pre-flight, naming the file, before any engine or reference starts.

The known answers judge against the reference's answers, and skip while the reference answers
fewer than half the generic probes (the rule of ``evaluations/reference.py baseline``); the
assertions hold either way and name no probe count or family. The engine behind (0)-(2) is the
transformers worker on the real model in float32 (the reference's dtype), started once; (3)
starts its own on the copy; checks outside each case's subject are deselected with ``-k``.
Measured wall time of the module: 7.0 to 8.1 min on a shared 2-core host (two runs; control 1.8-2.6
min with the engine's start, permute 1.7-2.0, replace 1.8-1.9, template 1.3-1.4, truncated 2 x 5 s),
with the reference's outputs and the judge's answers cached; a fresh cache adds the reference's
computation (~1.5 min) and the judge's scoring (~25 s a run).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from bakeoff.host.procs import free_port
from bakeoff.models.resolve import resolve
from tests.fakes.broken_checkpoints import truncated_weights, wrong_chat_template
from tests.fakes.launch import ChildServer, transformers_worker

REPO = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.slow, pytest.mark.engine("transformers")]
SANITY = "test_load or test_sanity or test_judge"


@pytest.fixture(scope="module")
def real() -> Path:
    return Path(resolve("smollm2-135m-instruct").path)


@pytest.fixture(scope="module")
def engine_url(real, tmp_path_factory):
    """The transformers worker serving the real model (float32), for the module."""
    with transformers_worker(real, tmp_path_factory.mktemp("engine")) as url:
        yield url


def _Proxy(kind: str, upstream: str, model: Path, log: Path) -> ChildServer:  # noqa: N802 - reads as the class it was
    """A token double (``tests/fakes/token_doubles.py``) in front of ``upstream`` until closed."""
    port = free_port()
    return ChildServer([sys.executable, "-m", "tests.fakes.token_doubles", kind, "--upstream", upstream,
                        "--tokenizer", str(model), "--port", str(port)], port, log, timeout_s=60)


def _suite(tmp: Path, backend: str, model: Path, *opts: str, select: str | None = None) -> tuple[int, dict, Path, str]:
    """``pytest evaluations/`` in a child: ``(exit code, verdict, run directory, stdout)``."""
    art = tmp / "art"
    cmd = [sys.executable, "-m", "pytest", "evaluations/", "-p", "no:cacheprovider", "-q", "--backend", backend,
           f"--model={model}", f"--artifacts={art}", *opts] + (["-k", select] if select else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=1500)
    runs = sorted((art / "runs").glob("*/verdict.json"))
    assert runs, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.returncode, json.loads(runs[-1].read_text()), runs[-1].parent, proc.stdout


def _checks(v: dict) -> dict:
    return {c["name"]: c for c in v["checks"]}


def _failed_classes(v: dict) -> set[str]:
    return {c["failure_class"] for c in v["checks"] if c["status"] == "fail"}


def _open_ended(run: Path) -> dict[str, list[int]]:
    """The token ids of each open-ended output (``sanity.degeneration``'s evidence), by prompt."""
    rows = json.loads((run / "evidence" / "sanity.degeneration" / "detectors.json").read_text())
    return {r["prompt"]: r["token_ids"] for r in rows if str(r["id"]).startswith("open-")}


def _known_answers_not_passed(ka: dict) -> None:
    """Known answers fail (garbage, or a regression that keeps most answers), or skip because the
    reference answers too few probes to judge."""
    assert (ka["status"] == "fail" and ka["failure_class"] in ("garbage-output", "accuracy-regression")) or \
        (ka["status"] == "skip" and "cannot judge" in ka["summary"]), ka


@pytest.fixture(scope="module")
def control(real, engine_url, tmp_path_factory):
    """The control run: the real engine without a proxy, through the checks the doubles fail."""
    rc, v, run, out = _suite(tmp_path_factory.mktemp("control"), "openai", real, "--backend-opt",
                             f"base_url={engine_url}", select=SANITY)
    return rc, v, run, out


def test_0_the_real_engine_fails_none_of_the_checks(control):
    rc, v, _, out = control
    checks = _checks(v)
    assert not _failed_classes(v) and v["status"] in ("qualified", "incomplete"), (v["reasons"], out[-2000:])
    agr, judge, ka = checks["sanity.reference_agreement"], checks["sanity.nll_judge"], checks["sanity.known_answers"]
    assert agr["status"] == "pass" and agr["values"]["decision"]["regression"] is False, agr["summary"]
    assert agr["values"]["real_divergences"] <= agr["values"]["exact"] // 20, agr["summary"]
    assert judge["status"] == "pass" and abs(judge["values"]["nll_gap_nats"]) < 0.5, judge["summary"]
    assert ka["status"] == "pass" or "cannot judge" in ka["summary"], ka
    assert checks["sanity.degeneration"]["status"] == "pass"
    assert agr["values"]["chat_rendering"]["prompts_differ"] == 0  # one model: one rendering on both sides


def test_1_permuted_tokens_are_garbage(tmp_path, real, engine_url, control):
    proxy = _Proxy("permute", engine_url, real, tmp_path / "proxy.log")
    try:
        rc, v, run, out = _suite(tmp_path, "openai", real, "--backend-opt", f"base_url={proxy.url}", select=SANITY)
    finally:
        proxy.close()
    checks = _checks(v)
    assert rc == 1 and v["status"] == "disqualified", out[-2000:]
    judge, agr = checks["sanity.nll_judge"], checks["sanity.reference_agreement"]
    assert judge["status"] == "fail" and judge["failure_class"] == "garbage-output", judge["summary"]
    assert judge["values"]["nll_gap_nats"] > judge["values"]["threshold_nats"]
    assert "evidence/sanity.nll_judge/nll.json" in judge["evidence"]
    d = agr["values"]["decision"]
    assert agr["status"] == "fail" and agr["failure_class"] == "accuracy-regression", agr["summary"]
    assert d["regression"] and d["p_value"] < 1e-6 and d["b"] > 10 * max(d["c"], 1)
    _known_answers_not_passed(checks["sanity.known_answers"])
    assert _failed_classes(v) <= {"garbage-output", "accuracy-regression"}
    # the double is what it says: each output holds the engine's own tokens, reordered
    permuted, faithful = _open_ended(run), _open_ended(control[2])
    assert permuted.keys() == faithful.keys()
    for prompt, ids in permuted.items():
        assert Counter(ids) == Counter(faithful[prompt]) and (ids != faithful[prompt] or len(ids) < 2), prompt


def test_2_every_fifth_token_replaced_is_garbage(tmp_path, real, engine_url, control):
    proxy = _Proxy("replace", engine_url, real, tmp_path / "proxy.log")
    try:
        rc, v, run, out = _suite(tmp_path, "openai", real, "--backend-opt", f"base_url={proxy.url}", select=SANITY)
    finally:
        proxy.close()
    checks = _checks(v)
    assert rc == 1 and v["status"] == "disqualified", out[-2000:]
    judge, agr = checks["sanity.nll_judge"], checks["sanity.reference_agreement"]
    assert judge["status"] == "fail" and judge["failure_class"] == "garbage-output", judge["summary"]
    assert judge["values"]["nll_gap_nats"] > judge["values"]["threshold_nats"]
    # the injected tokens are below the server's own top logprob: not greedy (sanity.greedy) as well
    assert "garbage-output" in _failed_classes(v) <= {"garbage-output", "accuracy-regression", "ineffective-option"}
    greedy = checks["sanity.greedy"]
    assert greedy["status"] == "fail" and greedy["values"]["non_greedy"] > 0.1 * greedy["values"]["verified"], greedy
    assert agr["status"] == "pass" or agr["failure_class"] == "accuracy-regression", agr["summary"]
    # short answers end before a 5th token: the known answers may keep most of them right (not asserted)
    # the double is what it says: every 5th token differs from the engine's, no other one
    replaced, faithful = _open_ended(run), _open_ended(control[2])
    for prompt, ids in replaced.items():
        want = faithful[prompt]
        assert len(ids) == len(want)
        assert [k for k, (a, b) in enumerate(zip(ids, want)) if a != b] == list(range(4, len(ids) - len(ids) % 5, 5))


def test_3_a_wrong_chat_template_regresses_on_the_chat_probes(tmp_path, real):
    """Llama-2's [INST] template in place of SmolLM2's ChatML: the 60 chat probes (a question after
    three answered turns) are rendered with it; the model still answers most of them (the turns fix
    the reply's shape), but its replies diverge from the reference's past the tie rule where the
    probes rendered alike agree: ``template_effect`` fails the agreement as accuracy-regression."""
    copy = wrong_chat_template(real, tmp_path / "wrong-template")
    rc, v, run, out = _suite(tmp_path, "transformers", copy, f"--reference-model={real}", "--backend-opt", "dtype=float32",
                             select="test_load or test_known_answers or test_reference_agreement")
    checks = _checks(v)
    assert rc == 1 and v["status"] == "disqualified", out[-2000:]
    agr = checks["sanity.reference_agreement"]
    assert agr["status"] == "fail" and agr["failure_class"] == "accuracy-regression", agr["summary"]
    vals = agr["values"]
    rendering = vals["chat_rendering"]
    assert rendering["chat_template"] == "the model under test's" and rendering["templates_identical"] is False
    first = rendering["first_difference"]
    assert "[INST]" in first["engine_prompt"] and "<|im_start|>assistant" in first["reference_prompt"]
    rd = vals["rendered_differently"]
    assert rd["probes"] == rendering["prompts_differ"] > 0 and rd["template_changes_answers"] is True
    assert rd["p_value"] < 0.01 and rd["real_divergences"] > rd["alike_real_divergences"], rd
    assert "chat template changes what it answers" in agr["summary"]
    # the real divergences are chat probes, each rendered with the wrong template; the rest agree
    outs = json.loads((run / "evidence" / "sanity.outputs.json").read_text())["outputs"]
    rows = {r["id"]: r for r in json.loads((run / "evidence" / "sanity.reference_agreement" / "agreement.json").read_text())["rows"]}
    real_div = [o for o in outs if rows[o["id"]]["outcome"] == "real"]
    assert real_div and all("[INST]" in o["prompt"] for o in real_div), [o["id"] for o in real_div]
    assert all(rows[o["id"]]["outcome"] in ("exact", "tie") for o in outs if "[INST]" not in o["prompt"])
    ka = checks["sanity.known_answers"]  # accuracy alone: the answers stay right (a pass is what it measured)
    assert ka["values"]["chat_rendering"] == rendering


@pytest.mark.parametrize("backend", ["vllm", "transformers"])
def test_4_a_truncated_weights_file_is_refused_before_any_engine_starts(tmp_path, real, backend):
    copy, whole, kept = truncated_weights(real, tmp_path / "truncated")
    rc, v, run, out = _suite(tmp_path, backend, copy)  # the whole suite: every check after the load skips
    checks = _checks(v)
    assert rc == 1 and v["status"] == "disqualified", out[-2000:]
    load = checks["load"]
    assert load["status"] == "fail" and load["failure_class"] == "load-failure", load
    assert f"model.safetensors is truncated: its header describes {whole:,} bytes, the file holds {kept:,}" in load["summary"]
    assert _failed_classes(v) == {"load-failure"}
    # nothing launched: no engine, no reference (its default is the copy itself), no engine log
    assert v["backend_info"] is None and not any((run / "engine").rglob("*")), list((run / "engine").rglob("*"))
    assert (run / "evidence" / "load" / "engine.log.tail").read_text() == ""
    engine_checks = [c for c in v["checks"] if c["name"].startswith(("sanity.", "throughput.", "capacity."))]
    assert engine_checks and all(c["status"] == "skip" and "load-failure" in c["summary"] for c in engine_checks)


def test_the_doubles_are_named_fakes():
    for name in ("token_doubles.py", "broken_checkpoints.py"):
        doc = (REPO / "tests" / "fakes" / name).read_text().split('"""')[1]
        assert "FAKE" in doc and "double" in doc.lower(), name
