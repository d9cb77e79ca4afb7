"""An engine in its own process, the HTTP server in another: length-prefixed pickle frames over pipes.

Why: a Python engine loop and an asyncio HTTP loop in one process share the GIL. On a tiny
CPU model (~0.35 ms per token) a busy Python thread beside a bare ``og.Generator`` loop cut
its tokens/s 2-4x (``benchmarks/bench_ort_genai.py``), so the worker lost 5-35% of the
bare loop's decode speed however it handed tokens over. With the engine in a child process,
the engine's thread only pickles a small frame and ``os.write``s it, and the HTTP side runs
on another core. The second cost is waking the other process (see :class:`ChildPipe`), so
only urgent frames (a stream's first token, a token after a pause, the end) ring a doorbell at
once; the rest ring at most once per :data:`LAZY_BELL_S` and otherwise wait in a pipe the worker
checks again shortly after each drain that found frames.

Frames are ``struct('<I') length + pickle``; both processes are the same interpreter of the
same environment, started by the worker, so pickle is not a trust boundary. Standard
library only: this runs inside the engines' environments.

Child side: :class:`ChildPipe`. Parent side (the worker's): :class:`backends._hosting.engine_process.EngineProcess`.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import pickle
import select
import struct
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

_LEN = struct.Struct("<I")
# A frame not marked urgent rings the doorbell when none rang for this long (ChildPipe.send); the
# worker's follow-up check after a drain that found frames waits longer (EngineProcess.min_poll_s).
LAZY_BELL_S = 0.001
SAFETY_POLL_S = 0.05  # the worker's check while requests are open and no frame came
BATCH = "batch"  # a frame of several messages, (BATCH, [message, ...]): ChildPipe.batch


def encode_frame(msg: Any) -> bytes:
    """One frame: 4-byte little-endian length, then the pickled message."""
    body = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    return _LEN.pack(len(body)) + body


def write_all(fd: int, data: bytes) -> None:
    """``os.write`` until every byte is out (pipes may take part of a large frame)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


class FrameReader:
    """Splits a byte stream into messages; bytes may arrive in any pieces."""

    def __init__(self) -> None:
        self.buf = bytearray()

    def feed(self, data: bytes) -> list[Any]:
        """Messages completed by ``data``, in order (a :data:`BATCH` frame's messages one by one)."""
        self.buf += data
        out = []
        while len(self.buf) >= 4:
            (n,) = _LEN.unpack_from(self.buf)
            if len(self.buf) < 4 + n:
                break
            msg = pickle.loads(bytes(self.buf[4:4 + n]))
            del self.buf[:4 + n]
            if msg[0] == BATCH:
                out += msg[1]
            else:
                out.append(msg)
        return out


def read_frames(fd: int):
    """Blocking generator of messages from ``fd``; ends at EOF."""
    reader = FrameReader()
    while True:
        data = os.read(fd, 1 << 16)
        if not data:
            return
        yield from reader.feed(data)


def _grow(fd: int, size: int = 1 << 20) -> None:
    """Enlarge a pipe's buffer (Linux ``F_SETPIPE_SZ``), so a late poll does not stall the writer."""
    try:
        fcntl.fcntl(fd, getattr(fcntl, "F_SETPIPE_SZ", 1031), size)
    except (OSError, ImportError):
        pass


