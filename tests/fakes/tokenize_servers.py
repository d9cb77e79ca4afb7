"""FAKE servers for the ``sanity.tokenizer`` check (``tests/test_tokenizer_check.py``); none is a backend.

Each answers ``GET /health`` and ``GET /v1/models`` like an OpenAI-compatible server (enough for
the ``openai`` backend to attach) and differs in its ``/tokenize``:

- ``shifted``: vLLM's shape (``{"tokens", "count", "max_model_len"}``), the ids of the given
  ``tokenizer.json`` each plus ``--shift`` (default 1): an engine that tokenizes every prompt
  unlike the reference.
- ``faithful``: the same, unshifted (the control).
- ``sglang``: like ``faithful`` but only on ``/v1/tokenize`` (SGLang serves both spellings).
- ``no-route``: no ``/tokenize`` at all (404).
- ``other-shape``: llama.cpp's shape, which ignores vLLM's fields: ``{"tokens": []}``.
- ``broken``: ``/tokenize`` answers HTTP 500.

Every ``/tokenize`` body received is appended to ``app["seen"]`` (in-process use). Run as
``python -m tests.fakes.tokenize_servers KIND --tokenizer DIR --port P``.
"""

from __future__ import annotations

import argparse

KINDS = ("shifted", "faithful", "sglang", "no-route", "other-shape", "broken")


def tokenize_app(kind: str, tokenizer_dir: str | None = None, shift: int = 1):
    """The FAKE server of ``kind`` (see the module docstring) as an aiohttp application."""
    from aiohttp import web

    tok = None
    if tokenizer_dir:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(f"{tokenizer_dir}/tokenizer.json")
    app = web.Application()
    app["seen"] = []

    async def health(_):
        return web.json_response({"status": "ok"})

    async def models(_):
        return web.json_response({"object": "list", "data": [{"id": f"fake-{kind}", "object": "model"}]})

    async def tokenize(request):
        body = await request.json()
        app["seen"].append(body)
        if kind == "broken":
            return web.json_response({"error": {"message": "FAKE: tokenizer exploded"}}, status=500)
        if kind == "other-shape":
            return web.json_response({"tokens": []})
        if "messages" in body:
            text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in body["messages"])
            text += "<|im_start|>assistant\n" if body.get("add_generation_prompt") else ""
        else:
            text = body["prompt"]
        ids = [t + (shift if kind == "shifted" else 0) for t in tok.encode(text).ids]
        return web.json_response({"tokens": ids, "count": len(ids), "max_model_len": 512})

    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    if kind == "sglang":
        app.router.add_post("/v1/tokenize", tokenize)
    elif kind != "no-route":
        app.router.add_post("/tokenize", tokenize)
    return app


def main(argv: list[str] | None = None) -> None:
    from aiohttp import web

    ap = argparse.ArgumentParser()
    ap.add_argument("kind", choices=KINDS)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--tokenizer")
    ap.add_argument("--shift", type=int, default=1)
    a = ap.parse_args(argv)
    web.run_app(tokenize_app(a.kind, a.tokenizer, a.shift), host="127.0.0.1", port=a.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
