"""A client that stops reading a stream cancels its request: the connection is closed, as a client that
goes away closes it (vLLM aborts the request on the disconnect), not drained in the background; a stream
read to its end keeps its connection for the next request. The prefix-cache check's cancelled requests
(evaluations/prefix_traffic.py) are made this way."""

from __future__ import annotations

import asyncio
import json

from bakeoff.api.specs import GenerationRequest
from bakeoff.loadgen.client import OpenAIClient
from evaluations.serving import cancelled_stream

EVENTS = 50


def _server(log: list[str]):
    """A keep-alive SSE server sending ``EVENTS`` token events 10 ms apart, logging how each stream ended."""
    async def handle(reader, writer):
        while True:
            try:
                head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
            except (asyncio.IncompleteReadError, ConnectionError):
                writer.close()
                return
            hdrs = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in head.split("\r\n")[1:] if ln)}
            await reader.readexactly(int(hdrs["content-length"]))
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
            try:
                for i in range(EVENTS):
                    ev = b"data: " + json.dumps({"choices": [{"index": 0, "text": f" t{i}", "token_ids": [i],
                                                              "finish_reason": "length" if i == EVENTS - 1 else None}]}).encode()
                    chunk = ev + b"\n\n" + (b"data: [DONE]\n\n" if i == EVENTS - 1 else b"")
                    writer.write(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
                    await writer.drain()
                    await asyncio.sleep(0.01)
                    if reader.at_eof():
                        raise ConnectionResetError
                writer.write(b"0\r\n\r\n")
                await writer.drain()
                log.append("finished")
            except ConnectionError:
                log.append("client gone")
                writer.close()
                return
    return handle


class _Engine:
    """The least a check needs of a backend: ``stream`` and ``aclose``."""

    def __init__(self, client):
        self.client = client

    def stream(self, req):
        return self.client.stream(req)

    async def aclose(self):
        await self.client.aclose()


def test_a_stream_left_mid_way_is_cancelled_and_a_read_one_finishes():
    log: list[str] = []

    async def main():
        srv = await asyncio.start_server(_server(log), "127.0.0.1", 0)
        url = f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}"
        client = OpenAIClient(url, "m")
        try:
            full = [ev.text async for ev in client.stream(GenerationRequest(request_id="a", prompt="p", max_tokens=EVENTS))]
            events = client.stream(GenerationRequest(request_id="b", prompt="p", max_tokens=EVENTS))
            got = 0
            async for ev in events:
                got += bool(ev.text)
                if got == 2:
                    break
            await events.aclose()
            for _ in range(100):  # the server notices within its next write
                if len(log) == 2:
                    break
                await asyncio.sleep(0.02)
            return full, got
        finally:
            await client.aclose()
            srv.close()

    full, got = asyncio.run(main())
    assert len(full) == EVENTS and got == 2
    assert log == ["finished", "client gone"], log


def test_cancelled_stream_reports_what_came_before_the_cancel():
    log: list[str] = []

    async def serve():
        srv = await asyncio.start_server(_server(log), "127.0.0.1", 0)
        return srv, f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}"

    loop = asyncio.new_event_loop()
    srv, url = loop.run_until_complete(serve())
    import threading

    t = threading.Thread(target=loop.run_forever, daemon=True)
    t.start()
    try:
        row = cancelled_stream(_Engine(OpenAIClient(url, "m")), GenerationRequest(request_id="c", prompt="p",
                                                                                max_tokens=EVENTS), 3)
        for _ in range(100):
            if log:
                break
            asyncio.run(asyncio.sleep(0.02))
    finally:
        loop.call_soon_threadsafe(srv.close)
        loop.call_soon_threadsafe(loop.stop)
        t.join(5)
    assert row["status"] == "cancelled" and row["events"] == 3 and row["text"] == " t0 t1 t2", row
    assert log == ["client gone"], log
