"""A minimal HTTP/1.1 client built on ``asyncio.Protocol``, timestamping bytes as they arrive.

Why not aiohttp's ``StreamReader``: there, bytes land in a buffer in the protocol callback
and the reading task only resumes one loop iteration later, behind every other task step
that iteration runs; the timestamp is taken when the task resumes. At hundreds of streams
on one event loop that hop is the largest part of a client's timing error (docs/design.md
"Measurement": vLLM's Python ``bench serve`` adds ~23 ms TTFT at 100 streams). Here
``data_received`` stamps each chunk with ``time.monotonic_ns()`` first and does nothing
else costly, so the stamp is the earliest moment Python sees the bytes (the connection:
:mod:`bakeoff.loadgen.http_conn`); parsing happens later in the consuming task and keeps the stamp.

Supports keep-alive pooling per (host, port, tls), ``Content-Length``, chunked and
close-delimited bodies, TLS through ``asyncio``'s ``ssl`` support. No proxies, no redirects.
Requests ask for no compression (``Accept-Encoding: identity``); a body a hop compressed anyway
(``Content-Encoding: gzip`` or ``deflate``) is inflated piece by piece as it arrives, so the
stream is still measured and the transport check sees its timing (a compressor that does not
flush per event delivers bursts); any other coding is left to the caller to refuse.
"""

from __future__ import annotations

import asyncio
import ssl as _ssl
import time
import zlib
from urllib.parse import urlsplit

from bakeoff.loadgen.http_conn import TransportError, _Conn


# A reused connection closed without a byte within this many seconds of the write is a stale
# keep-alive connection (the server's idle close crossed the request): the request is sent again on
# a new connection. A later close is the server's answer to a request it received: not retried.
STALE_CLOSE_S = 0.25


