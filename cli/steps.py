"""Where ``bakeoff qualify``'s time goes: engine environments made in the background, each run
started as soon as its own environments are made, and the time of each step printed at the end.

A fresh machine spends most of a first ``bakeoff qualify`` installing engine environments (uv from
their lock files, else pip: network, disk and bytecode compilation) and, for a fixture whose
weights do not ship (``bakeoff/models/fixtures/shipped.py``), training it (CPU). :class:`EnvPrewarm`
creates the environments the chosen backends will need (``Backend.env_specs``) in background
threads, in the order of the runs that need them, while the fixture resolves and then while the
runs go; their installers run at the lowest CPU priority (``ensure(background=True)``:
nice 19 in a session and scheduler autogroup of their own, :func:`bakeoff.host.procs.background_preexec`),
so a run measured beside them keeps the CPU it would have alone. :func:`by_readiness` hands the runs out one at a time (they measure: never two at once),
in the user's order except that a run whose environments are made goes before one whose are still
being made; transformers needs none (it runs in bakeoff's own environment) and goes first. No run
starts before its environments are made or failed, so its own ``start()`` finds them ready and never
waits on the file lock of an install (``bakeoff.host.envs.ensure``). A failed install is not
reported here: the run that needs the environment tries again in its ``start()`` and records the
failure as its ``load`` check's ``unavailable``, with the install log. Each environment's step and
the installer's last line, and the fixture's training, are shown on a ``cli/phases.py``
:class:`PhaseBoard` (:func:`prepare`) for the whole command.

:class:`StepClock` collects ``(step, seconds, note)`` rows (fixture, a run's wait for its
environments, each run with its export and engine start read from the run directory, and the
environments made beside them, not counted in the total) and prints them as one table.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Callable, Iterable, Iterator, NamedTuple

from cli.phases import fmt_s
from bakeoff.host.artifacts import read_json
from bakeoff.models.resolve import resolve

# Installs at once. Kept at two, not measured again for issue 30: on the 2-core AVX-512 host
# (docs/getting-started.md, 2026-12-03) four environments took 105 s two at a time against 111 s for the same four
# one after another (make test-fresh): bytecode compilation and unpacking share the same two cores,
# so neither is clearly faster in all; two lets a download overlap another install's compilation.
PARALLEL_INSTALLS = 2


class EnvPrewarm:
    """Create engine environments in the background, and say which are made.

    Args:
        specs: ``bakeoff.host.envs.EnvSpec`` objects, the first run's first (installs start in this
            order); duplicates (by path) are made once, ready ones not at all.
        log: progress printer (called from worker threads) when there is no ``board``.
        parallel: how many installs run at once.
        board: a :class:`cli.phases.PhaseBoard` told each step, line and result.
        ensure: makes one environment (default ``bakeoff.host.envs.ensure``; tests pass a stand-in).

    Environments are named by ``str(spec.path)`` in :meth:`unmade` and :meth:`ready`.
    """

    def __init__(self, specs: list, log: Callable[[str], None] = print, parallel: int = PARALLEL_INSTALLS,
                 board=None, ensure: Callable | None = None):
        if ensure is None:
            # lazy: tests patch bakeoff.host.envs.ensure (read at call time)
            from bakeoff.host.envs import ensure
        self._ensure = ensure
        seen: dict[str, object] = {}
        for s in specs:
            seen.setdefault(str(s.path), s)
        todo = [(p, s) for p, s in seen.items() if not s.is_ready()]
        self.specs = [s for _, s in todo]
        self._names = {p: s.name for p, s in todo}  # the environments being made, by path
        self.results: dict[str, str] = {}  # spec name -> "ready in N s" | "preinstalled" | "failed: ..."
        self._log = log
        self._board = board
        self._t0 = time.monotonic()
        self._queue = list(todo)
        self._cond = threading.Condition()
        self._span: dict[str, list[float]] = {}  # path -> [started, finished (once done)], monotonic s
        self._threads = [threading.Thread(target=self._work, name=f"bakeoff-env-{i}", daemon=True)
                         for i in range(min(parallel, len(todo)))]
        for t in self._threads:
            t.start()

    def _work(self) -> None:
        while True:
            with self._cond:
                if not self._queue:
                    return
                path, spec = self._queue.pop(0)
                self._span[path] = [time.monotonic()]
            t0, board, how, ok = time.monotonic(), self._board, "failed (interrupted); its run records why", False
            log = (lambda m, n=spec.name: board.env_log(n, m)) if board else (lambda m: self._log(f"[envs] {m}"))
            step = (lambda s, p, n=spec.name: board.env_step(n, s, p)) if board else None
            try:
                python = self._ensure(spec, log, progress=step, background=True)
                how, ok = ("preinstalled" if str(python) != str(spec.python)
                           else f"ready in {time.monotonic() - t0:.0f} s"), True
            except Exception as exc:  # noqa: BLE001 - the run that needs it records the failure
                how = f"failed ({type(exc).__name__}); its run records why"
            finally:  # done either way: a run waiting on it must not wait forever
                self.results[spec.name] = how
                if board:
                    board.env_done(spec.name, how, ok)
                with self._cond:
                    self._span[path].append(time.monotonic())
                    self._cond.notify_all()

    def unmade(self, paths: Iterable[str]) -> list[str]:
        """Names of the environments among ``paths`` still being made (or waiting to be)."""
        with self._cond:
            return [self._names[p] for p in paths if p in self._names and len(self._span.get(p, ())) < 2]

    def ready(self, paths: Iterable[str]) -> bool:
        """Whether every environment among ``paths`` is made (or failed: its run records why)."""
        return not self.unmade(paths)

    def made_between(self, t0: float, t1: float) -> list[str]:
        """Names of the environments whose install ran during part of ``[t0, t1]`` (monotonic s)."""
        with self._cond:
            return [self._names[p] for p, span in self._span.items()
                    if span[0] < t1 and (len(span) < 2 or span[1] > t0)]

    def wait_until(self, predicate: Callable[[], bool], poll_s: float = 1.0) -> None:
        """Block until ``predicate()`` holds, checked each time an environment is done (and every
        ``poll_s``, so that Ctrl-C is taken)."""
        with self._cond:
            while not predicate():
                self._cond.wait(poll_s)

    def wait(self) -> float:
        """Block until every environment is made; returns seconds since the prewarm started."""
        for t in self._threads:
            t.join()
        return time.monotonic() - self._t0

    def elapsed_s(self) -> float:
        """Seconds from the prewarm's start to the last environment made (to now while one is not)."""
        with self._cond:
            ends = [span[1] if len(span) > 1 else time.monotonic() for span in self._span.values()]
        return max(ends, default=self._t0) - self._t0 if self._names else 0.0


