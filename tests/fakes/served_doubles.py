"""Test doubles of issue 53: FAKE servers that are right when alone and wrong only where they are served
under a condition (``tests/test_served_doubles.py``).

Each is an OpenAI-compatible completions proxy in front of a real engine (the transformers worker
serving a model), broken on purpose, never a backend of bakeoff. Every mode keeps its streams
self-consistent (one token id an event, its text the cumulative decode of the ids sent, the server's
logprob entry beside it: :class:`tests.fakes.token_doubles.Rewriter`), and every mode simulates a prefix
cache's accounting: each usage chunk states ``prompt_tokens_details.cached_tokens``, the longest token
prefix the prompt shares with an earlier prompt, in whole blocks of ``BLOCK`` tokens (at most all but
its last token), as a server with a prefix cache states it. The modes:

- ``honest``: nothing else (the control: every check passes it);
- ``load8``: replaces every second content token while ``IN_FLIGHT`` or more streams are open;
- ``cancel_hit``: replaces every second content token of a request whose prompt hits a prefix that a
  request cancelled by its client left (a disconnect mid-stream);
- ``spec``: claims speculative decoding (vLLM's spec-decode counters on ``/metrics``, two of three
  drafted tokens accepted) and, as a drafter that accepts wrong tokens, replaces every third token
  from the 3rd on (the fixture's answers are short) in requests asking ``SPEC_LONG`` tokens or more;
- ``turn3``: replaces every second content token from the third turn of a conversation on (a request
  whose prompt extends an earlier request's prompt and output, twice);
- ``repeat``: with two or more streams open, a request with ``ignore_eos`` gets half its tokens from the
  engine, each streamed twice ("a a b b"), its usage counting what it streamed: as many tokens in half
  the time, so it reads twice as fast;
- ``double_count``: usage states twice the tokens it streamed.

Run as ``python -m tests.fakes.served_doubles MODE --upstream URL --tokenizer DIR --port P``; ready when
``GET /health`` answers 200.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
from dataclasses import dataclass, field
from typing import Any

from tests.fakes.token_doubles import Rewriter, proxy_app

MODES = ("honest", "load8", "cancel_hit", "spec", "turn3", "repeat", "double_count")
BLOCK = 16
IN_FLIGHT = 8
SPEC_LONG = 48
SPEC_FROM = 2


@dataclass
class Seen:
    """A request the proxy served: its prompt's ids, its prompt and output text, whether its client left."""

    ids: list[int]
    prompt: str
    output: str = ""
    cancelled: bool = False
    done: bool = False
    turn: int = 1


@dataclass
class State:
    """What the proxy remembers across requests."""

    seen: list[Seen] = field(default_factory=list)
    in_flight: int = 0
    spec: dict[str, float] = field(default_factory=lambda: {"drafts": 0.0, "draft_tokens": 0.0, "accepted": 0.0})


