"""Issue 53's doubles: servers right when alone and wrong only where they are served, each run through the
real suite (``pytest evaluations/ --backend openai``) and disqualified with the condition named; the honest
double, the same proxy breaking nothing, passes every check.

The doubles are FAKE proxies (``tests/fakes/served_doubles.py``) in front of the real transformers worker
serving the trained fixture ``tiny-qwen3`` (float32, the reference's dtype), started once for the module.
Each case selects with ``-k`` the checks its condition reaches (the probes where a check compares with
them); a partial run with a failure is ``disqualified`` all the same. The honest run is the twin the
``turn3`` double is judged against (``--baseline-run``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bakeoff.host.procs import free_port
from bakeoff.models.resolve import resolve
from tests.fakes.launch import ChildServer, transformers_worker

REPO = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.slow, pytest.mark.engine("transformers")]
NEW_CHECKS = ("served.under_load", "served.batch_invariance", "prefix_cache.correctness", "served.nll_judge")


@pytest.fixture(scope="module")
def model() -> Path:
    return Path(resolve("fixture:tiny-qwen3").path)


@pytest.fixture(scope="module")
def engine_url(model, tmp_path_factory):
    """The transformers worker serving the fixture (float32), for the module."""
    with transformers_worker(model, tmp_path_factory.mktemp("engine")) as url:
        yield url


def _double(mode: str, upstream: str, model: Path, log: Path) -> ChildServer:
    """A served double in front of ``upstream`` until closed."""
    port = free_port()
    return ChildServer([sys.executable, "-m", "tests.fakes.served_doubles", mode, "--upstream", upstream,
                        "--tokenizer", str(model), "--port", str(port)], port, log, timeout_s=60)


def _suite(tmp: Path, mode: str, upstream: str, model: Path, *opts: str, select: str | None = None):
    """The suite against the ``mode`` double: ``(exit code, verdict, run directory, stdout)``."""
    double = _double(mode, upstream, model, tmp / f"{mode}.log")
    art = tmp / "art"
    try:
        cmd = [sys.executable, "-m", "pytest", "evaluations/", "-p", "no:cacheprovider", "-q", "--backend", "openai",
               f"--model={model}", f"--artifacts={art}", "--backend-opt", f"base_url={double.url}", *opts]
        proc = subprocess.run(cmd + (["-k", select] if select else []), capture_output=True, text=True, cwd=REPO,
                              timeout=1200)
    finally:
        double.close()
    runs = sorted((art / "runs").glob("*/verdict.json"))
    assert runs, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.returncode, json.loads(runs[-1].read_text()), runs[-1].parent, proc.stdout


def _checks(v: dict) -> dict:
    return {c["name"]: c for c in v["checks"]}


def _failed(v: dict) -> dict[str, str]:
    return {c["name"]: c["failure_class"] for c in v["checks"] if c["status"] in ("fail", "error")}


@pytest.fixture(scope="module")
def honest(model, engine_url, tmp_path_factory):
    return _suite(tmp_path_factory.mktemp("honest"), "honest", engine_url, model)


def test_the_honest_double_passes_every_check(honest):
    rc, v, run, out = honest
    checks = _checks(v)
    assert not _failed(v) and v["status"] == "qualified", (v["reasons"], out[-3000:])
    for name in NEW_CHECKS:
        assert checks[name]["status"] == "pass", checks[name]
    ul = checks["served.under_load"]["values"]
    assert ul["probe_agreement"]["real"] == 0 and ul["length"]["within"] and ul["contract_violations"] == 0
    assert all(not p["fails"] for p in ul["sweep_agreement"])
    pc = checks["prefix_cache.correctness"]["values"]
    assert pc["warm_hits_tokens"] > 0 and pc["cancelled"] == pc["prompts"]  # hits proven, every cancel made
    assert checks["served.twin"]["status"] == "skip" and "no twin run" in checks["served.twin"]["summary"]


def test_wrong_only_at_8_in_flight_names_the_concurrency(tmp_path, model, engine_url):
    rc, v, run, out = _suite(tmp_path, "load8", engine_url, model, select="test_load or test_sanity or test_batch_invariance")
    failed = _failed(v)
    assert rc == 1 and v["status"] == "disqualified", out[-2000:]
    bi = _checks(v)["served.batch_invariance"]
    assert bi["status"] == "fail" and bi["failure_class"] == "accuracy-regression", bi
    assert "alone (1 in flight)" in bi["summary"] and "against the batched run" in bi["summary"]
    assert bi["values"]["alone"]["real"] >= bi["values"]["alone"]["decision"]["smallest_failing"]
    assert failed.get("sanity.known_answers") in ("garbage-output", "accuracy-regression"), failed


def test_wrong_only_on_a_hit_after_a_cancelled_request_is_cache_correctness(tmp_path, model, engine_url):
    rc, v, run, out = _suite(tmp_path, "cancel_hit", engine_url, model, select="test_load or test_hit_equals_miss")
    pc = _checks(v)["prefix_cache.correctness"]
    assert rc == 1 and v["status"] == "disqualified", out[-2000:]
    assert pc["status"] == "fail" and pc["failure_class"] == "cache-correctness", pc
    assert "after stop-string and cancelled traffic" in pc["summary"] and pc["values"]["cancelled"] > 0
    assert _failed(v) == {"prefix_cache.correctness": "cache-correctness"}


def test_wrong_only_with_speculation_fails_lossless(tmp_path, model, engine_url):
    rc, v, run, out = _suite(tmp_path, "spec", engine_url, model, select="test_load or test_acceptance or test_spec_lossless")
    checks = _checks(v)
    assert rc == 1 and v["status"] == "disqualified", out[-2000:]
    assert checks["spec_decode.acceptance"]["status"] == "pass", checks["spec_decode.acceptance"]  # it drafts and accepts
    lossless = checks["spec_decode.lossless"]
    assert lossless["status"] == "fail" and lossless["failure_class"] == "accuracy-regression", lossless
    assert "speculative decoding changes greedy outputs" in lossless["summary"]
    assert _failed(v) == {"spec_decode.lossless": "accuracy-regression"}


def test_wrong_from_turn_3_is_named_against_the_twin(tmp_path, model, engine_url, honest):
    rc, v, run, out = _suite(tmp_path, "turn3", engine_url, model, f"--baseline-run={honest[2]}",
                             select="test_load or test_twin")
    twin = _checks(v)["served.twin"]
    assert rc == 1 and v["status"] == "disqualified", out[-2000:]
    assert twin["status"] == "fail" and twin["failure_class"] == "accuracy-regression", twin
    assert "agents' turns from turn 3 on" in twin["summary"], twin["summary"]
    turns = twin["values"]["turns"]
    assert turns["1"]["real"] == turns["2"]["real"] == 0 and turns["3"]["real"] > 0, turns


def test_repeating_tokens_under_load_reads_faster_and_fails(tmp_path, model, engine_url):
    rc, v, run, out = _suite(tmp_path, "repeat", engine_url, model,
                             select="test_load or test_sanity or test_sweep or test_accounting or test_under_load "
                                    "or test_served_nll_judge")
    checks = _checks(v)
    assert rc == 1 and v["status"] == "disqualified", out[-2000:]
    ul = checks["served.under_load"]
    assert ul["status"] == "fail" and "sessions" in ul["summary"], ul
    assert checks["served.nll_judge"]["status"] == "fail" and checks["served.nll_judge"]["failure_class"] == "garbage-output"
    assert checks["throughput.accounting"]["status"] == "pass"  # its usage counts what it streamed: consistent
    assert checks["sanity.known_answers"]["status"] == "pass"  # right when alone


def test_counting_twice_the_tokens_is_client_accounting(tmp_path, model, engine_url):
    rc, v, run, out = _suite(tmp_path, "double_count", engine_url, model, select="test_load or test_sweep or test_accounting")
    acc = _checks(v)["throughput.accounting"]
    assert rc == 1 and acc["status"] == "fail" and acc["failure_class"] == "client-accounting", acc
