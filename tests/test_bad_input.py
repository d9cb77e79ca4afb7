"""Bad user input beyond tests/test_cli.py: one line naming the fix, exit 2 (pytest: 4), nothing written.

Covers unknown options, malformed ``--matrix`` / option values, model paths that are not
checkpoints, unwritable output folders (refused before a fixture is built: issue 15),
unreadable run directories given to ``compare`` and ``qualify --resume``, and options that
conflict with ``--resume``. Every command runs with an empty ``BAKEOFF_CACHE`` that must stay
empty: bad input builds no fixture and creates no engine environment.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BAKEOFF = [sys.executable, "-m", "cli.main"]
PYTEST = [sys.executable, "-m", "pytest", "evaluations/", "-p", "no:cacheprovider"]


def run(cmd: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``cmd`` from the repository with a fresh, empty ``BAKEOFF_CACHE`` (unless ``env``
    names one) and check that it is still empty afterwards: nothing was built or cached."""
    with tempfile.TemporaryDirectory(prefix="bakeoff-cache-") as cache:
        full = {**os.environ, "BAKEOFF_CACHE": cache, **(env or {})}
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=120, env=full)
        assert not os.listdir(cache), f"bad input built or cached {os.listdir(cache)}:\n{proc.stdout[-2000:]}{proc.stderr}"
    return proc


ERROR_LINE = re.compile(r"bakeoff(?: [a-z-]+)*: error: ")  # `bakeoff: error:` or the parser's `bakeoff qualify: error:`


def one_error_line(proc: subprocess.CompletedProcess, prefix: str = "bakeoff: error: ") -> str:
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    ok = ERROR_LINE.match(lines[0]) if lines and prefix == "bakeoff: error: " else lines and lines[0].startswith(prefix)
    assert len(lines) == 1 and ok, proc.stderr
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


def _try(cmd: list[str]) -> str | None:
    """Run a set-up command; its error (None when it worked)."""
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except OSError as exc:
        return str(exc)
    return None if res.returncode == 0 else (res.stderr.strip() or f"exit {res.returncode}")


@pytest.fixture(params=["read-only-mount", "immutable", "under-a-file", "no-write-permission"])
def unwritable(request, tmp_path) -> Path:
    """A folder nobody may write into. Root ignores permission bits (and CI runs as root), so
    besides mode 0555 (non-root only) it is a read-only tmpfs, an immutable folder
    (``chattr +i``) or a path below a regular file; a kind this host cannot make skips, saying why."""
    kind = request.param
    if kind == "under-a-file":
        (tmp_path / "a-file").write_text("x")
        return tmp_path / "a-file" / "art"
    folder = tmp_path / kind
    folder.mkdir()
    if kind == "read-only-mount":
        err = _try(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(folder)])
        if err:
            pytest.skip(f"cannot mount a read-only tmpfs here: {err}")
        request.addfinalizer(lambda: _try(["umount", str(folder)]))
    elif kind == "immutable":
        err = _try(["chattr", "+i", str(folder)])
        if err:
            pytest.skip(f"cannot make an immutable folder here (chattr +i): {err}")
        request.addfinalizer(lambda: _try(["chattr", "-i", str(folder)]))
    else:
        if os.geteuid() == 0:
            pytest.skip("running as root, which writes through mode 0555; the read-only mount, immutable "
                        "and under-a-file cases cover root")
        folder.chmod(0o555)
        request.addfinalizer(lambda: folder.chmod(0o755))
    return folder


@pytest.fixture
def empty_cache(tmp_path) -> Path:
    """A fresh ``BAKEOFF_CACHE``: no fixture is built, no engine environment exists."""
    cache = tmp_path / "cache"
    cache.mkdir()
    return cache


def test_qualify_refuses_unwritable_artifacts_before_building_the_fixture(unwritable, empty_cache):
    """Issue 15: an uncached fixture and an artifacts folder that refuses writes: one line,
    exit 2, within seconds; no fixture trained, nothing in the cache, no run directory."""
    proc = run(BAKEOFF + ["qualify", "--backends", "transformers", "--model", "fixture:tiny-qwen3",
                          "--artifacts", str(unwritable / "art")], env={"BAKEOFF_CACHE": str(empty_cache)})
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr
    line = one_error_line(proc)
    assert f"artifacts folder {unwritable / 'art'} is not writable (" in line and "--artifacts DIR" in line
    assert "[fixture]" not in proc.stdout and "qualifying" not in proc.stdout
    assert not any(empty_cache.iterdir()) and nothing_written(unwritable)


