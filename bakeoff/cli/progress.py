"""``bakeoff qualify``'s progress while each backend's evaluation runs (issue 21, item 1).

Three modes, chosen once per command:

- ``live`` (stdout is a terminal): a rich table of checks x backends that fills in as each
  check lands in the run's ``verdict.json`` (rewritten after every check), with each backend's
  elapsed time; pytest's own output goes to ``pytest.log`` in the run directory.
- ``plain`` (stdout is not a terminal: CI logs): pytest's own output as before, plain text.
- ``quiet`` (``--quiet``): neither; pytest's output goes to ``pytest.log``, and the verdict
  table at the end is all that is printed.

The watcher reads only files the run writes anyway (``BAKEOFF_RUN_FILE``, ``verdict.json``).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

STYLE = {"pass": "green", "fail": "bold red", "error": "bold red", "skip": "yellow", "info": "cyan"}


def choose_mode(quiet: bool, stream: IO | None = None) -> str:
    """``quiet``, ``live`` (a terminal) or ``plain``; ``stream`` defaults to the current ``sys.stdout``."""
    if quiet:
        return "quiet"
    return "live" if (stream or sys.stdout).isatty() else "plain"


def read_checks(run_file: str) -> tuple[Path | None, list[dict]]:
    """The run directory named in ``run_file`` (once the plugin wrote it) and its checks so far."""
    try:
        text = Path(run_file).read_text().strip()
    except OSError:
        return None, []
    if not text:
        return None, []
    run_dir = Path(text)
    try:
        return run_dir, json.loads((run_dir / "verdict.json").read_text()).get("checks", [])
    except (OSError, ValueError):  # not written yet
        return run_dir, []


def table(rows: dict[str, dict], elapsed_s: dict[str, float]):
    """A rich table: one row per check (in the order they landed), one column per backend."""
    from rich.table import Table

    t = Table(title="bakeoff qualify", title_justify="left")
    t.add_column("check")
    for label in rows:
        t.add_column(f"{label} ({elapsed_s.get(label, 0):.0f} s)")
    names: list[str] = []
    for checks in rows.values():
        names += [n for n in checks if n not in names]
    for name in names:
        cells = []
        for checks in rows.values():
            c = checks.get(name)
            if c is None:
                cells.append("")
            else:
                text = c["status"] + (f" ({c['failure_class']})" if c.get("failure_class") else "")
                cells.append(f"[{STYLE.get(c['status'], '')}]{text}[/]" if STYLE.get(c["status"]) else text)
        t.add_row(name, *cells)
    return t


class Progress:
    """Runs each evaluation subprocess and shows its progress in the chosen mode."""

    def __init__(self, mode: str, poll_s: float = 0.5):
        self.mode = mode
        self.poll_s = poll_s
        self.rows: dict[str, dict] = {}
        self.elapsed_s: dict[str, float] = {}
        self._live = None

    def __enter__(self) -> "Progress":
        if self.mode == "live":
            from rich.live import Live

            self._live = Live(table(self.rows, self.elapsed_s), refresh_per_second=4, transient=False)
            self._live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._live is not None:
            self._live.__exit__(*exc)

    def announce(self, label: str, cmd: list[str]) -> None:
        if self.mode == "plain":
            print(f"\n=== {label} ===\n$ {' '.join(cmd)}", flush=True)

    def run(self, label: str, cmd: list[str], env: dict, cwd: str, run_file: str) -> tuple[int, Path | None]:
        """Run one evaluation; returns its exit code and run directory (None if it wrote none).
        Outside ``plain`` mode its output is kept in ``pytest.log`` of the run directory (or, when
        it wrote no run, its tail is printed to stderr)."""
        self.rows[label] = {}
        if self.mode == "plain":
            return subprocess.run(cmd, env=env, cwd=cwd).returncode, read_checks(run_file)[0]
        t0 = time.monotonic()
        log = Path(run_file).with_suffix(".log")
        with open(log, "wb") as out:
            proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT)
            while proc.poll() is None:
                self._update(label, run_file, time.monotonic() - t0)
                time.sleep(self.poll_s)
        run_dir = self._update(label, run_file, time.monotonic() - t0)
        text = log.read_text(errors="replace")
        log.unlink(missing_ok=True)
        if run_dir is not None and run_dir.is_dir():
            from bakeoff.host.artifacts import atomic_write_text

            atomic_write_text(run_dir / "pytest.log", text)
        elif text.strip():
            print("\n".join(text.splitlines()[-20:]), file=sys.stderr)
        return proc.returncode, run_dir

    def _update(self, label: str, run_file: str, elapsed_s: float) -> Path | None:
        run_dir, checks = read_checks(run_file)
        self.rows[label] = {c["name"]: c for c in checks}
        self.elapsed_s[label] = elapsed_s
        if self._live is not None:
            self._live.update(table(self.rows, self.elapsed_s))
        return run_dir


def print_verdicts(runs: list[Path]) -> list[tuple[str, str, str]]:
    """Print the verdict table; returns ``(backend, status, run directory)`` per run."""
    from rich.console import Console
    from rich.table import Table

    from bakeoff.reporting.report import load_run

    t = Table(title="bakeoff verdicts")
    for col in ("backend", "model", "status", "reasons", "run"):
        t.add_column(col)
    outcomes = []
    for p in runs:
        r = load_run(p)
        t.add_row(r["backend"], r["model"], r["status"], "\n".join(r["verdict"].get("reasons", []))[:300], p.name)
        outcomes.append((r["backend"], r["status"], str(p)))
    Console(width=160).print(t)
    return outcomes
