"""Test doubles: proxies that corrupt a real engine's tokens on the way out (``tests/test_real_model_doubles.py``).

Each is a FAKE engine made broken on purpose, not a backend of bakeoff: an OpenAI-compatible
completions proxy in front of a real server (the transformers worker serving a real model) that
rewrites the content tokens of every stream and forwards the rest as the server sent it (the
usage chunk, ``[DONE]``, ``/health``, ``/v1/models``, ``/metrics``, ``/tokenize``). The rewritten
streams stay self-consistent: each event carries one token id, its text is the cumulative decode
of the ids sent so far (the model's ``tokenizer.json`` through ``tokenizers``, as the server makes
text), and the server's logprob entry for a token travels with it:

- ``permute``: reverses the order of the content tokens within each window of ``--window``
  (default 4) tokens: the same tokens in the wrong order (a scrambled KV cache position, a
  mis-ordered detokenizer).
- ``replace``: replaces every ``--every``-th (default 5) content token with a whole-word-looking
  token of the vocabulary (a leading space and letters, as the ``garbage`` server of
  ``broken_servers.py`` picks), seeded; the server's top-k at that position is kept and the chosen
  token's logprob is the lowest of them (the server ruled it out of its top-k).

Run as ``python -m tests.fakes.token_doubles permute|replace --upstream URL --tokenizer DIR --port P``;
ready when ``GET /health`` answers 200.
"""

from __future__ import annotations

import argparse
import json
import random
from typing import Any, Callable

# a token: (id, its ``(token, logprob, top_logprobs)`` entry of the server's completions ``logprobs``, or None)
Token = tuple
Transform = Callable[[list[Token], bool], list[Token]]


def permute(window: list[Token], _full: bool) -> list[Token]:
    """The window's tokens in reverse order (every token of a full even window moves)."""
    return window[::-1]


def replacer(pool: list[int], seed: int = 0) -> Transform:
    """A window transform replacing the last token of each full window with a pool token other
    than it (one per stream: seeded, so a stream's replacements depend on its tokens alone)."""
    rng = random.Random(seed)

    def replace(window: list[Token], full: bool) -> list[Token]:
        if not full:
            return window
        tid, lp = window[-1]
        new = rng.choice(pool)
        while new == tid:
            new = rng.choice(pool)
        if lp is not None:
            _, _, top = lp
            lp = (f"token_id:{new}", top.get(f"token_id:{new}", min(top.values(), default=-100.0)), top)
        return window[:-1] + [(new, lp)]

    return replace


class Rewriter:
    """One stream's rewriting: content tokens in, rewritten events out, window by window.

    Args:
        tokenizer: a ``tokenizers.Tokenizer`` (decodes the rewritten ids into text).
        window: tokens per window.
        transform: ``transform(tokens, full) -> tokens`` (``full``: the window holds ``window`` tokens).
    """

    def __init__(self, tokenizer, window: int, transform: Transform):
        self.tokenizer, self.window, self.transform = tokenizer, window, transform
        self.held: list[Token] = []
        self.sent_ids: list[int] = []
        self.sent_text = ""
        self.logprobs = False

    def _text(self, final: bool) -> str:
        text = self.tokenizer.decode(self.sent_ids, skip_special_tokens=True)
        if text.endswith("\ufffd") and not final:  # an incomplete multi-byte character: held back
            return ""
        delta, self.sent_text = text[len(self.sent_text):], text
        return delta

    def _events(self, tokens: list[Token], final: bool) -> list[dict[str, Any]]:
        out = []
        for k, (tid, lp) in enumerate(tokens):
            self.sent_ids.append(tid)
            choice: dict[str, Any] = {"index": 0, "token_ids": [tid], "finish_reason": None,
                                      "text": self._text(final and k == len(tokens) - 1)}
            if self.logprobs and lp is not None:
                choice["logprobs"] = {"tokens": [lp[0]], "token_logprobs": [lp[1]], "top_logprobs": [lp[2]]}
            out.append(choice)
        return out

    def feed(self, choice: dict[str, Any]) -> list[dict[str, Any]]:
        """The choices to send for one upstream choice (its finish reason on the last)."""
        ids = choice.get("token_ids") or []
        lps = choice.get("logprobs")
        if lps:
            self.logprobs = True
            entries = list(zip(lps["tokens"], lps["token_logprobs"], lps["top_logprobs"]))
        else:
            entries = [None] * len(ids)
        self.held += list(zip(ids, entries))
        out: list[dict[str, Any]] = []
        while len(self.held) >= self.window:
            out += self._events(self.transform(self.held[:self.window], True), False)
            self.held = self.held[self.window:]
        finish = choice.get("finish_reason")
        if finish:
            out += self._events(self.transform(self.held, len(self.held) == self.window), True)
            self.held = []
            out = out or [{"index": 0, "token_ids": [], "text": self._text(True)}]
            out[-1]["finish_reason"] = finish
        return out


