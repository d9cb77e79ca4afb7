"""A gallery of backends broken on purpose, each run through the real suite (``pytest evaluations/``).

Each broken engine is a test fixture that proves a check can fail, and the healthy control
proves the same checks do not fail a faithful engine:

(a) a server streaming fluent random vocabulary tokens (``tests/fakes/broken_servers.py``,
    a FAKE): ``garbage-output`` by the known answers and by the reference's NLL judge;
(b) the fixture with one layer's weights scaled wrong (a recorded weight patch): answers
    degrade, ``accuracy-regression`` against the reference;
(c) the same fixture in bfloat16 against the float32 reference: ``qualified``, ties counted;
(d) a proxy that drops every tenth streamed token of a real engine: ``client-accounting``;
(e) the untrained twin: ``garbage-output`` (``tests/test_e2e_engines.py``, transformers and vLLM).

The engine behind (b), (c) and (d) is the transformers worker (real, CPU); checks outside
each case's subject are deselected with ``-k`` to keep the file to a few minutes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bakeoff.models import fixtures
from bakeoff.host.procs import free_port
from tests.fakes.launch import ChildServer

REPO = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.slow, pytest.mark.engine("transformers")]


@pytest.fixture(scope="module")
def trained() -> Path:
    return fixtures.build("tiny-qwen3")


def _suite(tmp: Path, backend: str, model: str, *opts: str, select: str | None = None) -> tuple[int, dict, str]:
    art = tmp / "art"
    cmd = [sys.executable, "-m", "pytest", "evaluations/", "-p", "no:cacheprovider", "-q", "--backend", backend,
           f"--model={model}", f"--artifacts={art}", *opts] + (["-k", select] if select else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=1500)
    runs = sorted((art / "runs").glob("*/verdict.json"))
    assert runs, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.returncode, json.loads(runs[-1].read_text()), proc.stdout


def _checks(v: dict) -> dict:
    return {c["name"]: c for c in v["checks"]}


_Server = ChildServer  # tests/fakes/launch.py


def test_a_fluent_random_vocabulary_server_is_garbage(tmp_path, trained):
    port = free_port()
    srv = _Server([sys.executable, "-m", "tests.fakes.broken_servers", "garbage", "--tokenizer", str(trained),
                   "--port", str(port)], port, tmp_path / "garbage.log")
    try:
        rc, v, out = _suite(tmp_path, "openai", str(trained), "--backend-opt", f"base_url={srv.url}",
                            select="test_load or test_sanity or test_judge")
    finally:
        srv.close()
    checks = _checks(v)
    assert rc == 1 and v["status"] == "disqualified", out[-2000:]
    ka, judge, deg = checks["sanity.known_answers"], checks["sanity.nll_judge"], checks["sanity.degeneration"]
    assert ka["status"] == "fail" and ka["failure_class"] == "garbage-output"
    assert judge["status"] == "fail" and judge["failure_class"] == "garbage-output", judge
    assert judge["values"]["nll_gap_nats"] > 2.0
    assert deg["values"]["flagged"] <= deg["values"]["outputs"] // 4  # the model-free detectors do not see it


def scale_layer(src: Path, dst: Path, tensor: str, factor: float) -> Path:
    """A copy of ``src`` with one tensor multiplied by ``factor``, the edit recorded beside it."""
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file() and f.name not in ("model.safetensors", "fixture.json"):
            shutil.copy(f, dst / f.name)
    weights = load_file(str(src / "model.safetensors"))
    before = float(weights[tensor].float().abs().mean())
    weights[tensor] = (weights[tensor].float() * factor).to(weights[tensor].dtype)
    save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "bakeoff-weight-patch.json").write_text(json.dumps(
        {"source": str(src), "tensor": tensor, "factor": factor, "mean_abs_before": before,
         "mean_abs_after": float(weights[tensor].float().abs().mean()), "why": "gallery (b): a layer scaled wrong"},
        indent=2))
    return dst


def test_b_a_layer_scaled_wrong_regresses_against_the_reference(tmp_path, trained):
    broken = scale_layer(trained, tmp_path / "scaled", "model.layers.1.self_attn.o_proj.weight", 0.0)
    rc, v, out = _suite(tmp_path, "transformers", str(broken), "--reference-model=fixture:tiny-qwen3",
                        select="test_load or test_sanity")
    checks = _checks(v)
    assert rc == 1 and v["status"] == "disqualified", out[-2000:]
    agr = checks["sanity.reference_agreement"]
    assert agr["status"] == "fail" and agr["failure_class"] == "accuracy-regression", agr["summary"]
    d = agr["values"]["decision"]
    assert d["regression"] and d["p_value"] < 0.01 and d["b"] > d["c"]
    assert checks["sanity.known_answers"]["status"] == "fail"


def test_c_bfloat16_against_the_float32_reference_passes_every_check_it_ran(tmp_path, trained):
    """The reference computes in float32 on a CPU (evaluations/reference.py); the checkpoint's bf16 through
    the same engine differs by rounding alone: every check passes, its divergences counted as ties or
    exact. The run's -k left the measurements out, so it is ``incomplete`` for that reason alone
    (evaluations/selection.py: a partial run measures, it does not qualify)."""
    from evaluations.selection import suite_checks
    from evaluations.session import MODULE_ORDER

    rc, v, out = _suite(tmp_path, "transformers", "fixture:tiny-qwen3", "--backend-opt", "dtype=bfloat16",
                        select="test_load or test_sanity or test_judge")
    checks = _checks(v)
    assert rc == 0 and not [c for c in checks.values() if c["status"] in ("fail", "error")], (v["reasons"], out[-2000:])
    ran = {"load", "load.options_effective", "sanity.known_answers", "sanity.greedy", "sanity.degeneration",
           "sanity.reference_agreement", "sanity.nll_judge", "served.nll_judge", "spec_decode.lossless"}
    assert v["left_out"] == [c for c in suite_checks(MODULE_ORDER) if c not in ran], v["left_out"]
    assert v["status"] == "incomplete" and len(v["reasons"]) == 1 and v["reasons"][0].startswith(
        "partial run: its test selection left out loadgen.calibration, sanity.tokenizer,"), v["reasons"]
    agr = checks["sanity.reference_agreement"]
    assert agr["status"] == "pass" and agr["values"]["logprobs"] is True
    vals = agr["values"]
    assert vals["exact"] + vals["tie_divergences"] + vals["real_divergences"] + vals["undetermined_divergences"] == 240
    assert vals["decision"]["regression"] is False
    judge = checks["sanity.nll_judge"]
    assert judge["status"] == "pass" and judge["values"]["top1_agreement"] > 0.95


def test_d_a_proxy_dropping_every_tenth_token_is_client_accounting(tmp_path, trained):
    up, port = free_port(), free_port()
    ready = tmp_path / "worker.ready.json"
    worker = _Server([sys.executable, "-m", "backends.transformers.worker", "--model", str(trained), "--port", str(up),
                      "--ready-file", str(ready)], up, tmp_path / "worker.log")
    proxy = _Server([sys.executable, "-m", "tests.fakes.broken_servers", "drop", "--upstream", worker.url,
                     "--port", str(port)], port, tmp_path / "proxy.log")
    try:
        rc, v, out = _suite(tmp_path, "openai", str(trained), "--backend-opt", f"base_url={proxy.url}",
                            select="test_load or test_throughput")
    finally:
        proxy.close()
        worker.close()
    checks = _checks(v)
    assert rc == 1 and v["status"] == "disqualified", out[-2000:]
    acc = checks["throughput.accounting"]
    assert acc["status"] == "fail" and acc["failure_class"] == "client-accounting", acc
    assert acc["values"]["mismatches"] > 0


def test_broken_servers_are_named_fakes():
    text = (REPO / "tests" / "fakes" / "broken_servers.py").read_text()
    assert "FAKE" in text and os.path.basename(__file__) == "test_gallery.py"


# The issue's examples: TensorRT-LLM's FP8 output on the seed project, and fluent word salad.
ISSUE_STRINGS = (" entraî match[conguàmh correctnessness entraî match[conguàmh correctnessness",
                 "ysics.ActionEvent nakne Ridgeroundedbecca.ListViewContract sustainable Hick vertically")


def test_judge_flags_the_issue_strings(tmp_path, trained):
    """The model-free detectors pass these strings; the reference's NLL judge does not."""
    import httpx

    import backends
    from bakeoff.analysis.judge import nll_verdict, pooled_nll
    from bakeoff.analysis.sanity import detectors
    from bakeoff.api.specs import BackendConfig, GenerationRequest
    from evaluations.measuring import send

    for s in ISSUE_STRINGS:
        assert detectors(s, None, 48, "length")["flags"] == []
    probes = [json.loads(x) for x in (trained / "probes.jsonl").read_text().splitlines()][::30]
    ref = backends.resolve("transformers")(BackendConfig(backend="transformers", model=str(trained),
                                                         workdir=str(tmp_path / "ref")))
    try:
        ref.start()
        own = send(ref, [GenerationRequest(request_id=f"j{i}", prompt=p["prompt"], max_tokens=48)
                         for i, p in enumerate(probes)])

        def score(prompt, **cont):
            r = httpx.post(ref.base_url + "/v1/score", json={"prompt": prompt, **cont}, timeout=60)
            r.raise_for_status()
            return r.json()["logprobs"]
        ref_lps = [score(p["prompt"], continuation_ids=o.output_token_ids) for p, o in zip(probes, own)]
        for s in ISSUE_STRINGS:
            bad_lps = [score(p["prompt"], continuation=s) for p in probes]
            status, line = nll_verdict(*pooled_nll(bad_lps), *pooled_nll(ref_lps))
            assert status == "fail", line
    finally:
        ref.stop()
