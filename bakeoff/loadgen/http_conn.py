"""One connection of :mod:`bakeoff.loadgen.http`'s client: an ``asyncio.Protocol`` that stamps
each chunk with ``time.monotonic_ns()`` as it arrives (``data_received`` does nothing else
costly, so the stamp is the earliest moment Python sees the bytes), and :class:`TransportError`,
the client's failure below HTTP."""

from __future__ import annotations

import asyncio
import collections
import time


class TransportError(Exception):
    """The connection failed or ended before the body did.

    Attributes:
        kind: ``connect`` (could not connect), ``cut`` (closed mid-body), ``timeout`` (no byte
            within the read timeout), ``undecodable`` (a compressed body that does not inflate),
            ``malformed`` (HTTP framing that is not HTTP: a chunk size that is not a number).
        nbytes: body bytes received before the failure.
    """

    def __init__(self, kind: str, message: str, nbytes: int = 0):
        super().__init__(message)
        self.kind = kind
        self.nbytes = nbytes


class _Conn(asyncio.Protocol):
    """One TCP connection; chunks are queued as ``(t_ns, bytes)``."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.chunks: collections.deque[tuple[int, bytes]] = collections.deque()
        self.waiter: asyncio.Future | None = None
        self.eof = False
        self.lost_exc: BaseException | None = None
        self.used = 0
        self.wait_since = 0.0
        self.timeout_s = 120.0

    def connection_made(self, transport):  # noqa: D401 - protocol callback
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.chunks.append((time.monotonic_ns(), data))
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    def eof_received(self):
        self.eof = True
        self._wake()
        return False

    def connection_lost(self, exc):
        self.eof = True
        self.lost_exc = exc
        self._wake()

    def _wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def read(self, timeout_s: float, patience=None) -> tuple[int, bytes] | None:
        """Next ``(t_ns, chunk)``; None at EOF.

        The read timeout is enforced by the pool's watchdog (one timer for all connections,
        not one per read).

        Args:
            timeout_s: no byte within this many seconds ends the read, unless ``patience`` says on.
            patience: optional async callable, given the seconds since this read began waiting when
                nothing arrived in time: returns the seconds to go on waiting, or None to give up
                (:class:`bakeoff.loadgen.progress.Patience`: wait on while the engine computes).

        Raises:
            TransportError: ``timeout`` when nothing arrives within ``timeout_s`` (and ``patience``
                gave up).
        """
        wait_s, silent_since = timeout_s, None
        while not self.chunks:
            if self.eof:
                return None
            fut = self.loop.create_future()
            self.waiter = fut
            self.wait_since = time.monotonic()
            silent_since = silent_since or self.wait_since
            self.timeout_s = wait_s
            try:
                await fut
            finally:
                self.waiter = None
            if fut.result() == "timeout" and not self.chunks and not self.eof:
                more_s = await patience(time.monotonic() - silent_since) if patience is not None else None
                if more_s is None:
                    raise TransportError("timeout", f"no byte for {timeout_s:g} s")
                wait_s = more_s  # bytes that came during the check are read at the loop's top
        return self.chunks.popleft()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