def rewriting_app(upstream: str, tokenizer_dir: str, kind: str, window: int, every: int):
    """The aiohttp application of the ``permute`` or ``replace`` proxy."""
    import aiohttp
    from aiohttp import web
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(f"{tokenizer_dir}/tokenizer.json")
    if kind == "permute":
        size, make = window, lambda: permute
    else:
        specials = {i for t, i in tok.get_vocab().items() if t.startswith("<|")}
        pool = [i for i in range(tok.get_vocab_size()) if i not in specials
                and (lambda s: s.startswith(" ") and s[1:].isalpha())(tok.decode([i]))]
        size, make = every, lambda: replacer(pool)
    timeout = aiohttp.ClientTimeout(total=600, sock_read=300)  # every read bounded; the client's own timeout is shorter

    async def passthrough(request):
        async with aiohttp.ClientSession(timeout=timeout) as s:
            async with s.request(request.method, upstream + request.path_qs, data=await request.read(),
                                 headers={"Content-Type": request.headers.get("Content-Type", "application/json")}) as r:
                return web.Response(status=r.status, body=await r.read(), content_type=r.content_type)

    async def completions(request):
        body = await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        rewriter = Rewriter(tok, size, make())
        async with aiohttp.ClientSession(timeout=timeout) as s:
            async with s.post(upstream + request.path, data=body, headers={"Content-Type": "application/json"}) as r:
                if r.status != 200 or not json.loads(body).get("stream"):  # bakeoff's client streams
                    return web.Response(status=r.status, body=await r.read(), content_type=r.content_type)
                await resp.prepare(request)
                buf = b""
                async for chunk in r.content.iter_any():
                    buf += chunk
                    while b"\n\n" in buf:
                        event, buf = buf.split(b"\n\n", 1)
                        data = event[6:] if event.startswith(b"data: ") else b""
                        try:
                            obj = json.loads(data) if data and data != b"[DONE]" else None
                        except ValueError:
                            obj = None
                        choices = (obj or {}).get("choices") or []
                        if not choices or "error" in obj:  # usage, [DONE], errors: as the server sent them
                            await resp.write(event + b"\n\n")
                            continue
                        for choice in rewriter.feed(choices[0]):
                            await resp.write(b"data: " + json.dumps({**obj, "choices": [choice]}).encode() + b"\n\n")
        return resp

    return proxy_app(completions, passthrough)


def proxy_app(completions, passthrough):
    """The aiohttp application of a proxy double: its own ``/v1/completions``, the server's other routes as
    they are (``/health``, ``/v1/models``, ``/metrics``, ``/tokenize``)."""
    from aiohttp import web

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    for path in ("/health", "/v1/models", "/metrics"):
        app.router.add_get(path, passthrough)
    app.router.add_post("/tokenize", passthrough)
    return app


def main(argv: list[str] | None = None) -> None:
    from aiohttp import web

    ap = argparse.ArgumentParser()
    ap.add_argument("kind", choices=["permute", "replace"])
    ap.add_argument("--upstream", required=True)
    ap.add_argument("--tokenizer", required=True, help="the served model's folder (its tokenizer.json)")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--window", type=int, default=4, help="permute: tokens per reversed window")
    ap.add_argument("--every", type=int, default=5, help="replace: every N-th content token")
    a = ap.parse_args(argv)
    app = rewriting_app(a.upstream.rstrip("/"), a.tokenizer, a.kind, a.window, a.every)
    web.run_app(app, host="127.0.0.1", port=a.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