class ChildPipe:
    """The engine process's end: frames to the worker, commands to a callback.

    Frames go to the data pipe, which the worker does not sleep on, so writing one wakes no
    one; an urgent frame also rings the doorbell pipe, which the worker's event loop waits on.
    Measured on this project's 2-core VM, the decode thread's own time per step of a tiny model
    (~0.4 ms/step, one frame per ~5 steps): 9.6 us with frames thrown away, 9.7 us into a
    pipe nobody reads, 15-17 us with a reader polling it every 2 ms from the other core, 14-25
    us with a reader asleep in ``read`` (woken by every frame). A frame per token with a
    sleeping reader cost the loop ~10% of its tokens/s; hence few frames, and few wake-ups.

    A frame not marked urgent still rings when no bell was rung in the last
    :data:`LAZY_BELL_S`: the worker no longer polls the data pipe on a fixed timer while requests
    are open (it checks again :data:`LAZY_BELL_S` or more after a drain that found frames, see
    :class:`backends._hosting.engine_process.EngineProcess`), so an unrung frame always follows a bell by less than that check's
    delay and is picked up by it.

    Args:
        cmd_fd: read end of the worker-to-engine pipe.
        out_fd: write end of the data pipe.
        bell_fd: write end of the doorbell pipe.
    """

    def __init__(self, cmd_fd: int, out_fd: int, bell_fd: int):
        self.cmd_fd, self.out_fd, self.bell_fd = cmd_fd, out_fd, bell_fd
        self.lock = threading.Lock()
        self.reader = FrameReader()
        self.polling = False  # the command pipe set non-blocking by poll()
        self.last_bell = float("-inf")
        self._held: list | None = None  # [thread id, messages, urgent] while a batch() is open

    def send(self, msg: Any, urgent: bool = True) -> None:
        """Write one frame (thread-safe); ring the doorbell when ``urgent``. Inside
        :meth:`batch`, on the thread that opened it, the message waits for the batch's one frame.

        Raises:
            BrokenPipeError: the worker is gone.
        """
        held = self._held
        if held is not None and held[0] == threading.get_ident():
            held[1].append(msg)
            held[2] = held[2] or urgent
            return
        frame = encode_frame(msg)
        with self.lock:
            self._write(frame, urgent)

    def _write(self, data: bytes, urgent: bool) -> None:
        write_all(self.out_fd, data)
        now = time.monotonic()
        if urgent or now - self.last_bell >= LAZY_BELL_S:
            os.write(self.bell_fd, b"\0")
            self.last_bell = now

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """Messages this thread sends inside leave as one frame (:data:`BATCH`, one pickle, one
        write) when it ends, with one doorbell if any was urgent; the worker's
        :class:`FrameReader` hands them on one by one. An engine step's messages, one per stream:
        at ~3.5 ms per step every stream's token was an urgent frame, 32 writes and doorbells per
        step at 32 streams, ~0.37 ms of the decode thread's own time per step on the H200
        (2026-12-04). With a fake 3.4 ms engine step and 32 streams on this project's CPU host
        (AVX-512), the loop's own time per step: 200 us a frame and doorbell each, 130 us one
        write of 32 frames, 110 us one frame of 32 messages. Nested, the outer batch writes;
        other threads' messages leave at once (each stream's come from one thread)."""
        if self._held is not None and self._held[0] == threading.get_ident():
            yield
            return
        held = self._held = [threading.get_ident(), [], False]
        try:
            yield
        finally:
            self._held = None
            msgs = held[1]
            if msgs:
                frame = encode_frame(msgs[0] if len(msgs) == 1 else (BATCH, msgs))
                with self.lock:
                    self._write(frame, held[2])

    def poll(self) -> list[Any]:
        """The commands that have arrived, without waiting (for an engine loop that reads its own
        commands between steps instead of on a :meth:`listen` thread: an engine call that holds
        the GIL, such as OpenVINO GenAI's ``step()``, would keep such a thread from reading).

        Raises:
            EOFError: the worker closed its end (it exited or was killed).
        """
        if not self.polling:
            os.set_blocking(self.cmd_fd, False)
            self.polling = True
        out: list[Any] = []
        while True:
            try:
                data = os.read(self.cmd_fd, 1 << 16)
            except BlockingIOError:
                return out
            if not data:
                raise EOFError("the worker closed the command pipe")
            out += self.reader.feed(data)

    def wait(self) -> list[Any]:
        """At least one command, blocking (no GIL held) until one arrives; see :meth:`poll`."""
        while True:
            got = self.poll()
            if got:
                return got
            select.select([self.cmd_fd], [], [])

    def listen(self, on_command: Callable[[Any], None], on_eof: Callable[[], None]) -> None:
        """Read commands on a daemon thread (blocked in ``os.read``, it holds no GIL while idle).

        ``on_eof`` runs when the worker closes its end (it exited or was killed).
        """
        def loop() -> None:
            try:
                for msg in read_frames(self.cmd_fd):
                    on_command(msg)
            except OSError:
                pass
            on_eof()

        threading.Thread(target=loop, daemon=True, name="engine-commands").start()


def start_child(argv: list[str] | None, make: Callable[[str, dict[str, Any]], Any]) -> tuple[ChildPipe, Any]:
    """An engine process's start: parse ``--model --options --cmd-fd --out-fd --bell-fd``, open the
    pipe, and build the engine with ``make(model, options)``. A failure to build is sent to the
    worker as ``("failed", "<exception line>")`` (its traceback on stderr, in the engine's log) and
    ends the process with exit 1, so the worker reports it as a failed start, not a crash."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--options", default="{}")
    ap.add_argument("--cmd-fd", type=int, required=True)
    ap.add_argument("--out-fd", type=int, required=True)
    ap.add_argument("--bell-fd", type=int, required=True)
    args = ap.parse_args(argv)
    chan = ChildPipe(args.cmd_fd, args.out_fd, args.bell_fd)
    try:
        return chan, make(args.model, json.loads(args.options))
    except BaseException as exc:
        traceback.print_exc()
        chan.send(("failed", "".join(traceback.format_exception_only(exc)).strip()))
        sys.exit(1)
