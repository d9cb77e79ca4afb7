"""Faults on the wire and at the server, found by a break-it review: compressed streams, a
tokenizer option that cannot be read, a start that fails with any exception, usage that
disagrees with the client's count, a server that dies mid-stream. Servers here are FAKES
written for the purpose (aiohttp apps and a raw socket), named so."""

from __future__ import annotations

import asyncio

import pytest

from bakeoff.api.specs import GenerationRequest
from tests.test_transport import N, _suite, backend, doubled, one, word_tokenizer  # noqa: F401 - doubled is a fixture


def _compressing_app(coding: str):
    """A FAKE completions server whose event stream a hop compressed: gzip flushed per event
    (``Z_SYNC_FLUSH``, as a well-set proxy does), or a coding the client cannot read."""
    import zlib

    from aiohttp import web

    async def completions(request):
        sent = {"gzip-members": "gzip", "raw-deflate": "deflate"}.get(coding, coding)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Content-Encoding": sent})
        await resp.prepare(request)
        events = [f'data: {{"choices":[{{"index":0,"text":" t{i}"}}]}}\n\n'.encode() for i in range(N)]
        events.append(b'data: {"choices":[{"index":0,"text":"","finish_reason":"length"}]}\n\n')  # a finished stream
        events.append(b"data: [DONE]\n\n")
        if coding == "gzip-members":  # one whole gzip member per event: valid gzip, several members
            for event in events:
                await resp.write(zlib.compress(event, wbits=31))
            return resp
        z = zlib.compressobj(wbits=-15 if coding == "raw-deflate" else 31)
        for event in events[:-1]:
            await resp.write(z.compress(event) + z.flush(zlib.Z_SYNC_FLUSH))
        await resp.write(z.compress(events[-1]) + z.flush())
        return resp

    async def health(request):
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/health", health)
    return app


@pytest.mark.parametrize("coding", ["gzip", "gzip-members", "raw-deflate", "br"])
def test_compressed_stream_is_inflated_or_refused_by_name(tmp_path, coding):
    from tests.test_tokenizer_check import serving

    with serving(_compressing_app(coding)) as url:
        rec = one(backend(url, "completions", tmp_path, model="m"), f"enc-{coding}")
    if coding != "br":
        assert rec.status == "ok", rec.error
        assert rec.content_events == N and rec.output_text == "".join(f" t{i}" for i in range(N))
    else:
        assert rec.status == "error" and "Content-Encoding: br" in (rec.error or ""), rec.error


def test_openai_tokenizer_that_does_not_load_is_refused_before_start(tmp_path):
    from pydantic import ValidationError

    from backends.openai.backend import OpenAIOptions

    with pytest.raises(ValidationError, match="tokenizer"):
        OpenAIOptions(base_url="http://127.0.0.1:1", tokenizer=str(tmp_path / "nope"))
    import os

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # reading it would block forever
    for bad in ("", "  ", str(fifo)):
        with pytest.raises(ValidationError, match="tokenizer"):
            OpenAIOptions(base_url="http://127.0.0.1:1", tokenizer=bad)


def test_a_load_that_fails_with_any_exception_is_a_load_failure_and_nothing_measures(tmp_path):
    """A server listing a model id that is not a string made ``start()`` raise TypeError, which
    the plugin did not catch: the half-started backend was then measured (found by a break-it
    review). Now: ``load-failure`` with the traceback, every engine check a skip."""
    from aiohttp import web

    from tests.test_tokenizer_check import serving

    async def models(request):
        return web.json_response({"object": "list", "data": [{"id": 5, "object": "model"}]})

    async def health(request):
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    with serving(app) as url:
        checks = _suite(tmp_path, url, word_tokenizer(tmp_path / "tok"))
    load = checks["load"]
    assert load["status"] == "fail" and load["failure_class"] == "load-failure", load
    assert "TypeError" in load["summary"]
    measured = [c for n, c in checks.items() if n.startswith("throughput.")]
    assert measured and all(c["status"] == "skip" and "backend did not load" in c["summary"] for c in measured), measured


@pytest.mark.slow
def test_disputed_counts_are_marked_in_the_report(doubled, tmp_path):
    """Usage twice the client's count: throughput.accounting fails and the report says the
    sweep's tokens/s may be off (neither count is proven right)."""
    from bakeoff.reporting.report import write_report

    checks = _suite(tmp_path / "s", doubled.url, word_tokenizer(tmp_path / "tok"))
    assert checks["throughput.accounting"]["status"] == "fail"
    text = write_report([tmp_path / "s" / "art" / "runs"], tmp_path / "report").read_text()
    assert "Token counts disputed" in text


def test_a_server_that_dies_mid_stream_is_a_crash_not_a_hop(tmp_path):
    """A FAKE server streams 3 events, then closes its listener and the connection: the cut is
    ``runtime-crash`` (nothing answers any more), where a cut from a server that still answers
    stays ``transport-distortion``."""
    import socket
    import threading

    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(1)
    port = lsock.getsockname()[1]

    def serve():
        conn, _ = lsock.accept()
        conn.recv(65536)
        body = b"".join(f'data: {{"choices":[{{"index":0,"text":" t{i}"}}]}}\n\n'.encode() for i in range(3))
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                     + f"{len(body):x}\r\n".encode() + body + b"\r\n")
        lsock.close()
        conn.close()

    threading.Thread(target=serve, daemon=True).start()
    from bakeoff.loadgen.client import OpenAIClient

    client = OpenAIClient(f"http://127.0.0.1:{port}", "m")

    async def main():
        try:
            return [ev async for ev in client.stream(GenerationRequest(request_id="d", prompt="p", max_tokens=8))]
        finally:
            await client.aclose()
    from bakeoff.api.errors import EngineFailure

    with pytest.raises(EngineFailure) as exc:
        asyncio.run(main())
    assert exc.value.failure_class == "runtime-crash" and "refuses connections" in exc.value.message
