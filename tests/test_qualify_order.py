"""``bakeoff qualify`` starts each run once the environments ITS backend declares are made (issue 30):
transformers (none) at once, a run whose environment is made before one whose is still being made,
never two runs at once, never a run before its environment; an install that fails lets its run go
(its ``start()`` records why) while the others proceed; the time-per-step table says who waited.

Stand-ins only: ``bakeoff.host.envs.ensure`` (an install that ends when the test says, or fails)
and the evaluation (``cli.qualify._one_run``, which records when it was called); the real
:class:`cli.steps.EnvPrewarm`, :func:`cli.steps.by_readiness` and ``_qualify``."""

from __future__ import annotations

import re
import threading
import time
from types import SimpleNamespace

import pytest

import backends
from bakeoff.api.errors import EngineFailure
from cli import main as cli_main
from cli import steps
from bakeoff.host import envs


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("BAKEOFF_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("BAKEOFF_ENVS", "venv")  # never this interpreter's packages: every spec is made
    return tmp_path / "cache"


class Installs:
    """Stand-in for ``envs.ensure``: an environment named in ``hold`` is made when its event is set,
    one named in ``fail`` fails (``unavailable``, as a package source without the pins would), any
    other is made at once. ``done`` holds the names whose install returned or raised."""

    def __init__(self, hold=(), fail=()):
        self.hold = {name: threading.Event() for name in hold}
        self.fail = set(fail)
        self.done: set[str] = set()
        self.lock = threading.Lock()

    def __call__(self, spec, log=lambda s: None, timeout_s=1800, progress=None, background=False):
        assert background, "installs made beside the runs must run at the lowest priority (background=True)"
        try:
            if spec.name in self.hold:
                assert self.hold[spec.name].wait(30), f"{spec.name} was never released"
            if spec.name in self.fail:
                raise EngineFailure("unavailable", f"no version of the {spec.name} pins here")
            return spec.python
        finally:
            with self.lock:
                self.done.add(spec.name)


def _qualify(monkeypatch, tmp_path, names: list[str], installs: Installs, on_run=lambda label: None):
    """``bakeoff qualify --backends NAMES`` with the stand-ins; returns (exit code, calls, stdout):
    calls are ``(label, envs done when it started, seconds it ran alongside another run)``."""
    monkeypatch.setattr(envs, "ensure", installs)
    calls, running = [], []
    specs = {n: [s.name for s in backends.resolve(n).env_specs()] for n in names}

    def one_run(c, run, artifacts, progress, runs, cell_runs, missing, shared_env):
        with installs.lock:
            calls.append((run.backend, set(installs.done), len(running)))
        running.append(run.backend)
        on_run(run.backend)
        time.sleep(0.2)
        running.remove(run.backend)
        runs.append(tmp_path / "runs" / run.backend)  # no run directory: the table's note is empty

    monkeypatch.setattr("cli.qualify._one_run", one_run)
    monkeypatch.setattr("bakeoff.reporting.report.write_report", lambda runs, dest: dest)
    monkeypatch.setattr("cli.progress.print_verdicts", lambda runs: [(p.name, "qualified", str(p)) for p in runs])
    code = cli_main.main(["qualify", "--backends", ",".join(names), "--artifacts", str(tmp_path / "art")])
    return code, calls, specs


def test_runs_follow_readiness_and_none_starts_before_its_environment(cache, tmp_path, monkeypatch, capsys):
    """vllm's environment is held until optimum-ort's run has started: the order of runs follows
    readiness (transformers at once, ort-genai and optimum-ort before vllm), each run starts with
    its own environments made, and vllm's run says it waited for its environment."""
    installs = Installs(hold=["vllm-cpu"])
    release = lambda b: b == "optimum-ort" and threading.Timer(1.5, installs.hold["vllm-cpu"].set).start()  # noqa: E731
    code, calls, specs = _qualify(monkeypatch, tmp_path, ["transformers", "vllm", "ort-genai", "optimum-ort"],
                                  installs, release)
    out = capsys.readouterr().out
    assert code == 0, out
    assert [b for b, _, _ in calls] == ["transformers", "ort-genai", "optimum-ort", "vllm"], out
    for backend, done, alongside in calls:
        assert set(specs[backend]) <= done, f"{backend} started before its environment {specs[backend]} was made"
        assert alongside == 0, f"{backend} started while another run was running"
    assert "vllm-cpu" not in calls[0][1]  # transformers did not wait for environments it does not need
    assert "ort-genai goes before vllm: its environment is made, vllm-cpu not yet" in out
    table = out[out.index("time per step:"):]
    wait = re.search(r"^  wait for vllm-cpu\s+(\d+) s\s+run vllm waited for its environment$", table, re.M)
    assert wait and re.search(r"^  run vllm\s+\d+ s\s+waited \d+ s for its environment \(vllm-cpu\)", table, re.M), table
    assert re.search(r"^  run transformers\s+\d+ s\s+beside the install of .*vllm-cpu", table, re.M), table
    # the environments are listed after the fixture, outside the total: the total adds the rest
    rows = {m[1].strip(): m[2] for m in re.finditer(r"^  (\S.*?)\s{2,}(\d+ min \d+ s|\d+ s)", table, re.M)}
    assert list(rows)[:2] == ["fixture", "environments"] and "not in the total" in table

    def secs(text):
        m = re.match(r"(?:(\d+) min )?(\d+) s", text)
        return int(m[1] or 0) * 60 + int(m[2])

    counted = sum(secs(v) for k, v in rows.items() if k not in ("environments", "total"))
    assert abs(secs(rows["total"]) - counted) <= len(rows)  # each row rounded to a second


def test_a_failed_install_lets_its_run_go_and_the_others_proceed(cache, tmp_path, monkeypatch, capsys):
    """The optimum-onnx install fails: optimum-ort's run still goes once the failure is known (its
    ``start()`` tries again and records ``unavailable`` in its ``load`` check, as before), and the
    other runs go; the board and the table say the install failed."""
    installs = Installs(fail=["optimum-onnx"])
    code, calls, specs = _qualify(monkeypatch, tmp_path, ["optimum-ort", "ort-genai", "transformers"], installs)
    out = capsys.readouterr().out
    assert code == 0, out
    assert sorted(b for b, _, _ in calls) == ["optimum-ort", "ort-genai", "transformers"]
    done_at = dict((b, done) for b, done, _ in calls)
    assert "optimum-onnx" in done_at["optimum-ort"]  # after the failure, not during the install
    assert "[envs] optimum-onnx: failed (EngineFailure); its run records why" in out
    assert re.search(r"^  environments .*optimum-onnx failed \(EngineFailure\)", out, re.M), out


def test_prewarm_makes_each_environment_once_in_the_order_given(cache):
    """Specs are made in the order given (the first run's first), a duplicate once, a ready one not
    at all; :meth:`EnvPrewarm.unmade` names what is still being made until it is done."""
    order: list[str] = []
    gate = threading.Event()

    def ensure(spec, log=lambda s: None, timeout_s=1800, progress=None, background=False):
        assert background
        order.append(spec.name)
        gate.wait(30)
        return spec.python

    a, b, c = (envs.EnvSpec(n, (f"{n}==1.0",)) for n in ("alpha", "beta", "gamma"))
    c.path.mkdir(parents=True)
    (c.path / ".bakeoff-ready").write_text("{}")
    pre = steps.EnvPrewarm([a, b, a, c], parallel=1, ensure=ensure, board=None, log=lambda s: None)
    try:
        assert [s.name for s in pre.specs] == ["alpha", "beta"]
        assert pre.unmade([str(a.path), str(b.path), str(c.path)]) == ["alpha", "beta"] and pre.ready([str(c.path)])
    finally:
        gate.set()
    pre.wait()
    assert order == ["alpha", "beta"] and pre.ready([str(a.path), str(b.path)])


def test_by_readiness_without_environments_keeps_the_users_order():
    """Nothing to make: every run goes in the given order, none waits."""
    pre = steps.EnvPrewarm([], ensure=lambda *a, **k: pytest.fail("nothing to make"))
    runs = [SimpleNamespace(backend=n) for n in ("vllm", "transformers", "openvino")]
    got = list(steps.by_readiness(runs, lambda r: [], pre, lambda r: r.backend))
    assert [n.run.backend for n in got] == ["vllm", "transformers", "openvino"]
    assert all(not n.waited_for and not n.overtook for n in got)
    assert pre.elapsed_s() == 0.0  # nothing was made


def test_plain_environment_lines_start_on_their_own_line_once_runs_go():
    """Beside a run, pytest's progress dots end with no newline: an ``[envs]`` line starts a line."""
    from cli.phases import PhaseBoard

    lines: list[str] = []
    board = PhaseBoard("plain", out=lines.append)
    board.env_done("alpha", "failed (EngineFailure); its run records why", ok=False)
    board.runs_started()
    board.env_log("beta", "beta environment ready in 3.0 s")
    assert lines == ["[envs] alpha: failed (EngineFailure); its run records why", "\n[envs] beta environment ready in 3.0 s"]


def test_a_run_attached_to_a_server_says_so_in_its_step_note(tmp_path):
    """A new user's finding: an attached run read "engine start 0 s" for a server bakeoff never started."""
    import json

    from cli.steps import run_note

    for device, words in (("remote", "attached to a running server 0 s"), ("cpu", "engine start 7 s")):
        (tmp_path / "verdict.json").write_text(json.dumps({"backend_info": {"device": device, "startup_s": 0.066
                                                                            if device == "remote" else 7.2}}))
        assert run_note(tmp_path) == words
