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
    (finished / "run.json").write_text(json.dumps({"backend": "vllm", "model": "m", "options": {}, "profile": "quick"}))
    (finished / "verdict.json").write_text(json.dumps({"status": "qualified", "finished_at": "2026-01-01T00:00:00Z"}))
    foreign = tmp_path / "runs" / "foreign"  # valid JSON, not bakeoff's shapes
    foreign.mkdir()
    (foreign / "run.json").write_text("{}")
    (foreign / "verdict.json").write_text("[]")
    empty = tmp_path / "runs" / "empty"
    empty.mkdir()
    return {"corrupt": corrupt, "finished": finished, "foreign": foreign, "empty": empty, "missing": tmp_path / "nope"}


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
    ("foreign", "run.json or verdict.json is not bakeoff's"),
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
    (["--backend", "transformers", "--repeats", "0"], "--repeats must be at least 1"),
    (["--backend", "transformers", "--start-timeout", "-5"], "--start-timeout must be a positive number"),
    (["--backend", "transformers", "--progress-timeout", "0"], "--progress-timeout must be a positive number"),
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


def _verdict_run(root: Path, name: str, verdict_text: str) -> Path:
    d = root / "runs" / name
    d.mkdir(parents=True)
    (d / "verdict.json").write_text(verdict_text)
    return d


@pytest.mark.parametrize("verdict_text, message", [
    ("[]", "verdict.json holds a list, not an object"),
    ("null", "verdict.json holds a NoneType"),
    ('{"backend": "b", "model": "m", "checks": "abc"}', "checks that are not a list"),
    ('{"backend": "b", "model": "m", "checks": [{"foo": 1}]}', "a check without a name and a status"),
    ('{"backend": "b", "model": "m", "checks": [], "options": "abc"}', "options that is not an object"),
    ("{}", "has no backend"),
])
@pytest.mark.parametrize("command", ["compare", "report"])
def test_runs_that_are_not_bakeoffs_are_refused(tmp_path, verdict_text, message, command):
    run_dir = _verdict_run(tmp_path / "in", "r1", verdict_text)
    art = tmp_path / "art"
    proc = run(BAKEOFF + [command, str(run_dir), "--artifacts", str(art)])
    assert proc.returncode == 2 and message in one_error_line(proc), proc.stderr
    binary = _verdict_run(tmp_path / "in", "r2", "")
    (binary / "verdict.json").write_bytes(b"\xff\xfe\x00garbage")
    proc = run(BAKEOFF + [command, str(binary), "--artifacts", str(art)])
    assert proc.returncode == 2 and "cannot read run directory" in one_error_line(proc)


@pytest.mark.parametrize("args, message", [
    (["qualify", "--backends", ""], "--backends names no backend"),
    (["qualify", "--backends", ","], "--backends names no backend"),
    (["qualify", "--backends", "transformers,transformers"], "names a backend twice"),
    (["qualify", "--backends", "transformers", "--model", ""], "--model is empty"),
    (["qualify", "--backends", "transformers", "--report", "../x"], "--report '../x' is not a plain name"),
    (["qualify", "--backends", "transformers", "--model", "/" + "a" * 300], "cannot be read (OSError"),
    (["report", "examples/cpu", "--name", "/tmp/x"], "--name '/tmp/x' is not a plain name"),
    (["compare", "examples/cpu", "--name", "../../escaped"], "is not a plain name"),
    (["calibrate", "--concurrency", "abc"], "--concurrency takes whole numbers"),
    (["calibrate", "--concurrency", "0"], "levels of at least 1 stream"),
    (["jobs", "qualify", "--backends", "vllm", "--flavors", ",", "--dry-run", "--model", "org/m"], "--flavors names no flavor"),
    (["jobs", "qualify", "--backends", "vllm", "--backend-opt", "nosuch=1", "--dry-run", "--model", "org/m"],
     "unknown option 'nosuch' for backend vllm"),
    (["qualify", "--backends", "vllm", "--backend-opt", "max_model_len=1", "--backend-opt", "max_model_len=2"],
     "--backend-opt max_model_len given twice"),
])
def test_more_bad_input(tmp_path, args, message):
    art = tmp_path / "art"
    extra = [] if args[0] in ("calibrate", "jobs") else ["--artifacts", str(art)]
    proc = run(BAKEOFF + args + extra)
    assert proc.returncode == 2 and message in one_error_line(proc), proc.stderr[-2000:]
    assert nothing_written(art)


def test_save_script_does_not_overwrite(tmp_path):
    precious = tmp_path / "precious.txt"
    precious.write_text("mine")
    proc = run(BAKEOFF + ["jobs", "export", "ort-genai", "--model", "org/m", "--dry-run", "--save-script", str(precious)])
    assert proc.returncode == 2 and "exists" in one_error_line(proc)
    assert precious.read_text() == "mine"


def test_cache_that_is_a_file(tmp_path):
    cache = tmp_path / "cachefile"
    cache.write_text("x")
    proc = subprocess.run(BAKEOFF + ["fixture", "build", "tiny-qwen3-untrained"], capture_output=True, text=True,
                          cwd=REPO, timeout=120, env={**__import__("os").environ, "BAKEOFF_CACHE": str(cache)})
    assert proc.returncode == 2 and "point BAKEOFF_CACHE at a folder" in one_error_line(proc)


def test_qualify_takes_relative_paths_from_the_callers_folder(tmp_path):
    """The evaluation runs with the repository as its folder: relative --model / --artifacts
    are the caller's, so they are made absolute first (a bad model here: the fast path)."""
    (tmp_path / "mymodel").mkdir()
    (tmp_path / "mymodel" / "config.json").write_text("[1, 2]")  # a config that is not an object
    proc = subprocess.run(BAKEOFF + ["qualify", "--backends", "transformers", "--model", "mymodel", "--artifacts", "art"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=600)
    runs = list((tmp_path / "art" / "runs").iterdir())
    assert len(runs) == 1, proc.stdout[-3000:] + proc.stderr[-2000:]
    v = json.loads((runs[0] / "verdict.json").read_text())
    load = next(c for c in v["checks"] if c["name"] == "load")
    # the engine's reaction to the config is the evidence, not a crash of bakeoff's own pre-flight
    assert load["status"] == "fail" and load["failure_class"] in ("load-failure", "unsupported-architecture"), load
    assert v["model_path"] == str((tmp_path / "mymodel").resolve())
