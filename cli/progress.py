"""``bakeoff qualify``'s progress: the phases before the checks, then each backend's evaluation
(issue 21, item 1).

Three modes, chosen once per command:

- ``live`` (stdout is a terminal): one rich ``Live`` display for the whole command: first the
  engine environments and the fixture (``cli/phases.py``: step, elapsed, pip's last
  line; steps, loss, ETA), then a table of checks x backends that fills in as each check lands
  in the run's ``verdict.json`` (rewritten after every check), with each backend's elapsed time
  and, while the sweep runs, its latest point; pytest's own output goes to ``pytest.log`` in the
  run directory.
- ``plain`` (stdout is not a terminal: CI logs): ``[envs]`` / ``[fixture]`` / ``[sweep]`` lines
  (no escape codes, each item's progress at most once per ``interval_s``) and pytest's own
  output as before.
- ``quiet`` (``--quiet``): none of it; pytest's output goes to ``pytest.log``, and the verdict
  table at the end is all that is printed.

The watcher reads only files the run writes anyway (``BAKEOFF_RUN_FILE``, ``verdict.json``) and
the sweep's ``evidence/throughput.sweep/points.jsonl`` (one line per completed point).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO

from cli.phases import PhaseBoard, Throttle
from bakeoff.host.artifacts import SWEEP_POINTS_LOG, atomic_write_text, read_json
from bakeoff.host.procs import child_preexec
from bakeoff.reporting.report import load_run, reason_lines

STYLE = {"pass": "green", "fail": "bold red", "error": "bold red", "skip": "yellow", "info": "cyan"}
SWEEP_CHECK = "throughput.sweep"
POINTS_LOG = SWEEP_POINTS_LOG  # the run layout's (bakeoff/host/artifacts.py)
FORWARD_AFTER_S = 10.0  # on an interruption, how long the child may stop on its own before bakeoff passes SIGTERM on


def choose_mode(quiet: bool, stream: IO | None = None) -> str:
    """``quiet``, ``live`` (a terminal) or ``plain``; ``stream`` defaults to the current ``sys.stdout``."""
    if quiet:
        return "quiet"
    return "live" if (stream or sys.stdout).isatty() else "plain"


def run_dir_of(run_file: str) -> Path | None:
    """The run directory named in ``run_file``, once the plugin wrote it."""
    try:
        text = Path(run_file).read_text().strip()
    except OSError:
        return None
    return Path(text) if text else None


def read_checks(run_file: str) -> tuple[Path | None, list[dict]]:
    """The run directory named in ``run_file`` (once the plugin wrote it) and its checks so far."""
    run_dir = run_dir_of(run_file)
    if run_dir is None:
        return None, []
    try:
        checks = read_json(run_dir / "verdict.json").get("checks", [])
        return run_dir, [c for c in checks if isinstance(c, dict) and "name" in c and "status" in c]
    except (OSError, ValueError, AttributeError, TypeError):  # not written yet
        return run_dir, []


def read_point(run_dir: Path | None) -> dict | None:
    """The latest completed sweep point of a run (the last whole line of ``POINTS_LOG``)."""
    if run_dir is None:
        return None
    try:
        text = (run_dir / POINTS_LOG).read_text(errors="replace")
    except OSError:
        return None
    for line in reversed(text.splitlines(keepends=True)):
        if line.endswith("\n") and line.strip():
            try:
                point = json.loads(line)
            except (ValueError, RecursionError):
                return None
            return point if isinstance(point, dict) else None
    return None


def _number(value) -> float | None:
    """A finite number from a point's field, else None (the display never trusts the file)."""
    try:
        x = float(value)
    except (TypeError, ValueError):
        return None
    return x if x == x and abs(x) != float("inf") else None


def point_text(p: dict) -> str:
    """``sweep 4 sessions: 1,490 tok/s, TTFT p50 35 ms``."""
    n = p.get("sessions")
    tps, ttft = _number(p.get("output_tokens_per_s")), _number(p.get("ttft_p50_ms"))
    text = f"sweep {n} session{'' if n == 1 else 's'}: " + (f"{tps:,.0f} tok/s" if tps is not None else "– tok/s")
    if ttft is not None:
        text += f", TTFT p50 {ttft:,.0f} ms"
    return text + (" (invalid)" if p.get("valid") is False else "") + (f", {p['errors']} errors" if p.get("errors") else "")


