"""Broken servers made on purpose (test fixtures of the gallery, ``tests/test_gallery.py``).

Each is a FAKE engine that proves a check can fail; none is a backend of bakeoff:

- ``garbage``: an OpenAI-compatible completions server that streams fluent-looking random
  tokens of a real vocabulary (each a whole token of the fixture's tokenizer, with its id),
  stops at ``max_tokens`` and reports honest usage. Word salad: no repeated run, high
  distinct-2, one script, so the model-free detectors pass it.
- ``drop``: a proxy in front of a real OpenAI-compatible server that drops every tenth
  content event of each stream (text and token ids) and forwards the server's usage as is.

Run as ``python -m tests.fakes.broken_servers garbage --tokenizer DIR --port P`` or
``... drop --upstream URL --port P``; ready when ``GET /health`` answers 200.
"""

from __future__ import annotations

import argparse
import json
import random


def _sse(obj) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def garbage_app(tokenizer_dir: str, seed: int = 0):
    from aiohttp import web
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(f"{tokenizer_dir}/tokenizer.json")
    specials = {i for t, i in tok.get_vocab().items() if t.startswith("<|")}
    # whole-word-looking tokens: those that decode to a leading space and letters
    pool = [i for i in range(tok.get_vocab_size()) if i not in specials
            and (lambda s: s.startswith(" ") and s[1:].isalpha())(tok.decode([i]))]
    rng = random.Random(seed)

    async def health(_):
        return web.json_response({"status": "ok"})

    async def models(_):
        return web.json_response({"object": "list", "data": [{"id": "garbage", "object": "model"}]})

    async def completions(request):
        body = await request.json()
        n = int(body.get("max_tokens") or 16)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for k in range(n):
            tid = rng.choice(pool)
            await resp.write(_sse({"choices": [{"index": 0, "text": tok.decode([tid]), "token_ids": [tid],
                                                "finish_reason": "length" if k == n - 1 else None}]}))
        prompt = len(tok.encode(body.get("prompt") or "").ids)
        await resp.write(_sse({"choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": n,
                                                        "total_tokens": prompt + n}}))
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    return app


def drop_app(upstream: str, every: int = 10):
    import aiohttp
    from aiohttp import web

    async def passthrough(request):
        async with aiohttp.ClientSession() as s:
            async with s.request(request.method, upstream + request.path_qs, data=await request.read(),
                                 headers={"Content-Type": request.headers.get("Content-Type", "application/json")}) as r:
                return web.Response(status=r.status, body=await r.read(), content_type=r.content_type)

    async def completions(request):
        body = await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        async with aiohttp.ClientSession() as s:
            async with s.post(upstream + request.path, data=body, headers={"Content-Type": "application/json"}) as r:
                if r.status != 200:
                    return web.Response(status=r.status, body=await r.read(), content_type=r.content_type)
                await resp.prepare(request)
                content = 0
                buf = b""
                async for chunk in r.content.iter_any():
                    buf += chunk
                    while b"\n\n" in buf:
                        event, buf = buf.split(b"\n\n", 1)
                        data = event[6:] if event.startswith(b"data: ") else b""
                        carries_token = False
                        if data and data != b"[DONE]":
                            try:
                                ch = (json.loads(data).get("choices") or [{}])[0]
                                carries_token = bool(ch.get("token_ids") or ch.get("text"))
                            except ValueError:
                                pass
                        if carries_token:
                            content += 1
                            if content % every == 0:
                                continue  # dropped in transit
                        await resp.write(event + b"\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    for path in ("/health", "/v1/models", "/metrics"):
        app.router.add_get(path, passthrough)
    return app


def main(argv: list[str] | None = None) -> None:
    from aiohttp import web

    ap = argparse.ArgumentParser()
    ap.add_argument("kind", choices=["garbage", "drop"])
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--tokenizer")
    ap.add_argument("--upstream")
    a = ap.parse_args(argv)
    app = garbage_app(a.tokenizer) if a.kind == "garbage" else drop_app(a.upstream.rstrip("/"))
    web.run_app(app, host="127.0.0.1", port=a.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