class Response:
    """Status, headers and an async body reader of one response.

    Body pieces come from :meth:`chunks` as ``(t_ns, bytes)``: ``t_ns`` is when the network
    chunk carrying the piece's last byte was received.
    """

    def __init__(self, pool: "Pool", conn: _Conn, status: int, headers: dict[str, str], rest: bytes, t_ns: int,
                 head_only: bool, patience=None):
        self.pool, self.conn, self.status, self.headers = pool, conn, status, headers
        self.patience = patience  # the request's (Pool.request), asked at each read timeout of the body
        self.t_headers_ns = t_ns
        self.nbytes = 0
        self.complete = False
        self._rest = rest
        self._t_rest = t_ns
        te = headers.get("transfer-encoding", "").lower()
        self._mode = "chunked" if "chunked" in te else ("length" if "content-length" in headers else "close")
        self._left = int(headers.get("content-length", 0) or 0) if self._mode == "length" else 0
        if head_only or status in (204, 304) or (self._mode == "length" and self._left == 0):
            self._mode, self.complete = "none", True
        self._pend = b""
        self._chunk_left = 0
        self._keep = headers.get("connection", "").lower() != "close"
        coding = headers.get("content-encoding", "").strip().lower()
        self._coding, self._inflated = coding, False
        self._inflate = zlib.decompressobj(47) if coding in ("gzip", "x-gzip", "deflate") else None  # 47: gzip or zlib

    def _inflate_piece(self, data: bytes) -> bytes:
        """Inflate a piece of a compressed body: every gzip member (a stream may hold one per
        event), and ``deflate`` sent raw (without its zlib header, as some servers do)."""
        out = b""
        while data:
            try:
                out += self._inflate.decompress(data)
            except zlib.error as exc:
                if self._coding == "deflate" and not self._inflated:
                    self._inflate = zlib.decompressobj(-15)  # raw deflate
                    continue
                raise TransportError("undecodable", f"Content-Encoding {self._coding} body cannot be inflated: {exc}",
                                     self.nbytes) from None
            self._inflated = True
            data = self._inflate.unused_data
            if self._inflate.eof:
                self._inflate = zlib.decompressobj(47)  # a next member may follow
        return out

    async def chunks(self, timeout_s: float):
        """Yield ``(t_ns, body_bytes)`` until the body ends.

        Raises:
            TransportError: ``cut`` when the connection ends mid-body, ``timeout``.
        """
        if self.complete:
            return
        pending = [(self._t_rest, self._rest)] if self._rest else []
        self._rest = b""
        while not self.complete:
            if pending:
                t, data = pending.pop()
            else:
                item = await self.conn.read(timeout_s, self.patience)
                if item is None:
                    if self._mode == "close":
                        self.complete, self._keep = True, False
                        return
                    raise TransportError("cut", f"connection closed mid-body after {self.nbytes} bytes", self.nbytes)
                t, data = item
            out = self._decode(data)
            if out and self._inflate is not None:
                out = self._inflate_piece(out)
            if out:
                self.nbytes += len(out)
                yield t, out

    def _decode(self, data: bytes) -> bytes:
        if self._mode == "close":
            return data
        if self._mode == "length":
            take = data[: self._left]
            self._left -= len(take)
            if self._left <= 0:
                self.complete = True
            return take
        if self._pend:
            data, self._pend = self._pend + data, b""
        out = []
        pos, n = 0, len(data)
        while pos < n:
            left = self._chunk_left
            if left > 0:
                end = min(n, pos + left)
                out.append(data[pos:end])
                self._chunk_left = left - (end - pos)
                pos = end
                if self._chunk_left:
                    break
                self._chunk_left = left = -2  # CRLF after the chunk data
            if left == -2:
                if n - pos < 2:
                    self._pend = data[pos:]
                    break
                pos += 2
                self._chunk_left = 0
                continue
            i = data.find(b"\r\n", pos)
            if i < 0:
                self._pend = data[pos:]
                break
            field = data[pos:i].split(b";", 1)[0].strip() or b"0"
            try:
                if field.strip(b"0123456789abcdefABCDEF"):  # hex digits only: int() would take -3, +5, 0x5, 1_0
                    raise ValueError(field)
                size = int(field, 16)
            except ValueError:  # a framing fault, not the engine's: named as such (census 5.19)
                raise TransportError("malformed", f"the chunked body's framing is broken: chunk size {field[:40]!r} "
                                     "is not a hexadecimal number", self.nbytes) from None
            pos = i + 2
            if size == 0:  # the last chunk: the body is complete; nothing more of it is waited for
                self.complete = True
                # its final CRLF may come apart (llama-server's cpp-httplib writes it so): a kept connection then
                # holds a stray CRLF, which the next request skips (Pool._get, Pool._read_head); trailers are
                # not read, so a connection whose body has them is not kept
                if data[pos:] not in (b"", b"\r\n"):
                    self._keep = False
                break
            self._chunk_left = size
        return out[0] if len(out) == 1 else b"".join(out)

    async def read_all(self, timeout_s: float) -> bytes:
        """The whole body (for error responses and small JSON answers)."""
        parts = [b async for _, b in self.chunks(timeout_s)]
        return b"".join(parts)

    def release(self) -> None:
        """Give the connection back to the pool when the body ended cleanly, else close it."""
        if self.conn is None:
            return
        conn, self.conn = self.conn, None
        if self.complete and self._keep and not conn.eof and not conn.chunks:
            self.pool._put(conn)
        else:
            conn.close()


