"""Bad input to ``bakeoff quantize`` and ``bakeoff jobs``: refused in one line before anything is
built, installed, rendered or sent. Split from tests/test_bad_input.py (helpers live there)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.test_bad_input import BAKEOFF, empty_cache, one_error_line, run  # noqa: F401 - empty_cache is a fixture


@pytest.fixture
def quantized_checkpoint(tmp_path) -> Path:
    d = tmp_path / "w4a16"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "qwen3", "quantization_config": {
        "quant_method": "compressed-tensors", "format": "pack-quantized"}}))
    return d


@pytest.mark.parametrize("case, message", [
    ("out-not-empty", "exists and is not empty"),
    ("out-is-a-file", "is a file; pass a new or empty folder"),
    ("out-under-a-file", "/out is not writable ("),
    ("num-samples", "--num-samples must be at least 1"),
    ("dataset", "--dataset"),
    ("unknown-fixture", "unknown fixture 'nope'"),
    ("hub-id", "quantize needs a local checkpoint folder"),
    ("already-quantized", "is already quantized"),
])
def test_quantize_refuses_before_building_or_installing(tmp_path, empty_cache, quantized_checkpoint, case, message):
    """Every refusal comes before the fixture build and llm-compressor's environment
    (both minutes; both under BAKEOFF_CACHE, which stays empty)."""
    out = tmp_path / "out"
    model = "fixture:tiny-qwen3"
    extra: list[str] = []
    if case == "out-not-empty":
        out.mkdir()
        (out / "keep.txt").write_text("mine")
    elif case == "out-is-a-file":
        out.write_text("mine")
    elif case == "out-under-a-file":
        (tmp_path / "a-file").write_text("x")
        out = tmp_path / "a-file" / "out"
    elif case == "num-samples":
        extra = ["--num-samples", "0"]
    elif case == "dataset":
        extra = ["--dataset", str(tmp_path / "missing.jsonl")]
    elif case == "unknown-fixture":
        model = "fixture:nope"
    elif case == "hub-id":
        model = "org/model"
    elif case == "already-quantized":
        model = str(quantized_checkpoint)
    before = sorted(tmp_path.rglob("*"))
    proc = run(BAKEOFF + ["quantize", "awq", "--model", model, "--out", str(out), *extra],
               env={"BAKEOFF_CACHE": str(empty_cache)})
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr
    assert message in one_error_line(proc)
    assert sorted(tmp_path.rglob("*")) == before and not any(empty_cache.iterdir())


def test_jobs_submit_refuses_unwritable_artifacts_before_asking_the_hub(tmp_path):
    """The job record is written after the (paid) submission: a folder that would refuse it is
    refused before the Hub is asked anything."""
    from fakes.hf_jobs_server import FakeHfJobsServer

    (tmp_path / "a-file").write_text("x")
    art = tmp_path / "a-file" / "art"
    env = {"HF_TOKEN": "hf_" + "0" * 32, "HF_HOME": str(tmp_path / "hf-home")}
    with FakeHfJobsServer() as srv:
        proc = run(BAKEOFF + ["jobs", "export", "ort-genai", "--model", "org/m", "--push-to", "none",
                              "--bakeoff-spec", "git+https://example.com/b.git@v1", "--endpoint", srv.url,
                              "--artifacts", str(art)], env=env)
        asked = list(srv.requests)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"artifacts folder {art / 'jobs'} is not writable" in one_error_line(proc)
    assert asked == [], asked


def test_jobs_refuse_an_unknown_fixture_before_rendering(tmp_path):
    proc = run(BAKEOFF + ["jobs", "qualify", "--backends", "vllm", "--model", "fixture:tiny-qwen4", "--dry-run"])
    assert proc.returncode == 2 and "--model: unknown fixture 'tiny-qwen4'" in one_error_line(proc)
    assert "# /// script" not in proc.stdout


def test_quantize_suggests_the_equals_form_for_its_checkpoint(tmp_path, monkeypatch, capsys):
    """The command ``bakeoff quantize`` prints to qualify its checkpoint is the ``--model=PATH`` form
    the README asks for (a path starting with ``-`` is not read as an option) and quotes paths with
    spaces; the quantization itself is a stand-in here (test_awq.py runs the real one)."""
    import shlex
    from types import SimpleNamespace

    import adapters.awq_int4
    from cli.tools import cmd_quantize

    src = tmp_path / "my model"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    out = tmp_path / "w4 a16"
    monkeypatch.setattr(adapters.awq_int4, "quantize_awq",
                        lambda *a, **k: SimpleNamespace(model_dump=lambda: {"path": str(out)}))
    args = SimpleNamespace(model=str(src), out=str(out), dataset=None, num_samples=8, mtp_as_released=False)
    assert cmd_quantize(args) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("qualify it:"))
    argv = shlex.split(line.removeprefix("qualify it:"))
    assert f"--model={out}" in argv and f"--reference-model={src}" in argv
