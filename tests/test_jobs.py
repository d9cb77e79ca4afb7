"""bakeoff jobs: rendering, submission through the REAL huggingface_hub client against a FAKE
Jobs server (tests/fakes/hf_jobs_server.py), and the rendered script run for real with ``uv run``."""

from __future__ import annotations

import base64
import json
import os
import secrets
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

from cli.main import main
from cli.jobs import render
from cli.jobs.specs import ExportTask, JobTask, PushTarget
from fakes.hf_jobs_server import FakeHfJobsServer

REPO = Path(__file__).resolve().parent.parent
UV = Path(sys.executable).with_name("uv")


@pytest.fixture
def token(monkeypatch, tmp_path) -> str:
    """A planted HF_TOKEN (random) that must never appear in anything bakeoff writes."""
    value = "hf_" + secrets.token_hex(16)
    monkeypatch.setenv("HF_TOKEN", value)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    return value


def _no_token_in(root: Path, value: str) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and value.encode() in p.read_bytes()]


def _metadata(script: str) -> dict:
    block = script.split("# /// script\n", 1)[1].split("# ///\n", 1)[0]
    return tomllib.loads("\n".join(line[2:] for line in block.splitlines()))


def _task(model="fixture:tiny-qwen3", push="none") -> JobTask:
    return JobTask(kind="export", tag="t", model=model, push_to=PushTarget.parse(push),
                   export=ExportTask(pipeline="ort-genai", options={"precision": "int4", "block_size": 32}))


def test_rendered_script_pins_bakeoff_and_the_engine():
    meta = _metadata(render.render_script(_task(), "git+https://example.com/bakeoff.git@v1", "pytorch-cpu"))
    deps = meta["dependencies"]
    assert deps[0] == "bakeoff @ git+https://example.com/bakeoff.git@v1"
    assert "onnxruntime-genai==0.18.0" in deps and "torch==2.13.0" in deps
    assert meta["tool"]["uv"]["sources"]["torch"] == {"index": "pytorch-cpu"}
    local = _metadata(render.render_script(_task(), str(REPO), "pypi"))
    assert local["dependencies"][0] == "bakeoff" and local["tool"]["uv"]["sources"]["bakeoff"]["path"] == str(REPO)
    assert "index" not in local["tool"]["uv"]
    assert _metadata(render.render_script(_task(), None, "pypi"))["dependencies"][0] == "bakeoff==0.1.0"
    assert render.torch_index_for("cpu-xl") == "pytorch-cpu" and render.torch_index_for("l40sx1") == "pypi"