def shared_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def cached_tokens(ids: list[int], earlier: list[Seen]) -> int:
    """The simulated prefix cache's hit: the longest shared prefix with an earlier prompt, whole blocks,
    at most all but the prompt's last token."""
    best = max((shared_prefix(ids, s.ids) for s in earlier), default=0)
    return (min(best, len(ids) - 1) // BLOCK) * BLOCK if ids else 0


def turn_of(prompt: str, earlier: list[Seen]) -> int:
    """The conversation turn of a prompt: 1, or one more than the turn of an earlier finished request
    whose prompt and output it extends."""
    return 1 + max((s.turn for s in earlier if s.done and len(prompt) > len(s.prompt)
                    and prompt.startswith(s.prompt + s.output)), default=0)


def corrupter(pool: list[int], start: int, every: int, seed: int = 0):
    """A window-of-1 transform replacing every ``every``-th token from position ``start`` on with a pool
    token (its logprob entry the lowest of the server's top-k: outside what the server would choose)."""
    rng = random.Random(seed)
    pos = [0]

    def transform(window: list, _full: bool) -> list:
        out = []
        for tid, lp in window:
            p = pos[0]
            pos[0] += 1
            if p >= start and (p - start) % every == every - 1:
                new = rng.choice([t for t in pool[:64] if t != tid])
                if lp is not None:
                    _, _, top = lp
                    lp = (f"token_id:{new}", min(top.values(), default=-100.0), top)
                tid = new
            out.append((tid, lp))
        return out
    return transform


def repeater(limit: int):
    """A window-of-1 transform streaming each token twice, ``limit`` tokens at most (the request's own
    ``max_tokens``: its usage stays possible)."""
    sent = [0]

    def transform(window: list, _full: bool) -> list:
        out = [t for t in window for _ in range(2)][:max(0, limit - sent[0])]
        sent[0] += len(out)
        return out
    return transform


def spec_metrics(spec: dict[str, float]) -> str:
    """vLLM's spec-decode counters as a server with three speculative tokens would expose them."""
    d = spec["drafts"]
    lines = [f"vllm:spec_decode_num_drafts_total {d}", f"vllm:spec_decode_num_draft_tokens_total {spec['draft_tokens']}",
             f"vllm:spec_decode_num_accepted_tokens_total {spec['accepted']}"]
    lines += [f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}} {round(d * r)}'
              for i, r in enumerate((0.9, 0.7, 0.4))]
    return "\n".join(lines) + "\n"


def plan(mode: str, body: dict[str, Any], ids: list[int], state: State) -> dict[str, Any]:
    """What the proxy does to one request: ``{"corrupt": (start, every) | None, "repeat": bool}``."""
    corrupt = None
    if mode == "load8" and state.in_flight >= IN_FLIGHT:
        corrupt = (0, 2)
    elif mode == "cancel_hit" and any(s.cancelled and shared_prefix(ids, s.ids) >= BLOCK for s in state.seen):
        corrupt = (0, 2)
    elif mode == "spec" and int(body.get("max_tokens") or 0) >= SPEC_LONG:
        corrupt = (SPEC_FROM, 3)
    elif mode == "turn3" and turn_of(body.get("prompt") or "", state.seen) >= 3:
        corrupt = (0, 2)
    repeat = mode == "repeat" and state.in_flight >= 2 and bool(body.get("ignore_eos"))
    return {"corrupt": corrupt, "repeat": repeat}