def table(rows: dict[str, dict], elapsed_s: dict[str, float], sweeps: dict[str, dict] | None = None):
    """A rich table: one row per check (in the order they landed), one column per backend; a
    backend whose sweep is running shows its latest point in the sweep's row."""
    from rich.markup import escape
    from rich.table import Table

    sweeps = sweeps or {}
    t = Table(title="bakeoff qualify", title_justify="left")
    t.add_column("check")
    for label in rows:  # a label holds the user's --matrix values: text, never rich markup
        t.add_column(escape(f"{label} ({elapsed_s.get(label, 0):.0f} s)"))
    names: list[str] = []
    for checks in rows.values():
        names += [n for n in checks if n not in names]
    if SWEEP_CHECK not in names and any(sweeps.get(label) for label in rows):
        names.append(SWEEP_CHECK)
    for name in names:
        cells = []
        for label, checks in rows.items():
            c = checks.get(name)
            if c is None:
                sweeping = name == SWEEP_CHECK and sweeps.get(label)
                cells.append(f"[cyan]{point_text(sweeps[label])}[/]" if sweeping else "")
            else:
                text = escape(str(c["status"]) + (f" ({c['failure_class']})" if c.get("failure_class") else ""))
                cells.append(f"[{STYLE.get(c['status'], '')}]{text}[/]" if STYLE.get(c["status"]) else text)
        t.add_row(escape(str(name)), *cells)
    return t