def test_pytest_refuses_unwritable_artifacts_before_building_the_fixture(unwritable, empty_cache):
    proc = run(PYTEST + ["--backend=transformers", f"--artifacts={unwritable}", "--model=fixture:tiny-qwen3"],
               env={"BAKEOFF_CACHE": str(empty_cache)})
    assert proc.returncode == 4, proc.stdout[-2000:] + proc.stderr
    line = one_error_line(proc, "ERROR: ")
    assert f"artifacts folder {unwritable} is not writable (" in line and "--artifacts DIR" in line
    assert "fixture tiny-qwen3: building" not in proc.stdout
    assert not any(empty_cache.iterdir()) and nothing_written(unwritable)


@pytest.mark.parametrize("command", ["qualify", "pytest"])
def test_runs_folder_that_is_a_file_is_refused_before_the_build(tmp_path, empty_cache, command):
    art = tmp_path / "art"
    art.mkdir()
    (art / "runs").write_text("not a folder")
    cmd = (BAKEOFF + ["qualify", "--backends", "transformers", "--artifacts", str(art)] if command == "qualify"
           else PYTEST + ["--backend=transformers", f"--artifacts={art}"])
    proc = run(cmd + ["--model=fixture:tiny-qwen3"], env={"BAKEOFF_CACHE": str(empty_cache)})
    assert proc.returncode == (2 if command == "qualify" else 4), proc.stderr
    line = one_error_line(proc, "bakeoff: error: " if command == "qualify" else "ERROR: ")
    assert f"{art / 'runs'} is not writable (a file, not a folder)" in line
    assert sorted(p.name for p in art.iterdir()) == ["runs"] and not any(empty_cache.iterdir())


@pytest.mark.parametrize("command", ["qualify", "pytest", "fixture"])
def test_unwritable_fixture_cache_is_refused_before_the_build(tmp_path, command):
    (tmp_path / "a-file").write_text("x")
    cache = tmp_path / "a-file" / "cache"  # below a file: root cannot write there either
    art = tmp_path / "art"
    cmd = {"qualify": BAKEOFF + ["qualify", "--backends", "transformers", "--artifacts", str(art),
                                 "--model", "fixture:tiny-qwen3"],
           "pytest": PYTEST + ["--backend=transformers", f"--artifacts={art}", "--model=fixture:tiny-qwen3"],
           "fixture": BAKEOFF + ["fixture", "build", "tiny-qwen3"]}[command]
    proc = run(cmd, env={"BAKEOFF_CACHE": str(cache)})
    assert proc.returncode == (4 if command == "pytest" else 2), proc.stderr
    line = one_error_line(proc, "ERROR: " if command == "pytest" else "bakeoff: error: ")
    assert f"fixture cache {cache / 'fixtures'} is not writable" in line and "BAKEOFF_CACHE" in line
    assert not art.exists() and (tmp_path / "a-file").read_text() == "x"


def test_qualify_refuses_an_unbuilt_reference_before_building_the_model(tmp_path, empty_cache):
    art = tmp_path / "art"
    proc = run(BAKEOFF + ["qualify", "--backends", "transformers", "--model", "fixture:tiny-qwen3",
                          "--reference-model", "fixture:tiny-qwen3-untrained", "--artifacts", str(art)],
               env={"BAKEOFF_CACHE": str(empty_cache)})
    assert proc.returncode == 2
    assert "fixture tiny-qwen3-untrained is not built; run: bakeoff fixture build" in one_error_line(proc)
    assert not art.exists() and not any(empty_cache.iterdir())


@pytest.mark.parametrize("command", ["pytest", "qualify"])
def test_bad_options_are_refused_before_the_reference_fixture_is_built(tmp_path, empty_cache, command):
    art = tmp_path / "art"
    if command == "pytest":
        cmd = PYTEST + ["--backend=transformers", f"--artifacts={art}", "--model=fixture:tiny-qwen3",
                        "--reference-model=fixture:tiny-qwen3-untrained", "--start-timeout=0"]
    else:
        cmd = BAKEOFF + ["qualify", "--backends", "transformers", "--artifacts", str(art), "--repeats", "0"]
    proc = run(cmd, env={"BAKEOFF_CACHE": str(empty_cache)})
    assert proc.returncode == (4 if command == "pytest" else 2)
    assert "must be" in one_error_line(proc, "ERROR: " if command == "pytest" else "bakeoff: error: ")
    assert not art.exists() and not any(empty_cache.iterdir())


