"""A FAKE buffering proxy: a TCP relay that holds the server's bytes until it has ``flush_bytes``
of them or ``quiet_ms`` pass with nothing new, as buffering load balancers do (nginx's
``proxy_buffering``), so the tests can prove bakeoff tells such a hop from the engine.

Client-to-server bytes pass at once; server-to-client bytes are buffered. Run as a child::

    python -m tests.fakes.buffering_proxy --port P --upstream-port Q [--flush-bytes 4096 --quiet-ms 50]

or in-process with :func:`serve` (an asyncio server on the running loop). ``--flush-bytes 0``
makes it a plain relay (the control: same hop, no buffering).
"""

from __future__ import annotations

import argparse
import asyncio


async def _pump_direct(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, asyncio.CancelledError):
        pass
    finally:
        writer.close()


async def _pump_buffered(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, flush_bytes: int,
                         quiet_s: float) -> None:
    buf = bytearray()
    try:
        while True:
            try:
                data = await asyncio.wait_for(reader.read(65536), quiet_s) if buf else await reader.read(65536)
            except asyncio.TimeoutError:  # quiet for quiet_ms: flush what is held
                writer.write(bytes(buf))
                buf.clear()
                await writer.drain()
                continue
            if not data:
                break
            buf += data
            if len(buf) >= flush_bytes:
                writer.write(bytes(buf))
                buf.clear()
                await writer.drain()
        if buf:
            writer.write(bytes(buf))
            await writer.drain()
    except (ConnectionError, asyncio.CancelledError):
        pass
    finally:
        writer.close()


async def serve(port: int, upstream_port: int, flush_bytes: int = 4096, quiet_ms: float = 50.0,
                host: str = "127.0.0.1") -> asyncio.AbstractServer:
    """Start the proxy on the running loop; returns the server (close it when done)."""

    async def handle(c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        try:
            s_reader, s_writer = await asyncio.open_connection(host, upstream_port)
        except OSError:
            c_writer.close()
            return
        up = asyncio.ensure_future(_pump_direct(c_reader, s_writer))
        if flush_bytes > 0:
            down = asyncio.ensure_future(_pump_buffered(s_reader, c_writer, flush_bytes, quiet_ms / 1e3))
        else:
            down = asyncio.ensure_future(_pump_direct(s_reader, c_writer))
        await asyncio.wait([up, down], return_when=asyncio.FIRST_COMPLETED)
        for t in (up, down):
            if not t.done():
                t.cancel()

    return await asyncio.start_server(handle, host, port)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--upstream-port", type=int, required=True)
    ap.add_argument("--flush-bytes", type=int, default=4096)
    ap.add_argument("--quiet-ms", type=float, default=50.0)
    a = ap.parse_args(argv)

    async def run() -> None:
        server = await serve(a.port, a.upstream_port, a.flush_bytes, a.quiet_ms)
        async with server:
            await server.serve_forever()

    asyncio.run(run())


if __name__ == "__main__":
    main()
