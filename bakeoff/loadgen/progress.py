"""Slow is not hung: is an engine that sent no byte computing, or stopped?

A request with no byte for the progress timeout used to be a ``hang`` at once. Where the caller
can read the engine's progress (a :class:`Progress`: the CPU time of the process group bakeoff
launched, or a server's own token counters), the HTTP reader asks this module instead
(docs/design.md "Failure classes", the hang rule):

- the engine's progress over a window inside the silence (from the first sample taken after the
  last byte, or the send, to now; where none was taken, from now over a quarter timeout more; later,
  from the previous check) at or above the source's
  ``min_rate_per_s``: it computes, the request keeps waiting, up to an overall deadline counted
  from the request's send (``deadline_s``, a multiple of the timeout); past it the request ends
  ``slo-miss``: slow, with the rate measured, never ``hang``;
- below it (CPU time flat: a stopped, sleeping or deadlocked engine): ``hang``, with the
  progress of that window as evidence;
- progress that cannot be read (the processes gone, ``/metrics`` not answering): ``hang``, as before.

Samples are taken lazily: when a request is sent or a chunk arrives and the newest sample is
older than a quarter of the timeout (in the loop's executor: a read of ``/proc`` or of a
server's ``/metrics`` never blocks the streams), and at each check. Nothing imports a backend:
the caller hands the reading in.
"""

from __future__ import annotations

import asyncio
import collections
import json
import time
from dataclasses import dataclass
from typing import Callable, Literal

from bakeoff.api.errors import EngineFailure

# Seconds: concurrent checks at one watchdog tick share one fresh sample.
REUSE_S = 0.25
# Seconds: a sample taken this much before a silence began still starts its window (the send's own
# sample is read in the executor as the request is written).
SAMPLE_SLACK_S = 0.05


@dataclass(frozen=True)
class Progress:
    """A reading of how much work an engine has done, from outside it.

    Attributes:
        read: returns a count that only grows while the engine works (CPU seconds of its
            processes, tokens it processed), or None when it cannot be read; called off the
            event loop.
        unit: what ``read`` counts, for messages (``CPU s``, ``tokens``).
        min_rate_per_s: the rate, in ``unit`` per second over a window, at which the engine
            counts as computing; 0 means any advance.
        source: where the reading comes from, for evidence.
    """

    read: Callable[[], float | None]
    unit: str
    min_rate_per_s: float
    source: str


@dataclass(frozen=True)
class Window:
    """The engine's progress between two samples (monotonic seconds)."""

    start_s: float
    end_s: float
    used: float  # in the Progress's unit
    unit: str
    min_rate_per_s: float
    source: str

    @property
    def seconds(self) -> float:
        return max(1e-9, self.end_s - self.start_s)

    @property
    def rate_per_s(self) -> float:
        return self.used / self.seconds

    @property
    def computing(self) -> bool:
        """Work at or above the threshold (and some work at all: a flat count never is)."""
        return self.used > 0 and self.rate_per_s >= self.min_rate_per_s

    def words(self) -> str:
        """E.g. ``the engine used 0.00 CPU s in 10.3 s (0% of one core; computing is 10% of one core)``."""
        rate = (f"{self.rate_per_s:.0%} of one core" if self.unit == "CPU s" else f"{self.rate_per_s:.3g} {self.unit}/s")
        floor = (f"{self.min_rate_per_s:.0%} of one core" if self.unit == "CPU s" else
                 ("any advance" if self.min_rate_per_s <= 0 else f"{self.min_rate_per_s:g} {self.unit}/s"))
        return f"the engine used {self.used:.2f} {self.unit} in {self.seconds:.1f} s ({rate}; computing is {floor})"

    def as_json(self) -> dict:
        return {"window_s": round(self.seconds, 3), "used": round(self.used, 4), "unit": self.unit,
                "rate_per_s": round(self.rate_per_s, 4), "min_rate_per_s": self.min_rate_per_s,
                "computing": self.computing, "source": self.source}


class ProgressWatch:
    """Samples of one engine's progress, shared by every request of a client (any event loop).

    Args:
        progress: the reading.
        timeout_s: the progress timeout (no byte for this long asks for a check).
        deadline_s: the longest a request may wait without a byte while the engine computes,
            counted from its send; at least ``timeout_s``.
    """

    def __init__(self, progress: Progress, timeout_s: float, deadline_s: float):
        self.progress = progress
        self.timeout_s = timeout_s
        self.deadline_s = max(deadline_s, timeout_s)
        self.every_s = timeout_s / 4
        self.samples: collections.deque[tuple[float, float]] = collections.deque(maxlen=256)
        self._next_touch_s = 0.0
        self._sample()  # a baseline for the first requests

    def _sample(self) -> tuple[float, float | None]:
        try:
            value = self.progress.read()
        except Exception:  # noqa: BLE001 - a reading that fails is no evidence of progress, not a crash
            value = None
        t = time.monotonic()
        if value is not None:
            self.samples.append((t, float(value)))  # deque.append is atomic: executor threads append too
        return t, value

    def touch(self) -> None:
        """Take a sample in the background when the newest is older than a quarter timeout
        (called at each send and each received chunk: a float comparison otherwise)."""
        now = time.monotonic()
        if now < self._next_touch_s:
            return
        self._next_touch_s = now + self.every_s
        try:
            asyncio.get_running_loop().run_in_executor(None, self._sample)
        except RuntimeError:
            self._sample()

    async def sample_now(self) -> tuple[float, float | None]:
        """A fresh sample (one taken within ``REUSE_S`` is reused), read off the event loop."""
        if self.samples and time.monotonic() - self.samples[-1][0] <= REUSE_S:
            return self.samples[-1]
        return await asyncio.get_running_loop().run_in_executor(None, self._sample)

    def baseline(self, since_s: float, until_s: float) -> tuple[float, float] | None:
        """The oldest sample taken inside a silence that began at ``since_s`` (``SAMPLE_SLACK_S``
        earlier at most: the send's sample lands as the request goes out) and no later than
        ``until_s``; None when there is none."""
        inside = [s for s in list(self.samples) if since_s - SAMPLE_SLACK_S <= s[0] <= until_s]
        return min(inside, default=None)

    def patience(self, t_send_s: float) -> "Patience":
        """The check of one request sent at ``t_send_s`` (monotonic seconds)."""
        self.touch()
        return Patience(self, t_send_s)