def _cut_off_run(root: Path) -> Path:
    run_dir = root / "runs" / "20260101T000000Z_transformers_tiny-qwen3_abcdef"
    run_dir.mkdir(parents=True)
    (run_dir / "run.json").write_text(json.dumps({"run_id": run_dir.name, "backend": "transformers",
                                                  "model": "fixture:tiny-qwen3", "options": {}, "profile": "quick"}))
    (run_dir / "verdict.json").write_text(json.dumps({"run_id": run_dir.name, "backend": "transformers",
                                                      "model": "fixture:tiny-qwen3", "checks": []}))
    return run_dir


def test_resume_refuses_a_bad_report_name_before_resuming(tmp_path):
    run_dir = _cut_off_run(tmp_path / "art")
    before = {p: p.read_bytes() for p in run_dir.iterdir()}
    proc = run(BAKEOFF + ["qualify", "--resume", str(run_dir), "--report", "../escaped"])
    assert proc.returncode == 2 and "--report '../escaped' is not a plain name" in one_error_line(proc)
    assert "resuming" not in proc.stdout and {p: p.read_bytes() for p in run_dir.iterdir()} == before
    assert sorted(p.name for p in (tmp_path / "art").iterdir()) == ["runs"]


@pytest.mark.parametrize("command", ["qualify", "pytest"])
def test_resume_refuses_a_run_directory_it_cannot_write(tmp_path, command):
    run_dir = _cut_off_run(tmp_path / "art")
    err = _try(["chattr", "+i", str(run_dir)])
    if err:
        pytest.skip(f"cannot make an immutable folder here (chattr +i): {err}")
    try:
        cmd = (BAKEOFF + ["qualify", "--resume", str(run_dir)] if command == "qualify"
               else PYTEST + [f"--resume={run_dir}"])
        proc = run(cmd)
    finally:
        _try(["chattr", "-i", str(run_dir)])
    assert proc.returncode == (2 if command == "qualify" else 4), proc.stdout[-2000:] + proc.stderr
    line = one_error_line(proc, "bakeoff: error: " if command == "qualify" else "ERROR: ")
    assert f"run directory {run_dir} is not writable (Operation not permitted)" in line
    assert sorted(p.name for p in run_dir.iterdir()) == ["run.json", "verdict.json"]


@pytest.mark.parametrize("command", ["compare", "report"])
def test_report_and_compare_create_nothing_for_bad_runs(tmp_path, command):
    art = tmp_path / "art"
    proc = run(BAKEOFF + [command, str(tmp_path / "no-such-run"), "--artifacts", str(art)])
    assert proc.returncode == 2, proc.stderr
    one_error_line(proc)
    assert not art.exists()  # not even an empty artifacts folder


@pytest.mark.parametrize("command", ["compare", "report"])
def test_report_and_compare_refuse_reports_that_is_a_file(tmp_path, command):
    art = tmp_path / "art"
    art.mkdir()
    (art / "reports").write_text("x")
    proc = run(BAKEOFF + [command, str(REPO / "examples" / "cpu"), "--artifacts", str(art)])
    assert proc.returncode == 2, proc.stderr
    assert f"{art / 'reports'} is a file, not a folder" in one_error_line(proc)
    assert sorted(p.name for p in art.iterdir()) == ["reports"]


def _verdict_run(root: Path, name: str, verdict_text: str) -> Path:
    d = root / "runs" / name
    d.mkdir(parents=True)
    (d / "verdict.json").write_text(verdict_text)
    return d


def test_jobs_fetch_refuses_unwritable_artifacts_before_copying(tmp_path):
    pushed = tmp_path / "pushed"
    _verdict_run(pushed, "r1", json.dumps({"backend": "b", "model": "m", "checks": []}))
    (tmp_path / "a-file").write_text("x")
    art = tmp_path / "a-file" / "art"
    proc = run(BAKEOFF + ["jobs", "fetch", "--from", f"file://{pushed}", "--artifacts", str(art)])
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"artifacts folder {art / 'runs'} is not writable" in one_error_line(proc)
    assert "fetched" not in proc.stdout


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
