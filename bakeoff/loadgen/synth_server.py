"""A synthetic SSE server that streams on a known schedule and records what it actually sent.

Run it as a child process so that client and server never share an event loop::

    python -m bakeoff.loadgen.synth_server --port 8123 --config '{"ttft": {"ms": 50}, "itl": {"ms": 10}}'

or from Python with :class:`bakeoff.loadgen.synth_launch.SynthServer` (a context manager that
starts it as a child process and reads back its records). It speaks ``/v1/completions``,
``/v1/chat/completions`` (``reasoning_content`` deltas) and ``/v1/messages`` (Anthropic events:
``message_start``, ``content_block_start``, ``content_block_delta`` ``text_delta`` /
``thinking_delta``, ``content_block_stop``, ``message_delta`` with usage, ``message_stop``),
plus ``GET /v1/models``, ``GET /health``, ``GET /_sent?request_id=ID`` (one request's record),
``GET /_stats`` (schedule slip) and ``POST /_reset``.

Schedule: per request, TTFT and per-token ITL are drawn from the configured distributions
(seeded per request), tokens are grouped ``tokens_per_chunk`` to an event, and each event is
due when its last token is. For each event the server records its nominal and actual send
time (``time.monotonic_ns()``, taken just before the bytes are written: the same clock as
the client on this host), so a client's timing error is measured against what was really
sent, and the server's own slip (actual - nominal) is reported, not hidden.

The first token's text is ``[<request id>]`` (the ``X-Bakeoff-Request-Id`` header bakeoff's client
sends, else ``X-Request-Id``, else a server serial)
so that tools which do not send the header can still be matched by their generated text.

Faults (each also settable per request through a ``"synth": {...}`` field of the JSON body):
HTTP error rate, slow first byte, keep-alive comments, stream cut after N seconds or N
tokens (mid-event), a malformed JSON event, a missing ``[DONE]`` / ``message_stop``, no usage.

Implementation: a bare ``asyncio.Protocol`` HTTP/1.1 server (keep-alive, chunked responses)
with one heap of due events and one loop timer for all streams; ``--workers N`` runs N processes on one
port with ``SO_REUSEPORT``; each writes its records as JSON lines under ``--log-dir``.
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import json
import os
import random
import signal
import subprocess
import sys
import time

from bakeoff.loadgen import run_loop, synth_protocol as sp
from bakeoff.loadgen.synth_config import SynthConfig


class Stream:
    """One streaming response: its events, due times, and what was sent when."""

    __slots__ = ("proto", "rid", "events", "nxt", "rec", "cut_ns", "cut_tokens", "sent_tokens", "server", "dead")

    def __init__(self, proto, rid, events, rec, cut_ns, cut_tokens):
        self.proto, self.rid, self.events, self.rec = proto, rid, events, rec
        self.nxt = next(events)
        self.cut_ns, self.cut_tokens = cut_ns, cut_tokens
        self.sent_tokens = 0
        self.server = proto.server
        self.dead = False

    def start(self) -> None:
        self._schedule()

    def _schedule(self) -> None:
        nxt = self.nxt[0]
        if self.cut_ns is not None and self.cut_ns < nxt:
            nxt = self.cut_ns
        self.server.schedule(nxt, self)

    def _fire(self) -> None:
        if self.dead:
            return
        tr = self.proto.transport
        if tr is None or tr.is_closing():
            self._end(aborted=True)
            return
        rec = self.rec
        while True:
            now = time.monotonic_ns()
            nominal, data, kind, ntok = self.nxt
            if self.cut_ns is not None and now >= self.cut_ns and nominal > self.cut_ns:
                return self._cut(data, now)
            if nominal > now:
                break
            if self.cut_tokens is not None and ntok and self.sent_tokens + ntok > self.cut_tokens:
                return self._cut(data, now)
            if rec is not None:
                rec["events"].append((nominal, now, ntok, kind))
            self.sent_tokens += ntok
            self.nxt = next(self.events, None)
            if self.nxt is None:
                self.proto.server.log(rec)
                tr.write(data + sp.CHUNK_END)
                self.proto.stream_done(self)
                return
            tr.write(data)
        self._schedule()

    def _cut(self, data: bytes, now: int) -> None:
        if self.rec is not None:
            self.rec["cut_ns"] = now
            self.rec["cut_at_tokens"] = self.sent_tokens
            self.proto.server.log(self.rec)
        tr = self.proto.transport
        tr.write(data[: max(1, len(data) // 2)])
        tr.close()
        self.proto.stream_done(self, closed=True)

    def _end(self, aborted: bool) -> None:
        if self.rec is not None:
            self.rec["client_gone"] = aborted
            self.proto.server.log(self.rec)
        self.proto.stream_done(self, closed=True)

    def cancel(self) -> None:
        self.dead = True


class Server:
    """State shared by the connections of one process."""

    def __init__(self, config: SynthConfig, log_dir: str | None, worker: int):
        self.config = config
        self.loop = asyncio.get_running_loop()
        self.serial = 0
        self.records: dict[str, dict] = {}
        self.slips_ns: list[int] = []
        self.log_dir = log_dir
        self.worker = worker
        self.heap: list[tuple[int, int, Stream]] = []
        self.seq = 0
        self.timer: asyncio.TimerHandle | None = None
        self.timer_at: int | None = None
        self.ticking = False
        self._log = open(os.path.join(log_dir, f"sent-{worker}-{os.getpid()}.jsonl"), "a", buffering=1) \
            if log_dir else None

    def schedule(self, due_ns: int, stream: Stream) -> None:
        """Queue ``stream`` to fire at ``due_ns``: one heap of plain tuples and one armed loop timer
        for all streams (cheaper than a ``TimerHandle`` per event, whose heap compares in Python)."""
        self.seq += 1
        heapq.heappush(self.heap, (due_ns, self.seq, stream))
        if not self.ticking and (self.timer_at is None or due_ns < self.timer_at):
            self._arm(due_ns)

    def _arm(self, due_ns: int) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.timer_at = due_ns
        self.timer = self.loop.call_at(due_ns / 1e9, self._tick)

    def _tick(self) -> None:
        self.timer = self.timer_at = None
        heap = self.heap
        self.ticking = True
        try:
            while heap and heap[0][0] <= time.monotonic_ns():
                heapq.heappop(heap)[2]._fire()
        finally:
            self.ticking = False
        if heap:
            self._arm(heap[0][0])

    def log(self, rec: dict | None) -> None:
        if rec is None or rec.get("logged"):
            return
        rec["logged"] = True
        self.slips_ns.extend(a - n for n, a, _, k in rec["events"] if k != "ka")
        if len(self.records) > 200_000:
            self.records.clear()
        self.records[rec["request_id"]] = rec
        if self._log is not None:
            self._log.write(json.dumps(rec, separators=(",", ":")) + "\n")

    def stats(self) -> dict:
        import numpy as np

        s = np.asarray(self.slips_ns, dtype=np.float64) / 1e6
        out = {"worker": self.worker, "pid": os.getpid(), "requests": len(self.records), "events": int(s.size)}
        if s.size:
            out.update({f"slip_p{p}_ms": float(np.percentile(s, p)) for p in (50, 90, 99)})
            out["slip_max_ms"] = float(s.max())
        return out


class Handler(asyncio.Protocol):
    """One client connection: parse requests, answer them one at a time (keep-alive)."""

    def __init__(self, server: Server):
        self.server = server
        self.transport = None
        self.buf = b""
        self.busy = False
        self.stream: Stream | None = None
        self.close_after = False
        self.t_first = 0

    def connection_made(self, transport):
        self.transport = transport

    def connection_lost(self, exc):
        if self.stream is not None:
            self.stream.cancel()
            self.stream._end(aborted=True)
        self.transport = None

    def data_received(self, data: bytes) -> None:
        if not self.buf:
            self.t_first = time.monotonic_ns()  # the request's arrival: its first byte
        self.buf += data
        if not self.busy:
            self._next()

    def _next(self) -> None:
        while not self.busy and self.transport is not None:
            parsed = sp.parse_request(self.buf)
            if parsed is None:
                return
            t_recv = self.t_first
            method, target, headers, body, self.buf = parsed
            self.t_first = time.monotonic_ns()
            self.close_after = headers.get("connection", "").lower() == "close"
            self._dispatch(method, target, headers, body, t_recv)

    def reply(self, status: int, obj) -> None:
        self.transport.write(sp.json_response(status, obj, self.close_after))
        if self.close_after:
            self.transport.close()

    def _dispatch(self, method: str, target: str, headers: dict, body: bytes, t_recv: int) -> None:
        path, _, query = target.partition("?")
        srv = self.server
        if self._control(method, path, query):
            return None
        api = sp.API_BY_PATH.get(path)
        if method != "POST" or api is None:
            return self.reply(404, {"error": {"message": f"no route {method} {path}"}})
        try:
            req = json.loads(body or b"{}")
            cfg = srv.config
            if isinstance(req.get("synth"), dict):
                cfg = SynthConfig.model_validate({**cfg.model_dump(), **req["synth"]})
        except Exception as exc:  # a bad request is answered, never a server crash
            return self.reply(400, {"error": {"message": f"bad request: {exc}"}})
        srv.serial += 1
        rid = headers.get("x-bakeoff-request-id") or headers.get("x-request-id") or f"srv-{srv.worker}-{srv.serial}"
        rng = random.Random(hash((cfg.seed, rid)) & 0xFFFFFFFF)
        if cfg.error_rate and rng.random() < cfg.error_rate:
            if cfg.record:
                srv.log({"request_id": rid, "api": api, "recv_ns": t_recv, "status": cfg.error_status, "events": []})
            return self.reply(cfg.error_status, {"error": {"message": "synthetic error", "type": "server_error"}})
        events = sp.build_events(api, req, cfg, rid, rng, t_recv)
        rec = {"request_id": rid, "api": api, "recv_ns": t_recv, "status": 200, "events": [],
               "auth": "authorization" in headers or "x-api-key" in headers} if cfg.record else None
        cut_ns = t_recv + int(cfg.cut_after_s * 1e9) if cfg.cut_after_s is not None else None
        self.busy = True
        self.stream = Stream(self, rid, events, rec, cut_ns, cfg.cut_after_tokens)
        self.stream.start()

    def _control(self, method: str, path: str, query: str) -> bool:
        """Answer the routes that stream nothing (health, models, the records, stats, reset);
        whether ``path`` was one of them."""
        srv = self.server
        if method == "GET" and path in ("/health", "/v1/health"):
            self.reply(200, {"status": "ok"})
        elif method == "GET" and path == "/v1/models":
            entry = {"id": srv.config.model, "object": "model"}
            if srv.config.max_model_len:
                entry["max_model_len"] = srv.config.max_model_len
            self.reply(200, {"object": "list", "data": [entry]})
        elif method == "GET" and path == "/_sent":
            rid = dict(p.partition("=")[::2] for p in query.split("&") if p).get("request_id", "")
            rec = srv.records.get(rid)
            self.reply(200 if rec else 404, rec or {"error": f"no record of {rid!r} in worker {srv.worker}"})
        elif method == "GET" and path == "/_stats":
            self.reply(200, srv.stats())
        elif method == "POST" and path == "/_reset":
            srv.records.clear()
            srv.slips_ns.clear()
            self.reply(200, {"reset": True})
        else:
            return False
        return True

    def stream_done(self, stream: Stream, closed: bool = False) -> None:
        self.stream = None
        self.busy = False
        if closed or self.close_after:
            if self.transport is not None:
                self.transport.close()
            return
        if self.buf:
            self.server.loop.call_soon(self._next)


async def serve(port: int, config: SynthConfig, host: str = "127.0.0.1", reuse_port: bool = False,
                log_dir: str | None = None, worker: int = 0, ready_fd=None) -> None:
    """Serve until SIGTERM/SIGINT."""
    srv = Server(config, log_dir, worker)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: Handler(srv), host, port, reuse_port=reuse_port or None,
                                      backlog=4096)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if ready_fd:
        print(f"READY {server.sockets[0].getsockname()[1]}", flush=True)
    await stop.wait()
    server.close()


def main(argv: list[str] | None = None) -> None:
    """CLI: ``--port``, ``--config JSON``, ``--workers N`` (SO_REUSEPORT), ``--log-dir``."""
    ap = argparse.ArgumentParser(prog="python -m bakeoff.loadgen.synth_server")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--config", default="{}", help="SynthConfig as JSON")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--log-dir", default=None)
    ap.add_argument("--worker-index", type=int, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    config = SynthConfig.model_validate_json(a.config)
    children = []
    if a.workers > 1 and a.worker_index == 0:
        for i in range(1, a.workers):
            children.append(subprocess.Popen([sys.executable, "-m", "bakeoff.loadgen.synth_server", "--port",
                                              str(a.port), "--host", a.host, "--config", a.config, "--workers",
                                              str(a.workers), "--worker-index", str(i)]
                                             + (["--log-dir", a.log_dir] if a.log_dir else [])))
    try:
        run_loop(serve(a.port, config, a.host, a.workers > 1, a.log_dir, a.worker_index,
                          ready_fd=True))
    finally:
        for c in children:
            c.send_signal(signal.SIGTERM)
        for c in children:
            c.wait(10)


if __name__ == "__main__":
    main()
