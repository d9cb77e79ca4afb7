"""Supervising a launched engine's ranks (docs/design.md "Multi-process engines").

:class:`backends._server.ChildServerBackend` calls these around its template: :func:`prepare_env`
before the launch (the user's ``env`` option, and the rank-environment hook where the engine has
ranks), :func:`after_start` once it serves (the :class:`bakeoff.host.ranks.RankWatch`, every
variable verified in every rank, ``ranks.json``, the census in ``rank_notes`` for the run's notes), :func:`progress` for the hang rule,
:func:`name_lost_rank` and :func:`hang_evidence` when a request fails, :func:`finish` at stop.
A backend says what a rank is with its ``rank_title`` pattern (named groups ``pp`` and ``tp``
read from the process title); without one nothing here runs but the ``env`` option.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from bakeoff.api.errors import EngineFailure
from bakeoff.host import ranks as host_ranks
from bakeoff.loadgen.progress import Progress

HOOK_DIR = Path(__file__).resolve().parent / "_hosting" / "rank_env"
# CPU seconds per second at which the slowest rank of a stage counts as computing (as CPU_COMPUTING_CORES)
RANK_COMPUTING_CORES = 0.10


def rank_of(pattern: re.Pattern | None):
    """A command line -> ``(label, stage, tp)`` by the backend's title pattern (None: no rank)."""
    def read(cmdline: str) -> tuple[str, int, int] | None:
        m = pattern.search(cmdline) if pattern is not None else None
        if m is None:
            return None
        pp, tp = m.groupdict().get("pp"), m.groupdict().get("tp")
        label = "_".join(x for x in (f"PP{pp}" if pp else "", f"TP{tp}" if tp else "") if x) or "0"
        return label, int(pp or 0), int(tp or 0)
    return read


def prepare_env(backend, env: dict[str, str]) -> dict[str, str]:
    """The launch environment with the user's ``env`` option last (it wins over bakeoff's defaults),
    and, for an engine with ranks, the hook that makes each Python process report the verified
    variables (:func:`wanted`). Sets ``backend.verified_env``."""
    user = dict(getattr(backend.options, "env", None) or {})
    env = dict(env, **user)
    own = getattr(backend, "engine_env_set", None) or {}
    backend.verified_env = {k: env[k] for k in list(own) + list(user) if k in env}
    if backend.rank_title is not None and backend.verified_env:
        backend.rank_env_dir = Path(backend.workdir) / "rank-env"
        env.update(host_ranks.hook_env(backend.rank_env_dir, sorted(backend.verified_env), HOOK_DIR,
                                       env.get("PYTHONPATH")))
    return env


def after_start(backend) -> None:
    """Once the engine serves: its ranks watched, each verified variable checked in every rank and in
    the server's process, ``ranks.json`` written, the census in the run's notes.

    Raises:
        EngineFailure: ``config-rejected`` naming the variable and the rank it did not reach (the
            engine stopped first).
    """
    if backend.rank_title is None or backend.proc is None:
        return
    watch = host_ranks.RankWatch(backend.proc.members, rank_of(backend.rank_title)).start()
    backend.rank_watch = watch
    ranks = watch.ranks()
    expected = backend.expected_ranks()
    if expected and 0 < len(ranks) < expected:  # some ranks by their titles, not all: one was lost starting
        backend.rank_env_table = None
        evidence = {"ranks.json": json.dumps(record(backend), indent=1), "engine.log.tail": backend.log_tail(120)}
        backend.stop()
        raise EngineFailure("runtime-crash", f"{len(ranks)} of the {expected} ranks asked for are running at start "
                            f"({', '.join(r.label for r in ranks)}): a rank process was lost while the engine started",
                            evidence)
    missing, unverifiable, table = ([], [], {})
    if backend.verified_env:
        missing, unverifiable, table = host_ranks.check_environment(
            ranks, [(backend.proc.pid, "the server")], backend.verified_env, getattr(backend, "rank_env_dir", None))
    backend.rank_env_table = {"variables": sorted(backend.verified_env), "processes": table,
                              "unverifiable": unverifiable}
    write(backend)
    backend.rank_notes = {"ranks": (f"{len(ranks)} rank process{'es' if len(ranks) > 1 else ''}: " + ", ".join(
        f"{r.label} pid {r.pid}" for r in ranks) if ranks else "no rank process found (a single-process engine)")}
    if backend.verified_env:
        backend.rank_notes["rank_environment"] = (
            f"{len(backend.verified_env)} variables checked in {len(table) - len(unverifiable)} processes"
            + (f"; not verifiable in {len(unverifiable)}: " + "; ".join(unverifiable) if unverifiable else ""))
    if missing:
        evidence = {"ranks.json": json.dumps(record(backend), indent=1)}
        backend.stop()
        raise EngineFailure("config-rejected", "; ".join(missing[:3]) + (f" (+{len(missing) - 3} more)" if len(missing) > 3
                                                                          else ""), evidence)


