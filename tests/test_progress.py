"""``bakeoff qualify``'s progress (cli/progress.py) against a stand-in evaluation: a
subprocess that writes what the plugin writes (``BAKEOFF_RUN_FILE``, then ``verdict.json``
after each check) with pauses between checks. No engine, a few seconds."""

from __future__ import annotations

import io
import os
import sys
from pathlib import Path

from rich.console import Console

from cli import progress as progress_mod
from cli.progress import Progress, choose_mode, table

STAND_IN = r'''
import json, os, sys, time
from pathlib import Path
run = Path(sys.argv[1]); run.mkdir()
Path(os.environ["BAKEOFF_RUN_FILE"]).write_text(str(run))
print("pytest says hello")
checks = []
for name, status, cls in (("load", "pass", None), ("sanity.known_answers", "fail", "garbage-output")):
    time.sleep(0.6)
    checks.append({"name": name, "status": status, "failure_class": cls})
    (run / "verdict.json.tmp").write_text(json.dumps({"checks": checks}))
    os.replace(run / "verdict.json.tmp", run / "verdict.json")
sys.exit(1)
'''


def _run(tmp_path: Path, mode: str, script: str = STAND_IN):
    run_file = tmp_path / "x.run"
    run_file.write_text("")
    p = Progress(mode, poll_s=0.05)
    with p:
        code, run_dir = p.run("transformers", [sys.executable, "-c", script, str(tmp_path / "run")],
                              dict(os.environ, BAKEOFF_RUN_FILE=str(run_file)), str(tmp_path), str(run_file))
    return p, code, run_dir


def test_modes():
    assert choose_mode(True) == "quiet"
    assert choose_mode(False, io.StringIO()) == "plain"

    class Tty(io.StringIO):
        def isatty(self):
            return True
    assert choose_mode(False, Tty()) == "live"


def test_live_table_fills_in_as_checks_land(tmp_path, monkeypatch):
    seen: list[tuple[str, ...]] = []

    def spy(rows, elapsed, sweeps=None):
        seen.append(tuple(rows.get("transformers", {})))
        return table(rows, elapsed, sweeps)
    monkeypatch.setattr(progress_mod, "table", spy)
    p, code, run_dir = _run(tmp_path, "live")
    assert code == 1 and run_dir == tmp_path / "run"
    assert ("load",) in seen and seen[-1] == ("load", "sanity.known_answers")
    assert seen.index(("load",)) < seen.index(("load", "sanity.known_answers"))  # filled in, not at the end
    assert "pytest says hello" in (run_dir / "pytest.log").read_text()  # pytest's output kept, not shown
    out = Console(file=io.StringIO(), width=120, color_system=None)
    out.print(table(p.rows, p.elapsed_s))
    text = out.file.getvalue()
    assert "sanity.known_answers" in text and "fail (garbage-output)" in text and "transformers (" in text


def test_quiet_keeps_the_log_and_a_run_that_did_not_start_shows_its_tail(tmp_path, capsys):
    _, code, run_dir = _run(tmp_path, "quiet")
    assert code == 1 and "pytest says hello" in (run_dir / "pytest.log").read_text()
    assert capsys.readouterr().out == ""  # quiet: nothing while it runs
    _, code, run_dir = _run(tmp_path, "quiet", "import sys; print('ERROR: usage: bad option'); sys.exit(4)")
    assert code == 4 and run_dir is None
    assert "ERROR: usage: bad option" in capsys.readouterr().err


def test_plain_streams_the_output_as_before(tmp_path, capfd):
    _, code, run_dir = _run(tmp_path, "plain")
    assert code == 1 and run_dir == tmp_path / "run" and not (run_dir / "pytest.log").exists()
    assert "pytest says hello" in capfd.readouterr().out