class Progress:
    """One view for the whole command: the phases (``phases``, a :class:`PhaseBoard`), then each
    evaluation subprocess, in the chosen mode."""

    def __init__(self, mode: str, poll_s: float = 0.5, interval_s: float = 10.0):
        self.mode = mode
        self.poll_s = poll_s
        self.phases = PhaseBoard(mode, interval_s=interval_s)
        self.rows: dict[str, dict] = {}
        self.elapsed_s: dict[str, float] = {}
        self.sweeps: dict[str, dict | None] = {}
        self._throttle = Throttle(interval_s)
        self._lock = threading.Lock()
        self._live = None

    def __enter__(self) -> "Progress":
        if self.mode == "live":
            from rich.live import Live

            self._live = Live(get_renderable=self._render, refresh_per_second=4, transient=False)
            self._live.__enter__()
        self.phases.start()
        return self

    def __exit__(self, *exc) -> None:
        self.phases.close()
        if self._live is not None:
            self._live.__exit__(*exc)

    def _render(self):
        from rich.console import Group

        parts = [self.phases.table()] if self.phases.items else []
        with self._lock:
            if self.rows:
                parts.append(table(self.rows, self.elapsed_s, self.sweeps))
        return Group(*parts)

    def say(self, text: str) -> None:
        """A line of the command's own (not in quiet mode)."""
        if self.mode != "quiet":
            print(text, flush=True)

    def announce(self, label: str, cmd: list[str]) -> None:
        if self.mode == "plain":
            print(f"\n=== {label} ===\n$ {' '.join(cmd)}", flush=True)

    def run(self, label: str, cmd: list[str], env: dict, cwd: str, run_file: str) -> tuple[int, Path | None]:
        """Run one evaluation; returns its exit code and run directory (None if it wrote none).
        Outside ``plain`` mode its output is kept in ``pytest.log`` of the run directory (or, when
        it wrote no run, its tail is printed to stderr)."""
        with self._lock:
            self.rows[label] = {}
        t0 = time.monotonic()
        if self.mode == "plain":
            proc = subprocess.Popen(cmd, env=env, cwd=cwd, preexec_fn=child_preexec())  # dies with bakeoff
            self._watch(proc, lambda: self._sweep_line(label, run_file))
            self._sweep_line(label, run_file, final=True)
            return proc.returncode, read_checks(run_file)[0]
        log = Path(run_file).with_suffix(".log")
        try:
            with open(log, "wb") as out:
                proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                                        preexec_fn=child_preexec())  # SIGTERM when bakeoff dies, even by SIGKILL
                self._watch(proc, lambda: self._update(label, run_file, time.monotonic() - t0))
        finally:  # an interruption too: the run keeps its pytest.log and no temporary file is left
            run_dir = self._keep_log(label, run_file, log, time.monotonic() - t0)
        return proc.returncode, run_dir

    def _keep_log(self, label: str, run_file: str, log: Path, elapsed_s: float) -> Path | None:
        """Move the child's output into the run's ``pytest.log`` (or print its tail when it wrote
        no run); returns the run directory."""
        try:
            run_dir = self._update(label, run_file, elapsed_s)
        except Exception:  # noqa: BLE001 - a damaged run file must not lose the log
            run_dir = None
        text = log.read_text(errors="replace") if log.is_file() else ""
        log.unlink(missing_ok=True)
        if run_dir is not None and run_dir.is_dir():
            atomic_write_text(run_dir / "pytest.log", text)
        elif text.strip():
            print("\n".join(text.splitlines()[-20:]), file=sys.stderr)
        return run_dir

    def _watch(self, proc: subprocess.Popen, tick) -> None:
        """Call ``tick`` every ``poll_s`` until ``proc`` ends; on Ctrl-C give it (it had the
        signal too) up to 30 s to write its verdict."""
        try:
            while proc.poll() is None:
                tick()
                time.sleep(self.poll_s)
        except KeyboardInterrupt as exc:
            # Ctrl-C reached the child too (the terminal signals the whole group): give it
            # FORWARD_AFTER_S to stop on its own before passing SIGTERM on, since a signal inside
            # its teardown would cut it. A SIGTERM to bakeoff (``signal 15``, see
            # sigterm_as_interrupt) may have reached bakeoff alone: passed on at once (the child
            # ignores a second SIGTERM), else the child runs on for FORWARD_AFTER_S.
            if not str(exc).startswith(f"signal {int(signal.SIGTERM)}"):
                try:
                    proc.wait(timeout=FORWARD_AFTER_S)
                except subprocess.TimeoutExpired:
                    pass
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
            raise

    def _sweep_line(self, label: str, run_file: str, final: bool = False) -> None:
        """Plain mode: ``[sweep] LABEL: sweep 4 sessions: ...`` when a new point completed, at
        most once per interval, and the last point as soon as the sweep check is recorded (not
        after the run's verdict line, where it once came)."""
        point = read_point(run_dir_of(run_file))
        if point is None or point == self.sweeps.get(label):
            return
        if final or self._throttle.due(label) or any(c["name"] == "throughput.sweep" for c in read_checks(run_file)[1]):
            self.sweeps[label] = point
            print(f"\n[sweep] {label}: {point_text(point)}", flush=True)

    def _update(self, label: str, run_file: str, elapsed_s: float) -> Path | None:
        run_dir, checks = read_checks(run_file)
        point = read_point(run_dir)
        with self._lock:
            self.rows[label] = {c["name"]: c for c in checks}
            self.elapsed_s[label] = elapsed_s
            self.sweeps[label] = point
        if self._live is not None:
            self._live.refresh()
        return run_dir


def verdict_rows(runs: list[Path]) -> list[tuple[str, str, str, str, str, str]]:
    """``(backend, model, status, reasons, run directory name, options)`` per run, as the verdict table
    shows them: the reasons recomputed from the run's checks (every status but ``qualified`` has one),
    one short line each (the report holds them whole); the options the run was given (``k=v, ...``)."""
    rows = []
    for p in runs:
        r = load_run(p)
        rows.append((str(r["backend"]), str(r["model"]), str(r["status"]), reason_lines(r["reasons"]), p.name,
                     str(r["options"] or "")))
    return rows


def print_verdicts(runs: list[Path]) -> list[tuple[str, str, str]]:
    """Print the verdict table; returns ``(backend, status, run directory)`` per run."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    t = Table(title="bakeoff verdicts")
    for col in ("backend", "model", "status", "reasons", "run"):
        t.add_column(col)
    rows = verdict_rows(runs)
    for backend, model, status, reasons, name, options in rows:
        # a backend's runs in several configurations (--matrix, --backend-opt) told apart by their options
        shown = f"{backend} [{options}]" if options else backend
        t.add_row(*(escape(x) for x in (shown, model, status, reasons, name)))  # the engines' words: text, not markup
    Console(width=160).print(t)
    return [(row[0], row[2], str(p)) for row, p in zip(rows, runs)]