class Patience:
    """One request's answer to "no byte within the timeout: wait on?" (the HTTP reader's hook).

    After the request ended by a timeout, :attr:`outcome` says why: ``hang`` (no progress, or
    none readable) or ``slow`` (computing past the deadline); :attr:`window` holds the last
    window's progress and :attr:`whole` the progress since the first check's baseline.
    """

    def __init__(self, watch: ProgressWatch, t_send_s: float):
        self.watch = watch
        self.t_send_s = t_send_s
        self.outcome: Literal["hang", "slow"] | None = None
        self.window: Window | None = None
        self.whole: Window | None = None
        self.checks = 0
        self.reason = ""
        self._first: tuple[float, float] | None = None  # the first window's start: the whole's
        self._last: tuple[float, float] | None = None  # this silence's previous check

    async def __call__(self, waited_s: float) -> float | None:
        """Seconds to keep waiting for the next byte, or None to end the request (by :attr:`outcome`).

        Args:
            waited_s: seconds since the last byte (or the send): the silence so far.
        """
        w = self.watch
        t, value = await w.sample_now()
        self.checks += 1
        left_s = self.t_send_s + w.deadline_s - t
        if value is None:
            self.outcome, self.reason = "hang", f"the engine's progress could not be read ({w.progress.source})"
            return None
        since_s = t - waited_s
        if self._last is not None and since_s > self._last[0] + SAMPLE_SLACK_S:
            self._last = None  # a byte came after the last check: a new silence, a new window
        base = self._last or w.baseline(since_s, t - w.timeout_s / 4)
        self._last = (t, value)
        if base is None:  # no sample inside the silence yet: measure over a quarter timeout from now
            self._first = self._first or (t, value)
            return max(0.05, min(w.timeout_s / 4, left_s))
        p = w.progress
        self.window = win = Window(base[0], t, max(0.0, value - base[1]), p.unit, p.min_rate_per_s, p.source)
        self._first = self._first or base
        self.whole = Window(self._first[0], t, max(0.0, value - self._first[1]), p.unit, p.min_rate_per_s, p.source)
        if not win.computing:
            self.outcome, self.reason = "hang", f"no progress: {win.words()}"
            return None
        if left_s <= 0.05:
            self.outcome, self.reason = "slow", f"still computing: {win.words()}"
            return None
        return min(w.timeout_s, left_s)

    def evidence(self) -> dict:
        """What the checks measured, for ``hang.json`` / ``slow.json``."""
        return {"checks": self.checks, "deadline_s": self.watch.deadline_s,
                "window": self.window.as_json() if self.window else None,
                "since_first_check": self.whole.as_json() if self.whole else None, "reason": self.reason}


def timeout_failure(what: str, base_url: str, nbytes: int, elapsed_s: float, timeout_s: float,
                    patience: Patience | None):
    """The failure of a request that got no byte within ``timeout_s``, as its checks judged it.

    Returns:
        An ``EngineFailure``: ``slo-miss`` when the engine was still computing at the deadline
        (slow, not hung; ``slow.json`` with the rate), else ``hang`` (``hang.json``, with the
        progress of the last window where it was read).
    """
    record = {"request": what, "bytes": nbytes, "elapsed_s": round(elapsed_s, 3), "read_timeout_s": timeout_s}
    if patience is not None and patience.outcome == "slow":
        whole = patience.whole
        record["progress"] = patience.evidence()
        return EngineFailure("slo-miss", f"{what} on {base_url}: slow, not hung: no byte after {nbytes} bytes while the "
                             f"engine kept computing, until the deadline of {patience.watch.deadline_s:g} s from the send "
                             f"(the request was open {elapsed_s:.1f} s); {whole.words() if whole else patience.reason}",
                             {"slow.json": json.dumps(record)})
    message = (f"{what} on {base_url}: no byte for {timeout_s:g} s (the read timeout) after {nbytes} bytes; "
               f"the request was open {elapsed_s:.1f} s")
    if patience is not None and patience.outcome == "hang":
        record["progress"] = patience.evidence()
        message += f"; {patience.reason}"
    return EngineFailure("hang", message, {"hang.json": json.dumps(record)})
