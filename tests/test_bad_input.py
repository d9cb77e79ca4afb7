"""Bad user input beyond tests/test_cli.py: one line naming the fix, exit 2 (pytest: 4), nothing written.

Covers unknown options, malformed ``--matrix`` / option values, model paths that are not
checkpoints, an artifacts folder on a read-only file system, unreadable run directories given
to ``compare`` and ``qualify --resume``, and options that conflict with ``--resume``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BAKEOFF = [sys.executable, "-m", "bakeoff.cli"]
PYTEST = [sys.executable, "-m", "pytest", "evaluations/", "-p", "no:cacheprovider"]


def run(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=120)


def one_error_line(proc: subprocess.CompletedProcess, prefix: str = "bakeoff: error: ") -> str:
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(prefix), proc.stderr
    return lines[0]


def nothing_written(root: Path) -> bool:
    return not root.exists() or not any(root.rglob("*"))


@pytest.fixture
def bad_runs(tmp_path) -> dict[str, Path]:
    """Run directories a user might point at by mistake."""
    corrupt = tmp_path / "runs" / "corrupt"
    corrupt.mkdir(parents=True)
    (corrupt / "run.json").write_text("{}")
    (corrupt / "verdict.json").write_text('{"status": "qual')  # cut mid-write by another tool
    finished = tmp_path / "runs" / "finished"
    finished.mkdir()
    (finished / "run.json").write_text("{}")
    (finished / "verdict.json").write_text(json.dumps({"status": "qualified", "finished_at": "2026-01-01T00:00:00Z"}))
    empty = tmp_path / "runs" / "empty"
    empty.mkdir()
    return {"corrupt": corrupt, "finished": finished, "empty": empty, "missing": tmp_path / "nope"}


@pytest.mark.parametrize("args, message", [
    (["qualify", "--backends", "transformers", "--frobnicate"], "unrecognized arguments: --frobnicate"),
    (["qualify", "--backends", "vllm", "--matrix", "oops"], "malformed --matrix 'oops': expected key=v1,v2"),
    (["qualify", "--backends", "vllm", "--matrix", "=1,2"], "malformed --matrix '=1,2'"),
    (["qualify", "--backends", "vllm", "--matrix", "speculative=warp"], "unknown --matrix value speculative='warp'; choose from"),
    (["qualify", "--backends", "vllm", "--backend-opt", "max_model_len=abc"], "bad value for option 'max_model_len' of backend vllm"),
    (["qualify", "--backends", "transformers", "--backend-opt", "trust_remote_code=maybe"], "bad value for option 'trust_remote_code'"),
    (["qualify", "--backends", "transformers", "--repeats", "0"], "--repeats must be at least 1"),
    (["qualify", "--backends", "vllm,,nope"], "unknown backend 'nope'"),
])
def test_qualify_bad_options(tmp_path, args, message):
    art = tmp_path / "art"
    proc = run(BAKEOFF + args + ["--artifacts", str(art)])
    assert proc.returncode == 2, proc.stderr
    assert message in one_error_line(proc)
    assert nothing_written(art)


@pytest.mark.parametrize("kind, message", [
    ("file", "is a file; pass the checkpoint folder that holds config.json"),
    ("no-config", "has no config.json; pass a Hugging Face checkpoint folder"),
])
def test_model_path_that_is_not_a_checkpoint(tmp_path, kind, message):
    model = tmp_path / "model"
    if kind == "file":
        model.write_text("weights?")
    else:
        model.mkdir()
    art = tmp_path / "art"
    proc = run(BAKEOFF + ["qualify", "--backends", "transformers", "--model", str(model), "--artifacts", str(art)])
    assert proc.returncode == 2 and message in one_error_line(proc)
    assert nothing_written(art)
    proc = run(PYTEST + ["--backend", "transformers", "--model", str(model), "--artifacts", str(art)])
    assert proc.returncode == 4 and message in one_error_line(proc, "ERROR: ")
    assert nothing_written(art)


@pytest.fixture
def read_only_dir(tmp_path):
    """A read-only tmpfs: not writable even for root (skipped where mounting is refused)."""
    mnt = tmp_path / "ro"
    mnt.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(mnt)], capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs: {res.stderr.strip() or res.returncode}")
    yield mnt
    subprocess.run(["umount", str(mnt)], capture_output=True)


def test_artifacts_on_read_only_file_system(read_only_dir):
    proc = run(BAKEOFF + ["qualify", "--backends", "transformers", "--model", "fixture:tiny-qwen3-untrained",
                          "--artifacts", str(read_only_dir / "art")])
    assert proc.returncode == 2
    line = one_error_line(proc)
    assert "is not writable (Read-only file system)" in line and "--artifacts DIR" in line
    proc = run(PYTEST + ["--backend", "transformers", "--model", "fixture:tiny-qwen3-untrained",
                         "--artifacts", str(read_only_dir)])
    assert proc.returncode == 4 and "is not writable" in one_error_line(proc, "ERROR: ")
    assert not any(read_only_dir.iterdir())


@pytest.mark.parametrize("which, message", [
    ("missing", "cannot read run directory"),
    ("corrupt", "pass folders that hold a verdict.json"),
    ("empty", "no verdict.json in it or below it"),
])
def test_compare_unreadable_runs(tmp_path, bad_runs, which, message):
    art = tmp_path / "art"
    proc = run(BAKEOFF + ["compare", str(bad_runs[which]), "--artifacts", str(art)])
    assert proc.returncode == 2, proc.stderr
    assert message in one_error_line(proc)
    assert nothing_written(art)


@pytest.mark.parametrize("extra, message", [
    (["--backends", "vllm"], "--resume continues a run with its own settings; drop --backends"),
    (["--model", "fixture:tiny-qwen3"], "drop --model"),
    (["--backends", "vllm", "--backend-opt", "dtype=float32"], "drop --backends, --backend-opt"),
    (["--matrix", "prefix_cache=on,off"], "drop --matrix"),
])
def test_resume_conflicts_with_run_settings(bad_runs, extra, message):
    proc = run(BAKEOFF + ["qualify", "--resume", str(bad_runs["corrupt"]), *extra])
    assert proc.returncode == 2 and message in one_error_line(proc)
    assert sorted(p.name for p in bad_runs["corrupt"].iterdir()) == ["run.json", "verdict.json"]


@pytest.mark.parametrize("which, message", [
    ("missing", "not a readable run directory (FileNotFoundError"),
    ("corrupt", "not a readable run directory (JSONDecodeError"),
    ("empty", "not a readable run directory"),
    ("finished", "finished (qualified); nothing to resume"),
])
def test_resume_unusable_run(bad_runs, which, message):
    before = sorted(bad_runs["finished"].parent.rglob("*"))
    proc = run(BAKEOFF + ["qualify", "--resume", str(bad_runs[which])])
    assert proc.returncode == 2
    assert message in one_error_line(proc)
    assert sorted(bad_runs["finished"].parent.rglob("*")) == before


@pytest.mark.parametrize("args, message", [
    (["--backend", "transformers", "--backend-opt", "batching=sometimes"], "bad value for option 'batching'"),
    (["--backend", "transformers", "--memory-limit-gib", "0"], "--memory-limit-gib must be a positive number of GiB"),
    (["--backend", "transformers", "--profile", "huge"], "unknown profile 'huge'"),
    (["--backend", "transformers", "--min-probe-accuracy", "2"], "--min-probe-accuracy must be between 0 and 1"),
])
def test_pytest_plugin_bad_options(tmp_path, args, message):
    art = tmp_path / "art"
    proc = run(PYTEST + ["--artifacts", str(art), "--model", "fixture:tiny-qwen3-untrained", *args])
    assert proc.returncode == 4, proc.stdout[-2000:] + proc.stderr
    assert message in one_error_line(proc, "ERROR: ")
    assert nothing_written(art)


def test_pytest_resume_unreadable_run(bad_runs):
    proc = run(PYTEST + ["--resume", str(bad_runs["corrupt"])])
    assert proc.returncode == 4
    assert "cannot resume" in one_error_line(proc, "ERROR: ")
