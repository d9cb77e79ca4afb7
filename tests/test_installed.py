"""bakeoff as a user installs it: ``pip install`` of the wheel (not editable) into a fresh venv,
then used from a temporary folder that holds no checkout.

The wheel is built from a copy of the sources (the checkout is left as it was) and installed by
pip from the wheel file alone (``--no-index``: nothing is downloaded). Its dependencies (torch,
transformers, pytest, ...) are not installed again: the fresh venv reads them from a folder of
links to this project's ``.venv`` packages, minus bakeoff's own (its editable install), through
a ``.pth`` file; pip then finds them installed and installs the wheel alone. (``python -m venv
--system-site-packages`` would not do: from a venv it shares the base interpreter's packages,
not the venv's.) So bakeoff's modules, its ``bakeoff`` command and its pytest11 entry points all
come from the wheel: the test checks that ``evaluations`` is imported from the fresh venv.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SOURCES = ("pyproject.toml", "README.md", "bakeoff", "backends", "adapters", "evaluations", "cli")


def _run(cmd: list[str], cwd: Path, timeout: int = 300, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, **kw)


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, Path]:
    """``(python of the fresh venv, an empty work folder)``."""
    root = tmp_path_factory.mktemp("installed")
    src = root / "src"
    src.mkdir()
    for name in SOURCES:
        p = REPO / name
        (shutil.copytree(p, src / name, ignore=shutil.ignore_patterns("__pycache__")) if p.is_dir()
         else shutil.copy2(p, src / name))
    proc = _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                 "-w", str(root / "wheels"), str(src)], root)
    wheels = list((root / "wheels").glob("bakeoff-*.whl"))
    assert proc.returncode == 0 and len(wheels) == 1, proc.stderr[-3000:]
    proc = _run([sys.executable, "-m", "venv", str(root / "venv")], root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    python = root / "venv" / "bin" / "python"
    site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], root).stdout.strip())
    deps = root / "deps"
    deps.mkdir()
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():  # this project's .venv
        if not entry.name.startswith(("bakeoff", "__editable__")):
            (deps / entry.name).symlink_to(entry)
    (site / "_bakeoff_test_deps.pth").write_text(f"{deps}\n")
    proc = _run([str(python), "-m", "pip", "install", "-q", "--no-index", "--disable-pip-version-check", str(wheels[0])], root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    work = root / "work folder"  # a space: paths are quoted where they must be
    work.mkdir()
    return python, work


def test_wheel_gives_the_command_and_the_plugin(installed):
    python, work = installed
    bakeoff = python.parent / "bakeoff"
    assert bakeoff.is_file(), "the wheel installed no bakeoff command"
    where = _run([str(python), "-c", "import evaluations; print(evaluations.__file__)"], work).stdout
    assert where.startswith(str(python.parent.parent)), f"evaluations imported from {where}, not the fresh venv"
    # the entry point adds the options (no conftest is read before parsing with --pyargs), once
    helped = _run([str(python), "-m", "pytest", "--pyargs", "evaluations", "--help"], work, timeout=120)
    assert helped.returncode == 0 and "--backend=BACKEND" in helped.stdout, helped.stderr[-2000:]
    listed = _run([str(python), "-m", "pytest", "--pyargs", "evaluations", "--co", "-q", "--backend=transformers"], work, timeout=120)
    assert listed.returncode == 0 and "test_load.py" in listed.stdout, listed.stdout[-2000:] + listed.stderr[-2000:]
    # in another project's tests it only adds options: no run directory, no reordering
    (work / "test_other.py").write_text("def test_other():\n    pass\n")
    other = _run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_other.py"], work, timeout=120)
    assert other.returncode == 0 and "1 passed" in other.stdout, other.stdout[-2000:]
    assert not (work / "artifacts").exists()
    (work / "test_other.py").unlink()
    # the package data: the shipped fixtures (the same files as the checkout's) and the environment locks
    code = ("import json; from bakeoff.models.fixtures import shipped; from bakeoff.host import locks; print(json.dumps("
            "[str(shipped.SHIPPED_ROOT), {n: shipped.manifest(n)['fixture_hash'] for n in shipped.shipped_names()},"
            " sorted(p.name for p in locks.LOCK_DIR.glob('*.txt'))]))")
    root, hashes, lock_files = json.loads(_run([str(python), "-c", code], work).stdout)
    from bakeoff.host import locks
    from bakeoff.models.fixtures import shipped

    assert root.startswith(str(python.parent.parent)), root
    assert hashes == {n: shipped.manifest(n)["fixture_hash"] for n in shipped.shipped_names()} != {}
    assert all(sorted(p.name for p in (Path(root) / n).iterdir()) == sorted([*shipped.manifest(n)["files"], shipped.MANIFEST])
               for n in hashes)
    assert lock_files == sorted(p.name for p in locks.LOCK_DIR.glob("*.txt")) != []
    hook = _run([str(python), "-c", "from backends._ranks import HOOK_DIR; print(HOOK_DIR / 'sitecustomize.py')"], work)
    assert hook.stdout.strip().startswith(str(python.parent.parent)) and Path(hook.stdout.strip()).is_file(), hook.stdout


@pytest.mark.slow
def test_installed_qualification_from_a_temporary_folder(installed):
    """``bakeoff qualify`` of the transformers backend from an empty folder: the run lands in
    ./artifacts, the evaluations ran from the installed package; the untrained fixture (cheap:
    it fails its known answers, then the checks needing a sane engine skip) is disqualified and
    ``--fail-on disqualified`` makes that exit 1 (docs/concepts/ci-gating.md). This is also the
    transformers case of tests/test_e2e_engines.py's untrained-twin test."""
    python, work = installed
    env = dict(os.environ, PYTHONPATH="")  # nothing of the checkout on the path
    proc = _run([str(python.parent / "bakeoff"), "qualify", "--backends", "transformers", "--model",
                 "fixture:tiny-qwen3-untrained", "--fail-on", "disqualified"], work, timeout=900, env=env)
    out = proc.stdout + proc.stderr
    runs = list((work / "artifacts" / "runs").glob("*/verdict.json"))
    assert len(runs) == 1, out[-4000:]
    verdict = json.loads(runs[0].read_text())
    assert verdict["status"] == "disqualified", out[-4000:]
    assert proc.returncode == 1 and "--fail-on disqualified: transformers: disqualified" in proc.stderr, out[-4000:]
    assert "pytest exit 1 ->" in proc.stdout  # `pytest evaluations/` itself exits non-zero on a disqualification
    checks = {c["name"]: c for c in verdict["checks"]}  # as tests/test_e2e_engines.py asks of vLLM's twin
    ka = checks["sanity.known_answers"]
    assert ka["status"] == "fail" and ka["failure_class"] == "garbage-output" and ka["values"]["accuracy"] < 0.2
    probes = json.loads((runs[0].parent / ka["evidence"][0]).read_text())
    assert probes and {"prompt", "expected", "text", "correct"} <= set(probes[0])
    rows = json.loads((runs[0].parent / checks["sanity.degeneration"]["evidence"][0]).read_text())
    assert {"longest_repeat_run", "distinct_2", "u_fffd", "flags"} <= set(rows[0])
    # the fingerprint names the fixture's weights: the shipped copy's hash, the same on every host
    from bakeoff.models.fixtures import shipped

    fixture = verdict["fingerprint"]["fixture"]
    assert fixture["origin"] == "shipped" and fixture["name"] == "tiny-qwen3-untrained", fixture
    assert fixture["fixture_hash"] == shipped.manifest("tiny-qwen3-untrained")["fixture_hash"], fixture
    run = json.loads((runs[0].parent / "run.json").read_text())
    site = str(python.parent.parent)
    assert any(site in part and "evaluations" in part for part in run["command"]), run["command"]
    assert (work / "artifacts" / "reports" / "latest" / "report.md").is_file()
    # the engine child imported bakeoff through a folder of links to its packages alone, not the
    # whole site-packages (bakeoff.host.envs.code_path); removed again, it is this test's own
    from bakeoff.host.envs import cache_root

    linked = [d for d in (cache_root() / "code").glob("*") if (d / "backends").resolve().is_relative_to(python.parent.parent)]
    assert len(linked) == 1 and sorted(p.name for p in linked[0].iterdir()) == ["adapters", "backends", "bakeoff", "evaluations"]
    shutil.rmtree(linked[0])
