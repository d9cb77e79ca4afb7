"""Wire formats of the synthetic server: HTTP/1.1 request parsing, responses, and the SSE events
of the three APIs, each framed as one HTTP chunk (``Transfer-Encoding: chunked``).

Event shapes follow vLLM's OpenAI server (``vllm/entrypoints/openai``: ``text_completion``
and ``chat.completion.chunk`` objects, ``token_ids`` per choice with ``return_token_ids``,
a final ``choices: []`` usage chunk with ``stream_options.include_usage``) and Anthropic's
Messages streaming events.
"""

from __future__ import annotations

import json
import random
import time

API_BY_PATH = {"/v1/completions": "completions", "/v1/chat/completions": "chat", "/v1/messages": "messages"}
CHUNK_END = b"0\r\n\r\n"
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 429: "Too Many Requests", 500: "Internal Server Error",
            502: "Bad Gateway", 503: "Service Unavailable", 504: "Gateway Timeout"}


def parse_request(buf: bytes):
    """One complete request off the front of ``buf``.

    Returns:
        ``(method, target, headers, body, rest)`` with lower-case header names, or None
        while the request is incomplete.
    """
    i = buf.find(b"\r\n\r\n")
    if i < 0:
        return None
    head = buf[:i].decode("latin-1").split("\r\n")
    method, target, *_ = head[0].split(" ") + ["", ""]
    headers = {}
    for ln in head[1:]:
        k, _, v = ln.partition(":")
        headers[k.strip().lower()] = v.strip()
    n = int(headers.get("content-length") or 0)
    if len(buf) < i + 4 + n:
        return None
    return method, target, headers, buf[i + 4: i + 4 + n], buf[i + 4 + n:]


def json_response(status: int, obj, close: bool = False) -> bytes:
    body = json.dumps(obj).encode()
    return (f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n{'connection: close' + chr(13) + chr(10) if close else ''}\r\n"
            ).encode() + body


def _frame(payload: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(payload), payload)


def _data(obj, event: str | None = None) -> bytes:
    s = json.dumps(obj, separators=(",", ":")).encode()
    return _frame((b"event: %s\n" % event.encode() if event else b"") + b"data: " + s + b"\n\n")


def _prompt_tokens(api: str, req: dict) -> int:
    if api == "completions":
        p = req.get("prompt", "")
        if isinstance(p, list):
            return len(p[0]) if p and isinstance(p[0], list) else len(p)
        return len(str(p).split())
    return sum(len(str(m.get("content", "")).split()) for m in req.get("messages") or [])


def token_text(j: int, rid: str) -> str:
    """Text of token ``j``: ``[rid]`` for the first (so any tool's output can be matched), `` tJ`` after."""
    return f"[{rid}]" if j == 0 else f" t{j}"


def _wants(api: str, req: dict, cfg) -> tuple[bool, bool]:
    """Whether the response carries token ids (``return_token_ids``) and a usage event (``include_usage``;
    always in messages), as the config says."""
    want_ids = cfg.token_ids == "always" or (cfg.token_ids == "auto" and bool(req.get("return_token_ids")))
    if cfg.usage == "auto":
        return want_ids, api == "messages" or bool((req.get("stream_options") or {}).get("include_usage"))
    return want_ids, cfg.usage == "always"


def _head(api: str, rid: str, model: str, p_tokens: int, created: int) -> bytes:
    """The response's headers and, for messages and chat, the opening event (message start, the role)."""
    head = (f"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\ncache-control: no-cache\r\n"
            f"transfer-encoding: chunked\r\nx-request-id: {rid}\r\n\r\n").encode()
    if api == "messages":
        head += _data({"type": "message_start", "message": {
            "id": f"msg_{rid}", "type": "message", "role": "assistant", "model": model, "content": [],
            "stop_reason": None, "usage": {"input_tokens": p_tokens, "output_tokens": 0}}}, "message_start")
    elif api == "chat":
        head += _data({"id": f"chatcmpl-{rid}", "object": "chat.completion.chunk", "created": created,
                       "model": model, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                    "logprobs": None, "finish_reason": None}]})
    return head


def _chunks(n: int, n_reason: int, per_chunk: int) -> list[list[int]]:
    """Token indexes grouped into events of at most ``per_chunk``; a chunk never mixes reasoning and text."""
    groups: list[list[int]] = []
    for j in range(n):
        if groups and len(groups[-1]) < per_chunk and (groups[-1][0] < n_reason) == (j < n_reason):
            groups[-1].append(j)
        else:
            groups.append([j])
    return groups