def record(backend) -> dict[str, Any]:
    watch = getattr(backend, "rank_watch", None)
    out = watch.record() if watch is not None else {"ranks": []}
    out["environment"] = getattr(backend, "rank_env_table", None)
    return out


def write(backend) -> None:
    """``ranks.json`` in the run's engine folder (each rank as seen, the environment table)."""
    try:
        (Path(backend.workdir) / "ranks.json").write_text(json.dumps(record(backend), indent=1))
    except OSError:  # evidence is best effort; the run goes on
        pass


def progress(backend) -> Progress | None:
    """The hang rule's reading for an engine with two ranks or more: the slowest rank's CPU per stage
    (:meth:`bakeoff.host.ranks.RankWatch.progress_cpu_s`); None otherwise (the group's CPU then)."""
    watch = getattr(backend, "rank_watch", None)
    if watch is None or len(watch.ranks()) < 2:
        return None
    return Progress(watch.progress_cpu_s, "CPU s of the slowest rank", RANK_COMPUTING_CORES,
                    f"CPU time of the slowest of the engine's {len(watch.ranks())} ranks per pipeline stage "
                    "(a rank spinning while its peer waits is not progress; backends/_ranks.py)")


RANK_LOG_LINE = re.compile(r"^\((\w+) pid=(\d+)\) ERROR [^\]]*\] ?(.*)$")
EXCEPTION = re.compile(r"^[A-Za-z_.]*(?:Error|Exception|Exit)\b")


def rank_error(log: str, ranks: list) -> str | None:
    """The rank whose ERROR lines come first in the engine's log (vLLM prefixes each line with the
    process, ``(Worker_PP1 pid=13810) ERROR ...``), with its exception: "rank PP1 (pid N) failed
    first: AssertionError (assert self.intermediate_tensors is not None)"; None when no rank logged
    an error. The rank that raised is the root cause; the ones that ended after it followed."""
    by_pid = {r.pid: r for r in ranks}
    first, lines = None, []
    for ln in log.splitlines():
        m = RANK_LOG_LINE.match(ln.strip())
        if not m or int(m.group(2)) not in by_pid:
            continue
        pid = int(m.group(2))
        first = first if first is not None else pid
        if pid == first:
            lines.append(m.group(3).strip())
    if first is None:
        return None
    text = [x for x in lines if x and not x.startswith(("File ", "Traceback", "^", "~"))]
    exc = [i for i, x in enumerate(text) if EXCEPTION.match(x)]
    what = text[exc[-1]] if exc else (text[-1] if text else "an error")
    if exc and ":" not in what and exc[-1] > 0:  # a bare "AssertionError": the statement above it says which
        what = f"{what} ({text[exc[-1] - 1][:160]})"
    return f"{by_pid[first].describe()} failed first: {what[:240]}"


def name_lost_rank(backend, exc: EngineFailure) -> EngineFailure:
    """A failure while serving, with the rank at its root named (message and ``ranks.json``): the rank
    whose error the log shows first (:func:`rank_error`), else the rank found gone first; a
    ``hang`` whose rank is gone is the crash of that rank (``runtime-crash``). Returns ``exc``."""
    watch = getattr(backend, "rank_watch", None)
    if watch is None:
        return exc
    watch.refresh()
    gone = watch.ended()
    if gone:
        first = gone[0]
        if getattr(backend, "rank_cause", None) is None:  # once: later failures read a log that moved on
            backend.rank_cause = (rank_error(backend.log_tail(3000), watch.ranks())
                                  or f"{first.describe()} ended first ({first.cmdline[:80]})")
        line = backend.rank_cause
        if line not in exc.message:
            exc.message = f"{line}; {exc.message}"
        if exc.failure_class == "hang":
            exc.failure_class = "runtime-crash"
    if gone or exc.failure_class == "hang":
        exc.evidence.setdefault("ranks.json", json.dumps(record(backend), indent=1))
    return exc


def hang_evidence(backend, exc: EngineFailure) -> None:
    """A hang's per-rank CPU over the last interval, beside its message."""
    watch = getattr(backend, "rank_watch", None)
    if watch is not None and exc.failure_class == "hang" and "per rank:" not in exc.message:
        exc.message = f"{exc.message}; per rank: {watch.rates_text()}"


def finish(backend) -> None:
    """At stop: the watch's last sample and ``ranks.json`` with the whole run's CPU and memory."""
    watch = getattr(backend, "rank_watch", None)
    if watch is not None and not watch.stopped:  # a second stop() finds the ranks gone: the record stays
        watch.stop()
        write(backend)
