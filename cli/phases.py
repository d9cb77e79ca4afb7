"""What ``bakeoff qualify`` does before and beside its checks (issue 21): engine environments made
in the background (``cli/steps.py EnvPrewarm``) while the fixture is copied (shipped
weights) or trained, and, where a later run's environment is not made yet, while the earlier runs go
(the board stays up for the whole command).

:class:`PhaseBoard` keeps one item per environment (its step: ``creating venv``, ``pip install``,
``pip uninstall``, ``patching``; elapsed seconds; the last line pip wrote to its install log) and
one per fixture (steps done/total, loss, steps/s, ETA, read from the trainer's progress lines).

- ``live``: :meth:`PhaseBoard.table` is drawn by ``cli/progress.py``'s one rich ``Live``
  above the checks table.
- ``plain``: lines prefixed ``[envs]`` / ``[fixture]``, no escape codes; an item's progress line
  at most once per ``interval_s`` (a ticker thread prints the current state of each environment),
  one-off lines (an environment created or ready, the fixture's probe results) as they come.
- ``quiet``: nothing.

The host and model layers know nothing of this: they call the callbacks they are given.
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

STEP_LINE = re.compile(r"(?P<what>(?:mtp )?step) (?P<done>\d+)/(?P<total>\d+)\s+loss (?P<loss>[\d.]+)\s+"
                       r"(?P<rate>[\d.]+) steps/s")
FIXTURE_LINE = re.compile(r"^fixture (?P<name>\S+): (?P<rest>.*)$")


def fmt_s(seconds: float) -> str:
    """``4 min 05 s`` or ``12 s``."""
    m, s = divmod(int(round(max(0.0, seconds))), 60)
    return f"{m} min {s:02d} s" if m else f"{s} s"


def clip(text: str, width: int = 100) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def last_line(log_path: Path | None) -> str:
    """The last non-empty line the current command wrote to an install log (after its last
    ``$ command`` line; empty before it printed anything)."""
    if log_path is None:
        return ""
    try:
        with open(log_path, "rb") as fh:
            fh.seek(0, 2)
            fh.seek(max(0, fh.tell() - 8192))
            data = fh.read().decode(errors="replace")
    except OSError:
        return ""
    for line in reversed(data.splitlines()):
        line = line.strip()
        if line.startswith("$ "):
            return ""
        if line:
            return line
    return ""


class Throttle:
    """``due(key)``: True at most once per ``interval_s`` for each key."""

    def __init__(self, interval_s: float, clock: Callable[[], float] = time.monotonic):
        self.interval_s, self.clock, self._last = interval_s, clock, {}

    def due(self, key: str) -> bool:
        now = self.clock()
        if key in self._last and now - self._last[key] < self.interval_s:
            return False
        self._last[key] = now
        return True

    def mark(self, key: str) -> None:
        self._last[key] = self.clock()

    def age(self, key: str) -> float:
        """Seconds since ``key`` was last due (infinite if never)."""
        return self.clock() - self._last[key] if key in self._last else float("inf")


@dataclass
class Item:
    kind: str  # envs | fixture
    name: str
    t0: float
    step: str = "starting"
    log_path: Path | None = None
    detail: str = ""
    train: tuple | None = None  # (what, done, total, loss, steps/s, when read)
    done: str | None = None  # "ready in 42 s" | "preinstalled" | "failed ..."
    ok: bool = True
    t_end: float | None = None
    printed: tuple = ()  # plain: the (step, pip line) last printed


class PhaseBoard:
    """Environment and fixture progress, in the mode of the command (module docstring)."""

    def __init__(self, mode: str, out: Callable[[str], None] | None = None, interval_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic):
        self.mode, self.interval_s, self.clock = mode, interval_s, clock
        self.out = out or (lambda s: print(s, flush=True))
        self.items: dict[str, Item] = {}
        self.throttle = Throttle(interval_s, clock)
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None
        self._fixture: str | None = None  # the fixture the trainer's lines belong to
        self._lead = ""  # what a plain line starts with (runs_started)

    def start(self) -> None:
        if self.mode == "plain" and self._ticker is None:
            self._ticker = threading.Thread(target=self._tick_loop, name="bakeoff-phases", daemon=True)
            self._ticker.start()

    def close(self) -> None:
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join(timeout=5)
            self._ticker = None

    def _item(self, kind: str, name: str) -> Item:
        key = f"{kind} {name}"
        if key not in self.items:
            self.items[key] = Item(kind, name, self.clock())
        return self.items[key]

    def runs_started(self) -> None:
        """Plain mode: from now on each line starts on a line of its own (``\n`` first), as the
        ``[sweep]`` lines do: an evaluation's pytest writes its progress dots without a newline."""
        self._lead = "\n"

    def _say(self, line: str) -> None:
        if self.mode == "plain":
            self.out(self._lead + line)

    # environments (called from EnvPrewarm's worker threads)
    def env_log(self, name: str, message: str) -> None:
        """A one-off line of ``bakeoff.host.envs.ensure`` (created at..., ready in...)."""
        with self._lock:
            self._item("envs", name)
            self.throttle.mark(f"envs {name}")
            self._say(f"[envs] {message}")

    def env_step(self, name: str, step: str, log_path: Path | None = None) -> None:
        with self._lock:
            it = self._item("envs", name)
            it.step, it.log_path = step, log_path
        self.tick()

    def env_done(self, name: str, how: str, ok: bool = True) -> None:
        with self._lock:
            it = self._item("envs", name)
            it.done, it.ok, it.t_end = how, ok, self.clock()
            if not ok:
                self._say(f"[envs] {name}: {how}")

    def tick(self) -> None:
        """Plain mode: print each running environment's state (step, elapsed, pip's last line),
        at most once per interval each, and only when it changed or a minute passed (a heartbeat
        in a long install)."""
        if self.mode != "plain":
            return
        with self._lock:
            for key, it in self.items.items():
                if it.kind != "envs" or it.done is not None or it.step == "starting":
                    continue
                line = last_line(it.log_path)
                heartbeat = self.throttle.age(key) >= 6 * self.interval_s
                if ((it.step, line) != it.printed or heartbeat) and self.throttle.due(key):
                    it.printed = (it.step, line)
                    self.out(f"{self._lead}[envs] {it.name}: {it.step}, {fmt_s(self.clock() - it.t0)}"
                             + (f": {clip(line)}" if line else ""))

    def _tick_loop(self) -> None:
        while not self._stop.wait(min(1.0, self.interval_s / 4)):
            self.tick()

    # the fixture (bakeoff.models.resolve's log callback, on the main thread)
    def fixture_log(self, message: str) -> None:
        text, line = message.strip(), f"[fixture] {message.rstrip()}"  # printed as the trainer wrote it
        with self._lock:
            m = FIXTURE_LINE.match(text)
            if m:
                self._fixture = m["name"]
            it = self._item("fixture", self._fixture or "model")
            s = STEP_LINE.search(text)
            if s:
                done, total = int(s["done"]), int(s["total"])
                it.step = "training" if s["what"] == "step" else "training mtp head"
                it.train = (s["what"], done, total, float(s["loss"]), float(s["rate"]), self.clock())
                if done == total or self.throttle.due(f"fixture {it.name}"):
                    self._say(line)
                return
            rest = m["rest"] if m else text
            if rest.startswith("done in"):
                it.done, it.t_end, it.step = f"ready ({rest})", self.clock(), "ready"
            elif "another process is building it" in rest:
                it.step = "waiting for another build"
            else:  # building into..., tokenizer, model, probes, mtp: the message is the detail
                it.step = "building"
            it.detail = rest
            self._say(line)

    def fixture_detail(self, it: Item) -> str:
        if it.train is None or not it.step.startswith("training"):
            return it.detail
        what, done, total, loss, rate, at = it.train
        eta = (total - done) / rate - (self.clock() - at) if rate > 0 else 0
        return f"{what} {done}/{total}  loss {loss:.4f}  {rate:.1f} steps/s  ETA {fmt_s(eta)}"

    def rows(self) -> list[tuple[str, str, str, str, bool]]:
        """``(item, step, elapsed, detail, ok)`` per item, in the order they started."""
        out = []
        with self._lock:
            for it in self.items.values():
                elapsed = fmt_s((it.t_end or self.clock()) - it.t0)
                if it.kind == "envs":
                    step = ("ready" if it.ok else "failed") if it.done is not None else it.step
                    detail = it.done if it.done is not None else clip(last_line(it.log_path))
                    out.append((f"env {it.name}", step, elapsed, detail or "", it.ok))
                else:
                    out.append((f"fixture {it.name}", it.step, elapsed, clip(self.fixture_detail(it)), it.ok))
        return out

    def table(self):
        """The items as a rich table (live mode)."""
        from rich.markup import escape
        from rich.table import Table

        t = Table(title="environments and fixture", title_justify="left")
        for col in ("item", "step", "time"):
            t.add_column(col, no_wrap=True)
        t.add_column("progress", no_wrap=True, overflow="ellipsis")
        for item, step, elapsed, detail, ok in self.rows():
            style = "green" if step.startswith("ready") else "bold red" if not ok else "cyan"
            t.add_row(item, f"[{style}]{escape(step)}[/]", elapsed, escape(detail))
        return t