def build_events(api: str, req: dict, cfg, rid: str, rng: random.Random, t0: int):
    """The events of one response with their due times, built lazily (one at a time, when the
    previous one is sent) so that a burst of arriving requests costs little at arrival.

    Yields:
        ``(nominal_ns, framed_bytes, kind, n_tokens)`` in send order; ``kind`` is ``head``,
        ``meta``, ``ka`` (keep-alive comment), ``text``, ``reasoning``, ``usage`` or ``done``.
    """
    n, n_reason = _output_tokens(api, req, cfg)
    t_head = t0 + int(cfg.slow_first_byte_ms * 1e6)
    times = _due_times(cfg, n, t_head, rng)
    want_ids, want_usage = _wants(api, req, cfg)
    p_tokens = _prompt_tokens(api, req)
    model = req.get("model") or cfg.model
    created = int(time.time())
    yield (t_head, _head(api, rid, model, p_tokens, created), "head", 0)
    mj = json.dumps(model).encode()
    cmpl_pre = b'data: {"id":"cmpl-%s","object":"text_completion","created":%d,"model":%s,"choices":[{"index":0,' % (
        rid.encode(), created, mj)
    chat_pre = b'data: {"id":"chatcmpl-%s","object":"chat.completion.chunk","created":%d,"model":%s,"choices":[{"index":0,' % (
        rid.encode(), created, mj)
    yield from _keepalives(cfg, t_head, times[0])
    block = -1
    for g in _chunks(n, n_reason, cfg.tokens_per_chunk):
        reasoning = g[0] < n_reason
        text = "".join(token_text(j, rid) for j in g)
        t = times[g[-1]]
        last = g[-1] == n - 1
        kind = "reasoning" if reasoning else "text"
        malformed = cfg.malformed_at_token is not None and g[0] <= cfg.malformed_at_token <= g[-1]
        ids = [100 + j for j in g]
        tj = json.dumps(text).encode()
        fr = b'"length"' if last else b"null"
        idj = (b',"token_ids":' + json.dumps(ids).encode()) if want_ids else b""
        if api == "messages":
            want_block = 0 if reasoning else (1 if n_reason else 0)
            if want_block != block:
                yield from _block_change(t, block, want_block, reasoning)
                block = want_block
            dt = b'"thinking_delta","thinking":' if reasoning else b'"text_delta","text":'
            data = _frame(b'event: content_block_delta\ndata: {"type":"content_block_delta","index":%d,"delta":{"type":%s%s}}\n\n'
                          % (block, dt, tj))
        elif api == "chat":
            key = b'"reasoning_content":' if reasoning else b'"content":'
            data = _frame(chat_pre + b'"delta":{%s%s},"logprobs":null,"finish_reason":%s%s}]}\n\n' % (key, tj, fr, idj))
        else:
            data = _frame(cmpl_pre + b'"text":%s,"logprobs":null,"finish_reason":%s%s}]}\n\n' % (tj, fr, idj))
        if malformed:
            data = _frame(b'data: {"choices":[{"index":0,"text":"' + text.encode() + b'"\n\n')
        yield (t, data, kind, len(g))
    yield from _tail(api, cfg, rid, model, created, times[-1], n, p_tokens, block, want_usage)


def _output_tokens(api: str, req: dict, cfg) -> tuple[int, int]:
    """``(tokens, reasoning tokens)`` of a response: the config's count, else the request's
    ``max_tokens`` (16 without); reasoning only in chat and messages."""
    n = cfg.output_tokens or int(req.get("max_tokens") or req.get("max_completion_tokens") or 16)
    return n, (min(cfg.reasoning_tokens, n) if api != "completions" else 0)


def _due_times(cfg, n: int, t_head: int, rng: random.Random) -> list[int]:
    """Each token's due time: a TTFT sample after the head, then an ITL sample a token."""
    times = [t_head + cfg.ttft.sample_ns(rng)]
    for _ in range(1, n):
        times.append(times[-1] + cfg.itl.sample_ns(rng))
    return times


def _keepalives(cfg, t_head: int, t_first: int):
    """Keep-alive comments every ``keepalive_ms`` after the head while the first token is not due."""
    if cfg.keepalive_ms:
        step = int(cfg.keepalive_ms * 1e6)
        k = t_head + step
        while k < t_first:
            yield (k, _frame(b": keep-alive\n\n"), "ka", 0)
            k += step


def _block_change(t: int, block: int, want_block: int, reasoning: bool):
    """Messages: the content block open (if any) stopped, the next one (thinking or text) started."""
    if block >= 0:
        yield (t, _data({"type": "content_block_stop", "index": block}, "content_block_stop"), "meta", 0)
    cb = {"type": "thinking", "thinking": ""} if reasoning else {"type": "text", "text": ""}
    yield (t, _data({"type": "content_block_start", "index": want_block, "content_block": cb},
                    "content_block_start"), "meta", 0)


def _tail(api: str, cfg, rid: str, model: str, created: int, t_end: int, n: int, p_tokens: int, block: int,
          want_usage: bool):
    """The events after the last token: the usage (the config's factor and delta on the count; where
    asked for, always a message_delta in messages), then the end (``[DONE]``, ``message_stop``) unless
    the config leaves it out."""
    n_usage = round(n * cfg.usage_factor) + cfg.usage_delta
    usage = {"prompt_tokens": p_tokens, "completion_tokens": n_usage, "total_tokens": p_tokens + n_usage}
    if api == "messages":
        yield (t_end, _data({"type": "content_block_stop", "index": block}, "content_block_stop"), "meta", 0)
        md = {"type": "message_delta", "delta": {"stop_reason": "max_tokens", "stop_sequence": None}}
        if want_usage:
            md["usage"] = {"output_tokens": n_usage}
        yield (t_end, _data(md, "message_delta"), "usage", 0)
        if not cfg.missing_done:
            yield (t_end, _data({"type": "message_stop"}, "message_stop"), "done", 0)
    else:
        if want_usage:
            obj = "text_completion" if api == "completions" else "chat.completion.chunk"
            yield (t_end, _data({"id": f"x-{rid}", "object": obj, "created": created, "model": model,
                                     "choices": [], "usage": usage}), "usage", 0)
        if not cfg.missing_done:
            yield (t_end, _frame(b"data: [DONE]\n\n"), "done", 0)
