"""Servers broken on purpose for the ``openai`` backend's timeouts and probe (``tests/test_openai_stalls.py``).

Each is a FAKE; none is a backend of bakeoff:

- ``stall``: answers ``GET /health`` (200) and ``GET /v1/models`` (one model) like an
  OpenAI-compatible server, and never answers anything else: completions, chat, messages,
  ``/tokenize``, ``/v1/tokenize``, ``/metrics``, ``/version`` accept the request and send no
  byte (an engine wedged behind a live HTTP front end).
- ``stall-all``: the same, ``/health`` and ``/v1/models`` included (a process that accepts
  connections and never answers).
- ``html``: every route answers 200 with an HTML login page (``Content-Type: text/html``), as a
  web application or a sign-in proxy on the port does.
- ``html-404``: ``GET /health`` answers JSON (200); every other route a proxy's HTML 404 page (an
  API whose ``/v1/models`` is not routed: still an API, the model name must be given).
- ``trickle``: as ``stall`` for ``/health`` and ``/v1/models``; a generation answers 200 as an
  event stream and then sends one byte every 50 ms without end (each byte resets a read timeout).

Every request's ``METHOD path`` is appended to ``app[SEEN]``. Run as
``python -m tests.fakes.stalling_servers KIND --port P``.
"""

from __future__ import annotations

import argparse
import asyncio

KINDS = ("stall", "stall-all", "html", "html-404", "trickle")
LOGIN_PAGE = ("<!DOCTYPE html>\n<html><head><title>Sign in</title></head>\n<body><form method=\"post\" "
              "action=\"/login\"><input name=\"user\"><input name=\"password\" type=\"password\"></form></body></html>\n")


def _keys():
    from aiohttp import web

    return web.AppKey("seen", list), web.AppKey("stop", asyncio.Event)


SEEN, STOP = _keys()


def stalling_app(kind: str):
    """The FAKE server of ``kind`` (module docstring) as an aiohttp application."""
    from aiohttp import web

    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; one of {KINDS}")
    app = web.Application()
    app[SEEN] = []

    async def startup(_):
        app[STOP] = asyncio.Event()

    async def shutdown(_):  # the stalled handlers end when the server does (else cleanup waits for them)
        app[STOP].set()

    async def handle(request):
        app[SEEN].append(f"{request.method} {request.path}")
        if kind == "html":
            return web.Response(text=LOGIN_PAGE, content_type="text/html")
        if kind == "html-404":
            if request.path == "/health":
                return web.json_response({"status": "ok"})
            return web.Response(status=404, text="<html><body><h1>404 Not Found</h1></body></html>", content_type="text/html")
        if kind in ("stall", "trickle") and request.method == "GET" and request.path == "/health":
            return web.json_response({"status": "ok"})
        if kind in ("stall", "trickle") and request.method == "GET" and request.path == "/v1/models":
            return web.json_response({"object": "list", "data": [{"id": "fake-stall", "object": "model"}]})
        if kind == "trickle" and request.method == "POST":
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            while not app[STOP].is_set():
                await resp.write(b": ")  # an SSE comment's bytes: no event, ever
                await asyncio.sleep(0.05)
            return resp
        await app[STOP].wait()  # never answers while serving: no status line, no byte
        return web.Response(status=503)

    app.on_startup.append(startup)
    app.on_shutdown.append(shutdown)
    app.router.add_route("*", "/{tail:.*}", handle)
    return app


def main(argv: list[str] | None = None) -> None:
    from aiohttp import web

    ap = argparse.ArgumentParser()
    ap.add_argument("kind", choices=KINDS)
    ap.add_argument("--port", type=int, required=True)
    a = ap.parse_args(argv)
    web.run_app(stalling_app(a.kind), host="127.0.0.1", port=a.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
