"""The worker's end of an engine process: start it, route its frames to per-request channels.

The frames, the doorbell and the engine's end are :mod:`backends._hosting.worker_pipe`'s.
Standard library only: this runs inside the engines' environments.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
from typing import Any

from backends._hosting.worker_pipe import LAZY_BELL_S, SAFETY_POLL_S, FrameReader, _grow, encode_frame


class EngineExited(RuntimeError):
    """The engine process ended while loading without saying why (``returncode`` < 0: a signal)."""

    def __init__(self, returncode: int):
        super().__init__(f"the engine process exited with code {returncode} while loading (its output is above)")
        self.returncode = returncode


class EngineProcess:
    """The worker's end: starts the engine process and routes its frames to per-request channels.

    The child gets ``--cmd-fd N --out-fd M --bell-fd B`` appended to ``argv``; its first frame
    is ``("ready", info)`` or ``("failed", message)``. Afterwards every frame is
    ``(kind, request_id, ...)`` and goes to the channel opened for that request id. The data
    pipe is drained when the doorbell rings, and again ``poll_interval_s`` after any drain that
    found frames (a frame the engine wrote without ringing, within :data:`LAZY_BELL_S` of a bell,
    is there by then); a check that finds nothing waits for the next bell, with a safety check
    every :data:`SAFETY_POLL_S` while requests are open. The fixed 2 ms timer this replaces woke
    the worker 500 times a second whatever the engine did: on a model at 25 ms per token that
    was 12 wake-ups and ~1.6 ms of the worker's CPU per token, on a 2-core host beside the
    engine's threads (``benchmarks/bench_fidelity.py``, 2026-12-03).

    Args:
        argv: the child's command line.
        env: its environment (None: inherit).
        poll_interval_s: the timer's period in seconds.

    Raises:
        RuntimeError: from :meth:`wait_ready` when the child failed or exited while loading.
    """

    def __init__(self, argv: list[str], env: dict[str, str] | None = None, poll_interval_s: float = 0.002):
        cmd_r, self.cmd_w = os.pipe()
        self.out_r, out_w = os.pipe()
        self.bell_r, bell_w = os.pipe()
        _grow(out_w)
        _grow(self.cmd_w)
        self.proc = subprocess.Popen([*argv, "--cmd-fd", str(cmd_r), "--out-fd", str(out_w), "--bell-fd", str(bell_w)],
                                     pass_fds=(cmd_r, out_w, bell_w), env=env)
        for fd in (cmd_r, out_w, bell_w):
            os.close(fd)
        self.poll_interval_s = max(poll_interval_s, 1.5 * LAZY_BELL_S)
        self.reader = FrameReader()
        self.channels: dict[Any, Any] = {}
        self.loop: asyncio.AbstractEventLoop | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.cmd_buf = bytearray()
        self.writer_on = False
        self.dead: str | None = None

    def wait_ready(self) -> dict[str, Any]:
        """Block until the child reports; its ``info`` dict on success."""
        while data := os.read(self.out_r, 1 << 16):
            for msg in self.reader.feed(data):
                if msg[0] == "ready":
                    return msg[1]
                if msg[0] == "failed":
                    self.proc.wait()
                    raise RuntimeError(msg[1])
        rc = self.proc.wait()
        raise EngineExited(rc)

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Route frames on ``loop`` from now on (idempotent; a new loop replaces the old one)."""
        if self.loop is loop:
            return
        if self.loop is not None and not self.loop.is_closed():
            self.loop.remove_reader(self.bell_r)
            if self.writer_on:
                self.loop.remove_writer(self.cmd_w)
            if self.timer is not None:
                self.timer.cancel()
        self.timer = None
        self.loop = loop
        self.writer_on = False
        os.set_blocking(self.out_r, False)
        os.set_blocking(self.bell_r, False)
        os.set_blocking(self.cmd_w, False)
        if not self.dead:
            loop.add_reader(self.bell_r, self._on_bell)

    def open(self, request_id: Any, channel: Any) -> None:
        """Send frames of ``request_id`` to ``channel.put``."""
        self.channels[request_id] = channel
        if self.timer is None and self.loop is not None and not self.dead:
            self.timer = self.loop.call_later(self.poll_interval_s, self._on_timer)

    def close(self, request_id: Any) -> None:
        """Stop routing ``request_id`` (later frames for it are dropped)."""
        self.channels.pop(request_id, None)

    def send(self, msg: Any) -> None:
        """Queue one command frame; it never blocks the event loop.

        A stopped or busy engine can leave the command pipe full; what does not fit waits in
        a buffer and goes out when the pipe has room (``add_writer``), so ``/health`` and
        other streams keep being served. Before :meth:`attach` the write blocks.

        Raises:
            RuntimeError: the engine process is gone (its exit code in the message).
        """
        if self.dead:
            raise RuntimeError(self.dead)
        self.cmd_buf += encode_frame(msg)
        self._on_writable()
        if self.dead:
            raise RuntimeError(self.dead)

    def _on_writable(self) -> None:
        try:
            while self.cmd_buf:
                n = os.write(self.cmd_w, self.cmd_buf)
                del self.cmd_buf[:n]
        except BlockingIOError:
            pass
        except OSError as exc:
            self._died(self._exit_reason(f"the engine process is gone ({exc})"))
            return
        if self.loop is not None:
            if self.cmd_buf and not self.writer_on:
                self.loop.add_writer(self.cmd_w, self._on_writable)
                self.writer_on = True
            elif not self.cmd_buf and self.writer_on:
                self.loop.remove_writer(self.cmd_w)
                self.writer_on = False

    def _exit_reason(self, fallback: str = "") -> str:
        """``the engine process exited with code N`` once it has (reaping it), else ``fallback``."""
        rc = self.proc.poll()
        if rc is None:
            try:
                rc = self.proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                return fallback or "the engine process closed its pipe but has not exited"
        return f"the engine process exited with code {rc}; its last words are in the worker log"

    def _on_timer(self) -> None:
        self.timer = None
        got = self._drain()
        if self.channels and not self.dead:
            self.timer = self.loop.call_later(self.poll_interval_s if got else SAFETY_POLL_S, self._on_timer)

    def _check_soon(self) -> None:
        """After a drain that found frames: check again within ``poll_interval_s``."""
        if self.dead or self.loop is None:
            return
        due = self.loop.time() + self.poll_interval_s
        if self.timer is not None:
            if self.timer.when() <= due:
                return
            self.timer.cancel()
        self.timer = self.loop.call_at(due, self._on_timer)

    def _on_bell(self) -> None:
        try:
            rung = os.read(self.bell_r, 4096)
        except BlockingIOError:
            return
        except OSError:
            rung = b""
        if self._drain():
            self._check_soon()
        if not rung:  # the child closed its end: it exited
            self._died(self._exit_reason())

    def _drain(self) -> bool:
        """Route every frame in the data pipe; True if there was any."""
        got = False
        while True:
            try:
                data = os.read(self.out_r, 1 << 20)
            except (BlockingIOError, OSError):
                return got
            if not data:
                return got
            got = True
            for msg in self.reader.feed(data):
                chan = self.channels.get(msg[1])
                if chan is not None:
                    chan.put(msg)

    def _died(self, why: str) -> None:
        if self.dead:
            return
        self.dead = why
        self.cmd_buf.clear()
        if self.loop is not None and not self.loop.is_closed():
            self.loop.remove_reader(self.bell_r)
            if self.writer_on:
                self.loop.remove_writer(self.cmd_w)
                self.writer_on = False
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        for chan in list(self.channels.values()):
            chan.put(RuntimeError(why))
        self.channels.clear()
