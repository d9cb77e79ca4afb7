"""Where ``bakeoff qualify``'s time goes: engine environments made while the fixture resolves, and
the time of each step printed at the end.

A fresh machine spends most of a first ``bakeoff qualify`` installing engine environments (uv from
their lock files, else pip: network, disk and bytecode compilation) and, for a fixture whose
weights do not ship (``bakeoff/models/fixtures/shipped.py``), training it (CPU). :class:`EnvPrewarm` creates the
environments the chosen backends will need (``Backend.env_specs``) in background threads while
the fixture builds, so the two overlap; each backend's own ``start()`` then finds its
environment ready, or waits on the same file lock (``bakeoff.host.envs.ensure``) if it is still
being made. A failed install is not reported here: the run that needs the environment records
it as its ``load`` check's ``unavailable``, with the pip log. Each environment's step and
pip's last line, and the fixture's training, are shown on a ``bakeoff/cli/phases.py``
:class:`PhaseBoard` (:func:`prepare`).

:class:`StepClock` collects ``(step, seconds, note)`` rows (environments, fixture, each run with
its export and engine start read from the run directory) and prints them as one table.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Callable

from bakeoff.cli.phases import fmt_s
from bakeoff.host.artifacts import read_json


class EnvPrewarm:
    """Create engine environments in the background.

    Args:
        specs: ``bakeoff.host.envs.EnvSpec`` objects; duplicates (by path) are made once.
        log: progress printer (called from worker threads) when there is no ``board``.
        parallel: how many installs run at once.
        board: a :class:`bakeoff.cli.phases.PhaseBoard` told each step, line and result.
    """

    def __init__(self, specs: list, log: Callable[[str], None] = print, parallel: int = 2, board=None):
        from bakeoff.host import envs

        self._envs = envs
        seen: dict[str, object] = {}
        for s in specs:
            seen.setdefault(str(s.path), s)
        self.specs = [s for s in seen.values() if not s.is_ready()]
        self.results: dict[str, str] = {}  # spec name -> "ready in N s" | "preinstalled" | "failed: ..."
        self._log = log
        self._board = board
        self._t0 = time.monotonic()
        self._queue = list(self.specs)
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._work, name=f"bakeoff-env-{i}", daemon=True)
                         for i in range(min(parallel, len(self.specs)))]
        for t in self._threads:
            t.start()

    def _work(self) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    return
                spec = self._queue.pop(0)
            t0, board, ok = time.monotonic(), self._board, True
            log = (lambda m, n=spec.name: board.env_log(n, m)) if board else (lambda m: self._log(f"[envs] {m}"))
            step = (lambda s, path, n=spec.name: board.env_step(n, s, path)) if board else None
            try:
                python = self._envs.ensure(spec, log, progress=step)
                how = "preinstalled" if str(python) != str(spec.python) else f"ready in {time.monotonic() - t0:.0f} s"
            except Exception as exc:  # noqa: BLE001 - the run that needs it records the failure
                how, ok = f"failed ({type(exc).__name__}); its run records why", False
            self.results[spec.name] = how
            if board:
                board.env_done(spec.name, how, ok)

    def wait(self) -> float:
        """Block until every environment is made; returns seconds since the prewarm started."""
        for t in self._threads:
            t.join()
        return time.monotonic() - self._t0


def prepare(model: str, specs: list, board, clock: "StepClock"):
    """Make the environments of ``specs`` in the background while ``model`` resolves (a fixture
    trains on first use), both shown on ``board``; returns the resolved model."""
    from bakeoff.models.resolve import resolve

    prewarm = EnvPrewarm(specs, board=board)
    t_fixture = time.monotonic()
    resolved = resolve(model, log=board.fixture_log)
    clock.add("fixture", time.monotonic() - t_fixture, model)
    if prewarm.specs:
        waited = time.monotonic()
        total = prewarm.wait()
        clock.add("environments", time.monotonic() - waited,
                  f"{total:.0f} s in all, beside the fixture: " + "; ".join(f"{k} {v}" for k, v in prewarm.results.items()))
    return resolved


class StepClock:
    """Rows of ``(step, seconds, note)``, printed as one table by :meth:`print`."""

    def __init__(self):
        self.rows: list[tuple[str, float, str]] = []

    def add(self, step: str, seconds: float, note: str = "") -> None:
        self.rows.append((step, seconds, note))

    def add_run(self, label: str, seconds: float, run_dir: Path | None) -> None:
        """A run's row; its note says how long its export and its engine start took (read from
        ``engine/export.json`` and ``verdict.json``'s ``backend_info``) where it had them."""
        self.add(f"run {label}", seconds, run_note(run_dir) if run_dir else "no run written")

    def print(self, out: Callable[[str], None] = print) -> None:
        if not self.rows:
            return
        total = sum(s for name, s, _ in self.rows if not name.startswith("  "))
        out("\ntime per step:")
        width = max(len(name) for name, _, _ in self.rows)
        for name, s, note in self.rows:
            out(f"  {name:<{width}}  {fmt_s(s):>8}  {note}".rstrip())
        out(f"  {'total':<{width}}  {fmt_s(total):>8}")


def run_note(run_dir: Path) -> str:
    """``export 13 s (cached), engine start 4 s``: what a run directory says of its start."""
    parts = []
    try:
        exp = read_json(run_dir / "engine" / "export.json")
        if exp.get("cached"):
            parts.append(f"export cached (first made in {exp.get('duration_s')} s)")
        elif exp.get("duration_s") is not None:
            parts.append(f"export {exp['duration_s']:.0f} s")
    except (OSError, ValueError, TypeError, AttributeError):
        pass
    try:
        info = read_json(run_dir / "verdict.json").get("backend_info") or {}
        if info.get("startup_s") is not None:
            parts.append(f"engine start {float(info['startup_s']):.0f} s")
    except (OSError, ValueError, TypeError, AttributeError):
        pass
    return ", ".join(parts)