@pytest.mark.parametrize("argv, words", [
    (["export", "ort-genai", "--flavor", "gpu-huge", "--dry-run"], "unknown flavor"),
    (["export", "ort-genai", "--timeout", "soon", "--dry-run"], "timeout"),
    (["export", "ort-genai", "--env", "HF_TOKEN=x", "--dry-run"], "--secret"),
    (["export", "ort-genai", "--push-to", "not a repo", "--dry-run"], "--push-to"),
    (["export", "ort-genai", "--block-size", "-4", "--dry-run"], "block_size"),
    (["export", "ort-genai", "--bakeoff-spec", "/no/such/dir", "--dry-run"], "no such folder"),
    (["export", "ort-genai", "--push-to", "me/x", "--bakeoff-spec", str(REPO)], "cannot reach"),
    (["export", "ort-genai"], "--push-to"),
    (["qualify", "--backends", "nope", "--dry-run"], "unknown backend"),
    (["export", "optimum-onnx", "--weight-format", "int4", "--dry-run"], "not an option of the optimum-onnx export"),
    (["export", "openvino", "--precision", "int4", "--dry-run"], "--precision: not an option of the openvino"),
    (["export", "optimum-onnx", "--extra-option", "a=b", "--dry-run"], "--extra-option: not an option"),
    (["export", "openvino", "--weight-format", "int3", "--dry-run"], "weight_format"),
    (["export", "openvino", "--ratio", "0.5", "--group-size", "64", "--dry-run"], "apply to weight_format int4 only"),
    (["export", "openvino", "--weight-format", "int8", "--ratio", "0.5", "--dry-run"], "int4 only (got int8)"),
    (["export", "openvino", "--sym", "--dry-run"], "sym applies to int4/int8"),
    (["export", "openvino", "--weight-format", "int4", "--group-size", "0", "--dry-run"], "group_size 0"),
    (["export", "optimum-onnx", "--precision", "int4", "--dry-run"], "precision"),
    (["fetch"], "--from"),
])
def test_bad_input_is_one_line(capsys, argv, words):
    assert main(["jobs", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words in err, err


def test_dry_run_prints_script_and_request_without_the_token(capsys, tmp_path, token):
    saved = tmp_path / "job.py"
    rc = main(["jobs", "export", "ort-genai", "--model", "fixture:tiny-qwen3", "--moe-quant-type", "int4",
               "--push-to", "me/exported", "--flavor", "cpu-xl", "--timeout", "45m", "--secret", "HF_TOKEN",
               "--dry-run", "--save-script", str(saved)])
    out = capsys.readouterr().out
    assert rc == 0 and token not in out and token not in saved.read_text()
    assert "# /// script" in out and '"flavor": "cpu-xl"' in out and '"HF_TOKEN": "***REDACTED***"' in out
    task = saved.read_text().split("TASK = ", 1)[1]
    assert "'moe_quant_type': 'int4'" in task and "'repo_id': 'me/exported'" in task


@pytest.mark.parametrize("argv, want", [
    (["openvino", "--weight-format", "int4", "--group-size", "64", "--ratio", "0.8", "--sym"],
     {"weight_format": "int4", "group_size": 64, "ratio": 0.8, "sym": True}),
    (["openvino"], {}),  # the adapter's defaults (fp16), nothing forced by the CLI
    (["optimum-onnx", "--precision", "int8", "--opset", "17"], {"precision": "int8", "opset": 17}),
    (["optimum-onnx"], {}),  # fp32, not the ort-genai default int4
    (["ort-genai", "--extra-option", "exclude_mtp=true"], {"extra_options": {"exclude_mtp": "true"}}),
])
def test_optimum_exports_take_their_own_options(capsys, tmp_path, argv, want):
    saved = tmp_path / "job.py"
    rc = main(["jobs", "export", *argv, "--model", "fixture:tiny-qwen3", "--push-to", "me/exported", "--dry-run",
               "--save-script", str(saved)])
    assert rc == 0, capsys.readouterr().err
    task = saved.read_text().split("TASK = ", 1)[1]
    assert f"'pipeline': '{argv[0]}'" in task
    assert ("'options': " + repr(want)) in task, task[:600]


def test_matrix_submission_sends_flavor_timeout_and_secret_names(capsys, tmp_path, token):
    art = tmp_path / "artifacts"
    with FakeHfJobsServer() as srv:
        rc = main(["jobs", "qualify", "--backends", "transformers", "--flavors", "l40sx1,a10g-small,a100-large",
                   "--push-to", "datasets/tester/bake", "--secret", "HF_TOKEN", "--timeout", "2h",
                   "--env", "OMP_NUM_THREADS=8", "--bakeoff-spec", "git+https://example.com/b.git@v1",
                   "--endpoint", srv.url, "--artifacts", str(art)])
        posts = srv.of("POST", "/api/jobs/tester")
    out = capsys.readouterr().out
    assert rc == 0 and len(posts) == 3
    assert [p["json"]["flavor"] for p in posts] == ["l40sx1", "a10g-small", "a100-large"]
    for p in posts:
        spec = p["json"]
        assert spec["timeoutSeconds"] == 7200
        assert sorted(spec["secrets"]) == ["HF_TOKEN"]  # the name; the value goes only to the Jobs API
        assert p["authorization"] == f"Bearer {token}"  # the token came from the environment
        assert spec["environment"]["OMP_NUM_THREADS"] == "8" and spec["dockerImage"].startswith("ghcr.io/astral-sh/uv")
        assert spec["command"][:4] == ["uv", "run", "sh", "-c"]
        script = base64.b64decode(spec["environment"]["BAKEOFF_JOB_SCRIPT_B64"]).decode()
        assert f"'flavor': '{spec['flavor']}'" in script and token not in script
        assert spec["labels"]["bakeoff"] == "qualify" and spec["labels"]["bakeoff-flavor"] == spec["flavor"]
    assert "l40sx1: $1.8/h, at most $3.60 for 2h" in out and "a10g-small: cost unknown" in out
    records = sorted((art / "jobs").glob("*.json"))
    assert len(records) == 3 and not _no_token_in(art, token) and token not in out


def test_status_logs_wait_cancel(capsys, tmp_path, token):
    with FakeHfJobsServer(log_lines=["exporting", f"a tool printed HF_TOKEN={token}", "done"]) as srv:
        assert main(["jobs", "export", "ort-genai", "--push-to", "tester/out", "--secret", "HF_TOKEN",
                     "--endpoint", srv.url, "--artifacts", str(tmp_path)]) == 0
        job_id = next(iter(srv.jobs))
        capsys.readouterr()
        assert main(["jobs", "status", job_id, "--endpoint", srv.url]) == 0
        assert json.loads(capsys.readouterr().out)["stage"] == "SCHEDULING"
        assert main(["jobs", "logs", job_id, "--follow", "--endpoint", srv.url]) == 0
        logs = capsys.readouterr().out
        assert main(["jobs", "wait", job_id, "--poll-s", "0.05", "--endpoint", srv.url]) == 0
        assert json.loads(capsys.readouterr().out)["stage"] == "COMPLETED"
        assert main(["jobs", "cancel", job_id, "--endpoint", srv.url]) == 0
        assert srv.of("POST", f"/api/jobs/tester/{job_id}/cancel")
        main(["jobs", "status", job_id, "--endpoint", srv.url])
        assert json.loads(capsys.readouterr().out.splitlines()[-1])["stage"] == "CANCELED"
        assert main(["jobs", "hardware", "--endpoint", srv.url]) == 0
        assert "l40sx1" in capsys.readouterr().out
        assert srv.of("GET", f"/api/jobs/tester/{job_id}/logs")
    assert "exporting" in logs and "done" in logs and token not in logs and "***REDACTED***" in logs
    (tmp_path / "logs.txt").write_text(logs)
    assert not _no_token_in(tmp_path, token)


def _seed_runs(folder: Path, token: str) -> None:
    for flavor, gpu in (("l40sx1", "NVIDIA L40S"), ("a10g-small", "NVIDIA A10G")):
        run = folder / f"jobs/tag-{flavor}/runs/20261130T000000Z_vllm_tiny-qwen3_{flavor[:3]}"
        (run / "checks").mkdir(parents=True)
        (run / "verdict.json").write_text(json.dumps({
            "run_id": run.name, "backend": "vllm", "model": "fixture:tiny-qwen3", "status": "qualified", "checks": [],
            "fingerprint": {"gpus": [{"name": gpu}], "env": {"HF_TOKEN": token}}}))
        (run / "engine.log").write_text(f"Authorization: Bearer {token}\n")


def test_fetch_from_the_hub_and_from_a_folder(capsys, tmp_path, token):
    repo = tmp_path / "repo"
    _seed_runs(repo, token)
    art = tmp_path / "artifacts"
    with FakeHfJobsServer() as srv:
        srv.repos["datasets/tester/bake"] = repo
        assert main(["jobs", "fetch", "--from", "datasets/tester/bake", "--endpoint", srv.url,
                     "--artifacts", str(art)]) == 0
        assert srv.of("GET", "/api/datasets/tester/bake/revision/") and srv.of("GET", "/datasets/tester/bake/resolve/")
    runs = sorted(p.name for p in (art / "runs").iterdir())
    assert len(runs) == 2 and not _no_token_in(art, token)
    gpus = {json.loads((art / "runs" / r / "verdict.json").read_text())["fingerprint"]["gpus"][0]["name"] for r in runs}
    assert gpus == {"NVIDIA L40S", "NVIDIA A10G"}  # machines side by side for report/compare
    assert main(["jobs", "fetch", "--from", f"file://{repo}", "--artifacts", str(art)]) == 0
    assert "already here (kept)" in capsys.readouterr().out  # never overwritten
    assert main(["report", str(art / "runs"), "--artifacts", str(art)]) == 0


def _export_model() -> str:
    from bakeoff.models import fixtures

    # The Done-when fixture when it is built; its untrained twin (same architecture and
    # export path) otherwise, so that this test never spends minutes training.
    return "fixture:tiny-qwen3" if fixtures.is_built("tiny-qwen3") else "fixture:tiny-qwen3-untrained"


@pytest.mark.slow
@pytest.mark.skipif(not UV.exists(), reason="uv is not installed in the main venv (pip install uv)")
def test_uv_run_of_the_dry_run_script_exports_like_the_adapter(capsys, tmp_path, token):
    """The rendered script under ``uv run`` does a real ORT GenAI INT4 export and writes the adapter's files."""
    from adapters.ort_genai_export import ExportOptions, export
    from bakeoff.models import fixtures

    model = _export_model()
    script, pushed = tmp_path / "job.py", tmp_path / "pushed"
    assert main(["jobs", "export", "ort-genai", "--model", model, "--push-to", f"file://{pushed}", "--dry-run",
                 "--bakeoff-spec", str(REPO), "--torch-index", "pypi", "--save-script", str(script)]) == 0
    cache = tmp_path / "cache"  # a fresh bakeoff cache: the job finds the engine preinstalled in its uv env and exports for real
    cache.mkdir()
    (cache / "fixtures").symlink_to(fixtures.cache_root(), target_is_directory=True)
    fixtures.build(model.split(":", 1)[1], log=lambda s: None)
    env = dict(os.environ, BAKEOFF_CACHE=str(cache), UV_FIND_LINKS="/opt/wheels", UV_PYTHON=sys.base_prefix + "/bin/python3")
    t0 = time.monotonic()
    proc = subprocess.Popen([str(UV), "run", "--quiet", str(script), "--out", str(tmp_path / "out")], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    local = export(fixtures.folder_for(model.split(":", 1)[1]), ExportOptions(precision="int4"), log=lambda s: None)
    log = proc.communicate(timeout=900)[0]
    (tmp_path / "uv-run.log").write_text(log)
    assert proc.returncode == 0, log[-3000:]
    job = json.loads((tmp_path / "out" / "bakeoff-job.json").read_text())
    assert job["status"] == "ok" and job["export"]["cached"] is False, job
    adapter_files = sorted(str(p.relative_to(Path(local.output_dir).parent))
                           for p in Path(local.output_dir).parent.rglob("*") if p.is_file())
    job_files = sorted(f for f in job["files"] if f != "bakeoff-job.json")
    assert job_files == adapter_files
    assert json.loads((tmp_path / "out/model/genai_config.json").read_text()) == json.loads(
        (Path(local.output_dir) / "genai_config.json").read_text())
    assert sorted(str(p.relative_to(pushed)) for p in pushed.rglob("*") if p.is_file()) == sorted(job["files"])
    assert "ort-genai: using this interpreter's packages" in log and not _no_token_in(tmp_path, token)
    print(f"uv run export of {model}: {time.monotonic() - t0:.0f} s, {len(job_files)} files")


def test_openvino_job_on_a_cpu_flavor_takes_torchvision_from_torchs_cpu_index():
    """The index's torchvision is a CUDA build that breaks transformers beside a CPU torch
    (docs/field-notes.md); the adapter's environment uninstalls it, a job pins it to torch's index."""
    task = JobTask(kind="export", tag="t", model="fixture:tiny-qwen3", push_to=PushTarget.parse("none"),
                   export=ExportTask(pipeline="openvino", options={}))
    cpu = render.render_script(task, None, render.torch_index_for("cpu-xl"))
    assert '#     "torchvision",' in cpu
    assert '# torch = { index = "pytorch-cpu" }' in cpu and '# torchvision = { index = "pytorch-cpu" }' in cpu
    gpu = render.render_script(task, None, render.torch_index_for("l40sx1"))
    assert "pytorch-cpu" not in gpu  # CUDA torch and torchvision, both from the default index
