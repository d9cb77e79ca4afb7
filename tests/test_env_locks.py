"""Engine environments from lock files (bakeoff/host/locks.py): uv installs the exact pins of a lock
that fits this platform and the spec's requirements; the lock is part of the environment's key;
without a fitting lock, or when uv fails, pip resolves as before.

The installs here are stand-ins (``envs._run`` replaced): what is checked is which command runs
with which lock, and what is recorded. The real installs are every engine test's environment
(``.ci/test-fresh`` makes them from an empty cache).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bakeoff.host import envs, locks

SPEC = envs.EnvSpec("lock-test", ("alpha==1.0",), uninstall=("beta",), modules=("no_such_module_bakeoff",))


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("BAKEOFF_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("BAKEOFF_ENVS", raising=False)
    return tmp_path / "cache"


@pytest.fixture
def lock_dir(tmp_path, monkeypatch):
    root = tmp_path / "locks"
    root.mkdir()
    monkeypatch.setattr(locks, "LOCK_DIR", root)
    return root


def _write_lock(root: Path, spec=SPEC, pins=("alpha==1.0", "gamma==2.1"), req_hash=None) -> Path:
    path = locks.path_for(spec, root)
    path.write_text(f"# requirements: {' '.join(spec.requirements)}\n"
                    f"# requirements-sha256: {req_hash or locks.requirements_hash(spec)}\n" + "\n".join(pins) + "\n")
    return path


def _fake_run(calls: list, fail_uv: bool = False, envs_seen: list | None = None):
    def run(cmd, log_path, timeout_s, env=None, background=False):
        calls.append(cmd)
        if envs_seen is not None:
            envs_seen.append(env)
        if cmd[1:3] == ["-m", "venv"]:
            Path(cmd[-1], "bin").mkdir(parents=True, exist_ok=True)
        if fail_uv and cmd[1:3] == ["pip", "install"] and "--no-deps" in cmd:
            raise subprocess.CalledProcessError(2, cmd)
    return run


def test_a_lock_fits_only_its_platform_and_requirements(lock_dir):
    assert locks.lock_for(SPEC) is None  # none written
    _write_lock(lock_dir, req_hash="0" * 16)
    assert locks.lock_for(SPEC) is None  # made from other requirements
    path = _write_lock(lock_dir)
    assert locks.lock_for(SPEC) == path and path.name == f"lock-test-{locks.platform_tag()}.txt"
    assert locks.platform_tag().startswith(f"cp{sys.version_info.major}{sys.version_info.minor}-")
    other = envs.EnvSpec("lock-test", ("alpha==1.1",), uninstall=("beta",))
    assert locks.lock_for(other) is None


def test_the_lock_is_part_of_the_key(cache, lock_dir):
    without = SPEC.key
    path = _write_lock(lock_dir)
    with_lock = SPEC.key
    path.write_text(path.read_text().replace("gamma==2.1", "gamma==2.2"))
    assert len({without, with_lock, SPEC.key}) == 3


def test_ensure_installs_the_lock_with_uv_and_records_it(cache, lock_dir, monkeypatch):
    path = _write_lock(lock_dir)
    calls: list = []
    seen: list = []
    monkeypatch.setattr(locks, "pip_sources", lambda: {"UV_EXTRA_INDEX_URL": "https://user:secret@example.invalid/simple"})
    monkeypatch.setattr(envs, "_run", _fake_run(calls, envs_seen=seen))
    steps: list[str] = []
    python = envs.ensure(SPEC, progress=lambda step, log: steps.append(step))
    assert python == SPEC.python
    assert steps == ["creating venv", "uv install (lock)"]  # no pip resolve, no uninstall: the lock holds no beta
    uv = calls[1]
    assert uv[1:3] == ["pip", "install"] and uv[uv.index("--python") + 1] == str(SPEC.python)
    assert {"--no-deps", "--compile-bytecode"} <= set(uv) and uv[-2:] == ["-r", str(path)]
    assert uv[uv.index("--index-strategy") + 1] == "unsafe-best-match"
    # pip's package sources go as variables: an index URL's password never reaches the logged command
    assert seen[1] == {"UV_EXTRA_INDEX_URL": "https://user:secret@example.invalid/simple"}
    assert not any("secret" in part for part in uv)
    meta = json.loads((SPEC.path / ".bakeoff-ready").read_text())
    assert meta["installer"] == f"uv, lock {path.name} ({locks.file_hash(path)})"


def test_a_failing_lock_install_falls_back_to_pip_resolving(cache, lock_dir, monkeypatch):
    _write_lock(lock_dir)
    calls: list = []
    monkeypatch.setattr(envs, "_run", _fake_run(calls, fail_uv=True))
    lines: list[str] = []
    envs.ensure(SPEC, log=lines.append)
    kinds = [("venv" if c[1:3] == ["-m", "venv"] else "uv" if c[1:3] == ["pip", "install"]
              else "pip " + c[c.index("--no-input") + 1]) for c in calls]
    assert kinds == ["venv", "uv", "venv", "pip install", "pip uninstall"], calls
    assert any("resolving with pip instead" in x for x in lines)
    assert json.loads((SPEC.path / ".bakeoff-ready").read_text())["installer"] == "pip (resolved)"
    log = SPEC.path.parent / f"{SPEC.path.name}.install.log"
    assert "installing the lock failed" in log.read_text()


def test_no_lock_means_pip_resolves_as_before(cache, lock_dir, monkeypatch):
    calls: list = []
    monkeypatch.setattr(envs, "_run", _fake_run(calls))
    envs.ensure(SPEC)
    assert [c[c.index("--no-input") + 1] for c in calls[1:]] == ["install", "uninstall"] and "alpha==1.0" in calls[1]


def test_uv_gets_the_package_sources_pip_is_configured_with(monkeypatch):
    out = ("global.find-links='/opt/wheels'\n:env:.find-links='/opt/wheels'\n"
           "global.extra-index-url='file:///a/simple file:///b/simple'\nglobal.index-url='https://example.invalid/simple'\n"
           "global.cert='/etc/ssl/cert.pem'\n")
    monkeypatch.setattr(locks.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 0, out, ""))
    assert locks.pip_sources() == {"UV_INDEX_URL": "https://example.invalid/simple",
                                   "UV_EXTRA_INDEX_URL": "file:///a/simple file:///b/simple", "UV_FIND_LINKS": "/opt/wheels"}


def _cpu_specs():
    from adapters.awq_int4 import env_spec as awq_int4
    from adapters.openvino_export import env_spec as openvino
    from adapters.optimum_onnx_export import env_spec as optimum_onnx
    from adapters.ort_genai_export import env_spec as ort_genai
    from backends.vllm.backend import env_spec as vllm

    return [vllm(False), ort_genai(), awq_int4(), optimum_onnx(), openvino()]


@pytest.mark.parametrize("spec", _cpu_specs(), ids=lambda s: s.name)
def test_each_cpu_environment_has_a_lock_for_its_current_pins(spec):
    """An engine's pins changed without writing its lock again (``.ci/write-locks NAME``) would
    resolve with pip on every fresh host: about 3x slower (bakeoff/host/locks.py)."""
    if locks.platform_tag() != "cp311-linux-x86_64":
        pytest.skip(f"the locks are written for cp311-linux-x86_64; this is {locks.platform_tag()}")
    path = locks.lock_for(spec)
    assert path is not None, f"no lock fits {spec.name}: run .ci/write-locks {spec.name}"
    _, pins = locks.read(path)
    names = {p.split("==")[0].lower().replace("_", "-") for p in pins}
    assert all("==" in p for p in pins)
    assert not names & ({n.lower() for n in spec.uninstall} | locks.TOOLS), names & set(spec.uninstall)
    for req in spec.requirements:  # every requirement named is pinned
        base = req.split("[")[0].split("=")[0].split("<")[0].split(">")[0].strip().lower().replace("_", "-")
        assert base in names, (spec.name, req)