def served_app(upstream: str, tokenizer_dir: str, mode: str):
    """The aiohttp application of one mode (module docstring)."""
    import aiohttp
    from aiohttp import web
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(f"{tokenizer_dir}/tokenizer.json")
    specials = {i for t, i in tok.get_vocab().items() if t.startswith("<") and t.endswith(">")}
    pool = [i for i in range(tok.get_vocab_size()) if i not in specials and tok.decode([i]).strip()]
    state = State()
    timeout = aiohttp.ClientTimeout(total=600, sock_read=300)

    def finished(me: Seen, rewriter: Rewriter) -> None:
        me.output = tok.decode(rewriter.sent_ids, skip_special_tokens=True)
        me.done = not me.cancelled

    async def passthrough(request):
        async with aiohttp.ClientSession(timeout=timeout) as s:
            async with s.request(request.method, upstream + request.path_qs, data=await request.read(),
                                 headers={"Content-Type": request.headers.get("Content-Type", "application/json")}) as r:
                body = await r.read()
                if request.path == "/metrics" and mode == "spec":
                    body += spec_metrics(state.spec).encode()
                return web.Response(status=r.status, body=body, content_type=r.content_type)

    async def completions(request):
        raw = await request.read()
        body = json.loads(raw)
        if not body.get("stream"):  # bakeoff's client streams; anything else as the server answers it
            return await passthrough(request)
        prompt = body.get("prompt") or ""
        ids = tok.encode(prompt, add_special_tokens=False).ids
        state.in_flight += 1
        what = plan(mode, body, ids, state)
        me = Seen(ids, prompt, turn=turn_of(prompt, state.seen))
        hit = cached_tokens(ids, state.seen)
        state.seen.append(me)
        asked = int(body.get("max_tokens") or 16)
        if what["repeat"]:
            body["max_tokens"] = math.ceil(asked / 2)
        transform = (corrupter(pool, *what["corrupt"]) if what["corrupt"] else
                     repeater(asked) if what["repeat"] else (lambda w, _f: w))
        rewriter = Rewriter(tok, 1, transform)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        try:
            async with aiohttp.ClientSession(timeout=timeout) as s:
                async with s.post(upstream + request.path, data=json.dumps(body).encode(),
                                  headers={"Content-Type": "application/json"}) as r:
                    if r.status != 200:
                        return web.Response(status=r.status, body=await r.read(), content_type=r.content_type)
                    await resp.prepare(request)
                    await _relay(request, r, resp, rewriter, hit, what["repeat"], lambda: finished(me, rewriter))
        except (ConnectionResetError, asyncio.CancelledError):
            me.cancelled = True  # the client left mid-stream (a failed write, or aiohttp cancelling the handler)
            raise
        finally:
            state.in_flight -= 1
            if not me.done:
                finished(me, rewriter)
            if mode == "spec":
                drafts = math.ceil(len(rewriter.sent_ids) / 3)
                state.spec["drafts"] += drafts
                state.spec["draft_tokens"] += 3 * drafts
                state.spec["accepted"] += 2 * drafts
        return resp

    async def _relay(request, r, resp, rewriter: Rewriter, hit: int, repeat: bool, on_end) -> None:
        buf = b""
        async for chunk in r.content.iter_any():
            if request.transport is None or request.transport.is_closing():  # the client closed its connection:
                raise ConnectionResetError("the client went away")  # seen now, not at a write the buffers absorb
            buf += chunk
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                data = event[6:] if event.startswith(b"data: ") else b""
                try:
                    obj = json.loads(data) if data and data != b"[DONE]" else None
                except ValueError:
                    obj = None
                choices = (obj or {}).get("choices") or []
                if obj is not None and not choices and obj.get("usage"):
                    usage = dict(obj["usage"])
                    usage["prompt_tokens_details"] = {"cached_tokens": hit}
                    if repeat:
                        usage["completion_tokens"] = len(rewriter.sent_ids)
                    if mode == "double_count":
                        usage["completion_tokens"] = 2 * int(usage.get("completion_tokens") or 0)
                    await resp.write(b"data: " + json.dumps({**obj, "usage": usage}).encode() + b"\n\n")
                    continue
                if not choices or "error" in obj:  # [DONE], errors: as the server sent them
                    if data == b"[DONE]":
                        on_end()  # known done before the client can send its next turn
                    await resp.write(event + b"\n\n")
                    continue
                for choice in rewriter.feed(choices[0]):
                    await resp.write(b"data: " + json.dumps({**obj, "choices": [choice]}).encode() + b"\n\n")

    return proxy_app(completions, passthrough)


def main(argv: list[str] | None = None) -> None:
    from aiohttp import web

    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=MODES)
    ap.add_argument("--upstream", required=True)
    ap.add_argument("--tokenizer", required=True, help="the served model's folder (its tokenizer.json)")
    ap.add_argument("--port", type=int, required=True)
    a = ap.parse_args(argv)
    # handler_cancellation: a client that goes away cancels its handler at once (aiohttp's default notices it only
    # at a later write), so a cancelled request is known as such before the client's next request arrives
    web.run_app(served_app(a.upstream.rstrip("/"), a.tokenizer, a.mode), host="127.0.0.1", port=a.port, print=None,
                access_log=None, handler_cancellation=True)


if __name__ == "__main__":
    main()