class Next(NamedTuple):
    """A run :func:`by_readiness` hands out: the run, the seconds it waited for its environments,
    their names, and the runs it went before (their labels)."""

    run: object
    waited_s: float
    waited_for: list[str]
    overtook: list[str]


def by_readiness(runs: list, needs: Callable[[object], list[str]], prewarm: EnvPrewarm,
                 label: Callable[[object], str] = str, say: Callable[[str], None] = lambda s: None) -> Iterator[Next]:
    """The runs one at a time, each once its environments are made: the first in ``runs``' order
    whose environments are all made (or failed), waiting while none is.

    Args:
        runs: the runs in the user's order.
        needs: a run's environments, as ``str(spec.path)`` (``[]``: none, it can go at once).
        prewarm: the installs.
        label: a run's name in the lines said.
        say: where ``waiting for ...`` and ``... goes before ...`` lines go.

    Yields:
        :class:`Next`; the wait is measured from when the previous run ended (the generator resumed).
    """
    pending = list(runs)
    while pending:
        t0 = time.monotonic()
        missing = {id(r): prewarm.unmade(needs(r)) for r in pending}
        first = next((r for r in pending if prewarm.ready(needs(r))), None)
        if first is None:
            say(f"{label(pending[0])}: waiting for its environment ({', '.join(missing[id(pending[0])])})")
            found: list = []

            def any_ready() -> bool:
                found[:] = [r for r in pending if prewarm.ready(needs(r))][:1]
                return bool(found)

            prewarm.wait_until(any_ready)
            first = found[0]
        ahead = pending[:pending.index(first)]
        overtook = [label(r) for r in ahead]
        if overtook:
            unmade = sorted({n for r in ahead for n in prewarm.unmade(needs(r))})
            say(f"{label(first)} goes before {', '.join(overtook)}: its environment is made, "
                f"{', '.join(unmade) or 'theirs'} not yet")
        pending.remove(first)
        yield Next(first, time.monotonic() - t0, missing[id(first)], overtook)


