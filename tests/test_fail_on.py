"""``bakeoff qualify --fail-on STATUS``: the exit codes of the docs' "CI gating" page (docs/concepts/ci-gating.md).

The real runs are elsewhere, to keep CI's time: the disqualified untrained fixture exiting 1
under ``--fail-on disqualified`` in ``tests/test_installed.py`` (from the installed wheel), and
qualified runs exiting 0 under every ``--fail-on`` status in ``tests/test_e2e_engines.py``
(``qualify_run``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bakeoff.api.errors import UserError
from cli.gating import EXIT_FAILED_GATE, EXIT_OK, gate, parse_fail_on

REPO = Path(__file__).resolve().parent.parent


def test_parse_and_gate():
    assert parse_fail_on(["disqualified", "incomplete,unavailable"]) == {"disqualified", "incomplete", "unavailable"}
    assert parse_fail_on([]) == frozenset()
    with pytest.raises(UserError, match="--fail-on 'qualified' is not a verdict status to fail on; choose from"):
        parse_fail_on(["qualified"])
    outcomes = [("vllm", "disqualified", "/runs/a"), ("ort-genai", "incomplete", "no run written: pytest exit 4"),
                ("transformers", "qualified", "/runs/b")]
    assert gate(outcomes, frozenset()) == (EXIT_OK, [])
    assert gate(outcomes, frozenset({"unavailable"})) == (EXIT_OK, [])
    code, lines = gate(outcomes, frozenset({"disqualified", "incomplete"}))
    assert code == EXIT_FAILED_GATE == 1 and lines == ["vllm: disqualified (/runs/a)",
                                                      "ort-genai: incomplete (no run written: pytest exit 4)"]


def test_exit_codes_are_the_docs_table():
    """The CI gating page's table and the gating module's constants say the same codes."""
    from cli import gating

    section = (REPO / "docs" / "concepts" / "ci-gating.md").read_text()
    for code in (gating.EXIT_OK, gating.EXIT_FAILED_GATE, gating.EXIT_BAD_INPUT, gating.EXIT_NO_RUN, gating.EXIT_INTERRUPTED):
        assert f"| {code} |" in section
    assert "--fail-on disqualified" in section


def test_sigterm_mid_run_exits_130_and_keeps_the_run(tmp_path):
    """A CI job's timeout sends SIGTERM to bakeoff alone: it asks its pytest child to stop, keeps
    what was measured (verdict ``incomplete``) and exits 130, the CI gating page's code for an interruption."""
    import json
    import signal
    import subprocess
    import sys
    import time

    from bakeoff.models import fixtures

    fixtures.build("tiny-qwen3-untrained", log=lambda s: None)
    art = tmp_path / "art"
    proc = subprocess.Popen([sys.executable, "-m", "cli.main", "qualify", "--backends", "transformers",
                             "--model", "fixture:tiny-qwen3-untrained", "--artifacts", str(art), "--quiet"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    verdict = None
    while time.monotonic() < deadline and proc.poll() is None:
        found = list((art / "runs").glob("*/verdict.json")) if (art / "runs").is_dir() else []
        if found:
            try:
                v = json.loads(found[0].read_text())
            except ValueError:  # caught mid-write: read again
                v = {}
            if any(c["name"] == "load" for c in v.get("checks", [])):
                verdict = found[0]
                break
        time.sleep(0.5)
    assert verdict is not None and proc.poll() is None, "the run never reached its load check"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=90)
    assert proc.returncode == 130, err
    assert "interrupted; runs written so far are kept" in err
    v = json.loads(verdict.read_text())
    assert v["status"] == "incomplete" and v["checks"][0]["name"] in ("loadgen.calibration", "load")
    assert any(c["name"] == "load" and c["status"] == "pass" for c in v["checks"])
    assert (verdict.parent / "pytest.log").is_file()  # --quiet's output is kept though the run was cut


def test_sigkill_of_bakeoff_leaves_no_orphan(tmp_path):
    """``kill -9`` of ``bakeoff qualify`` mid-run: its pytest child gets SIGTERM from the kernel
    (PR_SET_PDEATHSIG, ``bakeoff.host.procs.child_preexec``), stops its engine and writes what it
    measured; nothing of the run is left within 60 s (fails before: pytest, the worker and the
    engine ran on)."""
    import json
    import signal
    import subprocess
    import sys
    import time

    import psutil

    from bakeoff.models import fixtures

    fixtures.build("tiny-qwen3-untrained", log=lambda s: None)
    art = tmp_path / "art"
    proc = subprocess.Popen([sys.executable, "-m", "cli.main", "qualify", "--backends", "transformers",
                             "--model", "fixture:tiny-qwen3-untrained", "--artifacts", str(art), "--quiet"],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 240
    family: list[psutil.Process] = []
    while time.monotonic() < deadline and proc.poll() is None:
        found = list((art / "runs").glob("*/verdict.json")) if (art / "runs").is_dir() else []
        try:
            loaded = found and any(c["name"] == "load" for c in json.loads(found[0].read_text()).get("checks", []))
        except ValueError:
            loaded = False
        if loaded:
            family = psutil.Process(proc.pid).children(recursive=True)
            break
        time.sleep(0.3)
    assert family and proc.poll() is None, "the run never reached its load check"
    assert len(family) >= 2  # pytest and the engine's worker at least
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    gone, alive = psutil.wait_procs(family, timeout=30)
    assert not alive, [(p.pid, p.cmdline()[:4]) for p in alive]
    v = json.loads(found[0].read_text())  # what was measured is kept, valid JSON
    # interrupted, not run to its end on its own (the untrained twin's full run is disqualified)
    assert v["status"] == "incomplete" and v["checks"][0]["name"] in ("loadgen.calibration", "load"), v["reasons"]
