"""Hostile streaming servers on 127.0.0.1 (test fixtures): the stream client cuts each one at a
bound derived from the request (bakeoff/loadgen/client.py ``stream_bounds``), as
``protocol-violation`` with the figure, in bounded time and memory (fails before: a 10 MB line per
token took the host to 7.7 GB, an endless stream was read forever, a byte-a-second trickle reset
the read timeout at every byte)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import psutil
import pytest

from bakeoff.api.errors import EngineFailure
from bakeoff.api.specs import GenerationRequest
from bakeoff.loadgen.client import STREAM_BASE_BYTES, STREAM_BYTES_PER_TOKEN, OpenAIClient, stream_bounds

HEAD = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n")


def _event(text: str) -> bytes:
    return b"data: " + json.dumps({"choices": [{"index": 0, "text": text}]}).encode() + b"\n\n"


def big_lines(sock):
    """A 10 MB SSE line for every token, without end."""
    sock.sendall(HEAD)
    blob = _event("x" * (10 << 20))
    while True:
        sock.sendall(blob)


def endless(sock):
    """Valid token events forever, never ``[DONE]``."""
    sock.sendall(HEAD)
    ev = _event(" tok")
    while True:
        sock.sendall(ev * 256)


def plain_text(sock):
    """A whole, valid stream labelled ``Content-Type: text/plain``."""
    sock.sendall(HEAD.replace(b"text/event-stream", b"text/plain") + _event(" tok") * 4 + b"data: [DONE]\n\n")


def bad_chunk(sock):
    """A chunked body whose chunk size is not a hexadecimal number."""
    sock.sendall(HEAD.replace(b"Connection: close", b"Transfer-Encoding: chunked") + b"zz\r\n" + _event(" tok") + b"\r\n")


def trickle(sock):
    """One byte every 50 ms: each resets a read timeout; the stream never ends."""
    sock.sendall(HEAD)
    data = _event(" tok") * 10_000
    for b in data:
        sock.sendall(bytes([b]))
        time.sleep(0.05)


@pytest.fixture
def hostile():
    servers = []

    def make(behaviour):
        srv = socket.socket()
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind(("127.0.0.1", 0))
        srv.listen(8)
        servers.append(srv)

        def accept():
            while True:
                try:
                    conn, _ = srv.accept()
                except OSError:
                    return

                def serve(c=conn):
                    try:
                        c.recv(65536)  # the request (headers and body arrive together here)
                        behaviour(c)
                    except OSError:
                        pass
                    finally:
                        c.close()
                threading.Thread(target=serve, daemon=True).start()
        threading.Thread(target=accept, daemon=True).start()
        return f"http://127.0.0.1:{srv.getsockname()[1]}"
    yield make
    for s in servers:
        s.close()


def _run(url: str, max_tokens: int, read_timeout_s: float) -> tuple[EngineFailure | None, float, int]:
    """Stream one request; ``(its failure, seconds, RSS growth in bytes)``."""
    client = OpenAIClient(url, "m", read_timeout_s=read_timeout_s)
    rss0 = psutil.Process().memory_info().rss

    async def go():
        try:
            async for _ in client.stream(GenerationRequest(request_id="h", prompt="p", max_tokens=max_tokens)):
                pass
        finally:
            await client.aclose()
    t0 = time.monotonic()
    try:
        asyncio.run(go())
        failure = None
    except EngineFailure as exc:
        failure = exc
    return failure, time.monotonic() - t0, psutil.Process().memory_info().rss - rss0


@pytest.mark.parametrize("behaviour, max_tokens, read_timeout_s, within_s, words", [
    (big_lines, 16, 5.0, 20, "bytes, past the"),
    (endless, 16, 5.0, 5, "events, past the 32 a stream of max_tokens 16 may carry"),
    (trickle, 2, 1.0, 15, "still streaming after"),
])
def test_a_hostile_stream_is_cut_at_its_bound(hostile, behaviour, max_tokens, read_timeout_s, within_s, words):
    url = hostile(behaviour)
    failure, took, grew = _run(url, max_tokens, read_timeout_s)
    max_bytes, max_s = stream_bounds(max_tokens, read_timeout_s)
    assert failure is not None and failure.failure_class == "protocol-violation", failure
    assert words in failure.message and "client.stream_bounds" in failure.message
    assert took < within_s, took
    assert grew < 64 * max_bytes + (256 << 20), grew  # bounded: a few buffers of the bound, never the stream
    if behaviour is trickle:
        assert took >= max_s - 1  # cut at the deadline, not by a read timeout (each byte reset it)


def test_a_stream_labelled_other_than_an_event_stream_is_named(hostile):
    """A mislabelled stream is a protocol violation (an EventSource client refuses it), even with
    whole events inside; before, it was read as an event stream without a word."""
    failure, took, _ = _run(hostile(plain_text), 4, 5.0)
    assert failure is not None and failure.failure_class == "protocol-violation", failure
    assert "Content-Type text/plain, not text/event-stream" in failure.message and took < 5


def test_broken_chunked_framing_is_a_protocol_violation_not_an_engine_crash(hostile):
    """Census 5.19: a chunk size of ``zz`` raised ValueError, which every check charged to the
    engine as ``runtime-crash``."""
    failure, took, _ = _run(hostile(bad_chunk), 4, 5.0)
    assert failure is not None and failure.failure_class == "protocol-violation", failure
    assert "chunk size b'zz' is not a hexadecimal number" in failure.message and took < 5


def test_the_bounds_come_from_the_request():
    assert stream_bounds(16, 120) == (STREAM_BASE_BYTES + 16 * STREAM_BYTES_PER_TOKEN, 5 * 120 + 16 * 2.0)
    assert stream_bounds(0, 1)[0] == STREAM_BASE_BYTES + STREAM_BYTES_PER_TOKEN  # never zero


@pytest.mark.parametrize("data", [b"null", b"[1, 2]", b"5", b'"text"', b'{"choices": ["x"]}'])
def test_a_json_event_that_is_not_an_object_is_malformed_not_a_client_crash(hostile, data):
    """``data: null`` (or a list, a number, a string, a choice that is a string) parses as JSON but is no
    event of any API: the stream's malformed events, named (fails before: AttributeError inside the client, recorded as the
    engine's ``runtime-crash``)."""
    def stream(sock):
        sock.sendall(HEAD + _event("a") + b"data: " + data + b"\n\n" + _event(" b") + b"data: [DONE]\n\n")

    failure, took, _ = _run(hostile(stream), 4, 5.0)
    assert failure is not None and failure.failure_class == "transport-distortion", failure
    assert "malformed JSON SSE event" in failure.message and data.decode() in failure.message