def prepare(model: str, specs: list, board, clock: "StepClock") -> tuple:
    """Start making the environments of ``specs`` in the background, then resolve ``model`` (a
    fixture is copied from its shipped weights, or trained) while they are made, both shown on
    ``board``; returns the resolved model and the :class:`EnvPrewarm` (still making them)."""
    prewarm = EnvPrewarm(specs, board=board)
    t_fixture = time.monotonic()
    resolved = resolve(model, log=board.fixture_log)
    clock.add("fixture" if resolved.fixture else "model", time.monotonic() - t_fixture, model)
    return resolved, prewarm


class StepClock:
    """Rows of ``(step, seconds, note)``, printed as one table by :meth:`print`; the total adds
    the rows that follow one another (not those of work done beside them: ``beside=True``)."""

    def __init__(self):
        self.rows: list[tuple[str, float, str]] = []
        self._counted: list[bool] = []  # per row: in the total

    def add(self, step: str, seconds: float, note: str = "", beside: bool = False, at: int | None = None) -> None:
        """A row, appended (or inserted at index ``at``); ``beside``: left out of the total."""
        at = len(self.rows) if at is None else at
        self.rows.insert(at, (step, seconds, note))
        self._counted.insert(at, not beside)

    def add_envs(self, prewarm: EnvPrewarm) -> None:
        """The environments' row, after the fixture's: how long the installs took in all and each
        one's result; made beside the fixture and the runs, so not in the total."""
        if prewarm.specs:
            self.add("environments", prewarm.elapsed_s(), "beside the fixture and the runs, not in the total: "
                     + "; ".join(f"{s.name} {prewarm.results.get(s.name, 'not made')}" for s in prewarm.specs),
                     beside=True, at=1 if self.rows and self.rows[0][0] in ("fixture", "model") else 0)

    def add_run(self, label: str, seconds: float, run_dir: Path | None, waited: Next | None = None,
                installs: list[str] | None = None) -> None:
        """A run's row (after a ``wait for ...`` row when it waited for its environments); its note
        says how long it waited, how long its export and its engine start took (read from
        ``engine/export.json`` and ``verdict.json``'s ``backend_info``) where it had them, and which
        environments were being installed beside it (``installs``: its figures were measured on a
        CPU they shared)."""
        parts = []
        if waited is not None and waited.waited_for and waited.waited_s >= 0.5:
            envs = ", ".join(waited.waited_for)
            self.add(f"wait for {envs}", waited.waited_s, f"run {label} waited for its environment")
            parts.append(f"waited {fmt_s(waited.waited_s)} for its environment ({envs})")
        parts.append(run_note(run_dir) if run_dir else "no run written")
        if installs:
            parts.append(f"beside the install of {', '.join(installs)}")
        self.add(f"run {label}", seconds, ", ".join(p for p in parts if p))

    def print(self, out: Callable[[str], None] = print) -> None:
        if not self.rows:
            return
        total = sum(row[1] for row, counted in zip(self.rows, self._counted) if counted)
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
            what = "attached to a running server" if info.get("device") == "remote" else "engine start"
            parts.append(f"{what} {float(info['startup_s']):.0f} s")
    except (OSError, ValueError, TypeError, AttributeError):
        pass
    return ", ".join(parts)