class Pool:
    """Keep-alive connections of one event loop.

    Args:
        connect_timeout_s: deadline for TCP/TLS connect.
    """

    def __init__(self, connect_timeout_s: float = 30.0):
        self.connect_timeout_s = connect_timeout_s
        self._idle: dict[tuple, list[_Conn]] = {}
        self._all: set[_Conn] = set()
        self._watchdog: asyncio.Task | None = None

    def _put(self, conn: _Conn) -> None:
        self._idle.setdefault(conn.key, []).append(conn)

    async def _get(self, scheme: str, host: str, port: int, fresh: bool = False) -> tuple[_Conn, bool]:
        """A pooled idle connection (and True), or a new one (``fresh``: always new) and False."""
        key = (scheme, host, port)
        idle = self._idle.get(key)
        while idle and not fresh:
            conn = idle.pop()
            # bytes that came on an idle connection answer no request of ours: the stray CRLF that ended the last
            # chunked body is dropped; a connection holding anything else is not reused
            stray = b"".join(d for _, d in conn.chunks)
            if not conn.eof and not stray.strip(b"\r\n") and conn.transport is not None and not conn.transport.is_closing():
                conn.chunks.clear()
                return conn, True
            conn.close()
            self._all.discard(conn)
        loop = asyncio.get_running_loop()
        ctx = _ssl.create_default_context() if scheme == "https" else None
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(lambda: _Conn(loop), host, port, ssl=ctx), self.connect_timeout_s)
        except (OSError, asyncio.TimeoutError) as exc:
            raise TransportError("connect", f"cannot connect to {host}:{port}: {type(exc).__name__}: {exc}") from None
        conn.key = key
        self._all.add(conn)
        if self._watchdog is None or self._watchdog.done():
            self._watchdog = loop.create_task(self._watch())
        return conn, False

    async def _watch(self) -> None:
        """Every 0.5 s, wake readers that waited longer than their read timeout."""
        while self._all:
            await asyncio.sleep(0.5)
            now = time.monotonic()
            for conn in list(self._all):
                w = conn.waiter
                if w is not None and not w.done() and now - conn.wait_since > conn.timeout_s:
                    w.set_result("timeout")

    async def request(self, method: str, url: str, headers: dict[str, str], body: bytes = b"",
                      timeout_s: float = 120.0, on_sent=None, patience=None) -> Response:
        """Send one request and read the status line and headers.

        Args:
            method: ``GET`` / ``POST``.
            url: absolute ``http(s)://host:port/path?query``.
            headers: extra request headers.
            body: request body bytes.
            timeout_s: read timeout (no byte within it) in seconds.
            on_sent: called with ``time.monotonic_ns()`` taken just before the request bytes
                are written (after a pooled or new connection is ready).
            patience: asked when no byte came within ``timeout_s`` (head and body): seconds to
                wait on, or None to give up (:meth:`_Conn.read`).

        Raises:
            TransportError: ``connect``, ``cut`` (closed before the headers), ``timeout``.
        """
        u = urlsplit(url)
        scheme = u.scheme or "http"
        host = u.hostname or "127.0.0.1"
        port = u.port or (443 if scheme == "https" else 80)
        path = (u.path or "/") + (f"?{u.query}" if u.query else "")
        lines = [f"{method} {path} HTTP/1.1", f"Host: {host}:{port}", "Accept-Encoding: identity",
                 f"Content-Length: {len(body)}"]
        lines += [f"{k}: {v}" for k, v in headers.items()]
        raw = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body
        written = 0.0
        for attempt in (0, 1):
            # the retry takes a new connection: the other idle ones were idle as long and a server
            # that closes connections after an idle timeout (llama-server's cpp-httplib: 5 s) closes them too
            conn, reused = await self._get(scheme, host, port, fresh=attempt == 1)
            if on_sent is not None:
                on_sent(time.monotonic_ns())
            conn.used += 1
            try:
                try:
                    written = time.monotonic()
                    conn.transport.write(raw)
                except RuntimeError as exc:  # the transport closed between the pool's check and the write
                    raise TransportError("cut" if reused else "connect", f"connection closed before the request was "
                                         f"sent: {exc}") from None
                return await self._read_head(conn, method, timeout_s, patience)
            except TransportError as exc:
                conn.close()
                self._all.discard(conn)
                # a pooled connection the server closed while idle: retry once on a fresh one; only a
                # close that came with no byte at once (the server's idle close crossing the request),
                # never one after the server took its time: that request was received, and is not sent twice
                if exc.kind == "cut" and reused and attempt == 0 and exc.nbytes == 0 and \
                        time.monotonic() - written < STALE_CLOSE_S:
                    continue
                raise
        raise AssertionError("unreachable")

    async def _read_head(self, conn: _Conn, method: str, timeout_s: float, patience=None) -> Response:
        buf = b""
        while True:
            item = await conn.read(timeout_s, patience)
            if item is None:
                raise TransportError("cut", f"connection closed before the response headers ({len(buf)} bytes)",
                                     len(buf))
            t, data = item
            # empty lines before the status line are skipped (RFC 9112 2.2): the final CRLF of the previous
            # chunked body on a kept connection, written apart; a close after them is a close with no byte
            buf = (buf + data) if buf else data.lstrip(b"\r\n")
            i = buf.find(b"\r\n\r\n")
            if i >= 0:
                break
        head, rest = buf[:i].decode("latin-1"), buf[i + 4:]
        status_line, *hlines = head.split("\r\n")
        parts = status_line.split(" ", 2)
        status = int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0
        hdrs: dict[str, str] = {}
        for ln in hlines:
            k, _, v = ln.partition(":")
            hdrs[k.strip().lower()] = v.strip()
        if 100 <= status < 200:  # 100-continue: read the real head
            conn.chunks.appendleft((t, rest)) if rest else None
            return await self._read_head(conn, method, timeout_s, patience)
        return Response(self, conn, status, hdrs, rest, t, method == "HEAD", patience)

    async def aclose(self) -> None:
        """Close every connection."""
        if self._watchdog is not None:
            self._watchdog.cancel()
        for conn in list(self._all):
            conn.close()
        self._all.clear()
        self._idle.clear()
