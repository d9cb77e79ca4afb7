"""Streaming client for OpenAI-compatible servers (completions, chat) and Anthropic messages.

Per-event timestamps come from ``time.monotonic_ns()`` taken when the line holding the event
has been read off the socket; the same clock is used by every process on the host.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from typing import Any, AsyncIterator, Literal

import aiohttp

from bakeoff.errors import EngineFailure
from bakeoff.specs import GenerationRequest, TokenEvent, Usage

Api = Literal["completions", "chat", "messages"]
PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions", "messages": "/v1/messages"}


class OpenAIClient:
    """Streams generations from one server.

    Args:
        base_url: e.g. ``http://127.0.0.1:8000`` (no trailing ``/v1``).
        model: model name sent in each request.
        api: ``completions``, ``chat`` or ``messages`` (Anthropic).
        api_key_env: name of the environment variable holding the API key; the key itself
            is never stored in any spec or artifact.
        extra_body: extra JSON fields for every request (e.g. ``{"return_token_ids": true}``).
        read_timeout_s: no byte within this many seconds ends the request as ``hang``.
    """

    def __init__(self, base_url: str, model: str, api: Api = "completions", api_key_env: str | None = None,
                 extra_body: dict[str, Any] | None = None, read_timeout_s: float = 120.0):
        self.base_url = base_url.rstrip("/")
        if self.base_url.endswith("/v1"):
            self.base_url = self.base_url[:-3]
        self.model = model
        self.api = api
        self.api_key_env = api_key_env
        self.extra_body = dict(extra_body or {})
        self.read_timeout_s = read_timeout_s
        self._sessions: dict[int, aiohttp.ClientSession] = {}

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        key = os.environ.get(self.api_key_env) if self.api_key_env else None
        if key:
            if self.api == "messages":
                headers["x-api-key"] = key
                headers["anthropic-version"] = "2023-06-01"
            else:
                headers["Authorization"] = f"Bearer {key}"
        elif self.api == "messages":
            headers["anthropic-version"] = "2023-06-01"
        return headers

    def _session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        sess = self._sessions.get(id(loop))
        if sess is None or sess.closed:
            connector = aiohttp.TCPConnector(limit=0, force_close=False)
            timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=self.read_timeout_s)
            sess = aiohttp.ClientSession(connector=connector, timeout=timeout, read_bufsize=2**20)
            self._sessions[id(loop)] = sess
        return sess

    async def aclose(self) -> None:
        """Close the HTTP session of the running loop."""
        loop = asyncio.get_running_loop()
        sess = self._sessions.pop(id(loop), None)
        if sess is not None:
            await sess.close()

    def body(self, req: GenerationRequest) -> dict[str, Any]:
        """The JSON body for ``req`` in this client's API."""
        body: dict[str, Any] = {"model": self.model, "max_tokens": req.max_tokens, "stream": True,
                                "temperature": req.temperature, "top_p": req.top_p}
        if self.api == "completions":
            body["prompt"] = req.prompt if req.prompt is not None else _messages_as_prompt(req.messages)
        else:
            body["messages"] = req.messages or [{"role": "user", "content": req.prompt or ""}]
        if self.api != "messages":
            body["stream_options"] = {"include_usage": True}
            if req.seed is not None:
                body["seed"] = req.seed
            if req.ignore_eos:
                body["ignore_eos"] = True
            if req.stop:
                body["stop"] = req.stop
        elif req.stop:
            body["stop_sequences"] = req.stop
        body.update(self.extra_body)
        return body

    async def stream(self, req: GenerationRequest) -> AsyncIterator[TokenEvent]:
        """Stream one request.

        Raises:
            EngineFailure: ``runtime-crash`` (connection refused/reset, HTTP 5xx),
                ``config-rejected`` (HTTP 4xx), ``hang`` (read timeout),
                ``transport-distortion`` (stream ended without ``[DONE]`` / ``message_stop``).
        """
        url = self.base_url + PATHS[self.api]
        sess = self._session()
        done = False
        nbytes = 0
        t_send = time.monotonic_ns()
        try:
            async with sess.post(url, json=self.body(req), headers=self._headers()) as resp:
                if resp.status >= 400:
                    text = (await resp.text())[:2000]
                    cls = "runtime-crash" if resp.status >= 500 else "config-rejected"
                    raise EngineFailure(cls, f"HTTP {resp.status} from {PATHS[self.api]}: {text.strip()[:300]}",
                                        {"response.txt": text})
                event_name = None
                async for raw in resp.content:
                    t = time.monotonic_ns()
                    nbytes += len(raw)
                    line = raw.decode("utf-8", "replace").strip()
                    if not line or line.startswith(":"):
                        continue
                    if line.startswith("event:"):
                        event_name = line[6:].strip()
                        continue
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        done = True
                        break
                    try:
                        obj = json.loads(data)
                    except json.JSONDecodeError:
                        raise EngineFailure("transport-distortion", f"malformed JSON in SSE event after {nbytes} bytes",
                                            {"event.txt": data[:2000]}) from None
                    for ev in self._parse(obj, event_name, t):
                        if ev is _STOP:
                            done = True
                            break
                        yield ev
                    if done:
                        break
        except asyncio.TimeoutError:
            raise EngineFailure("hang", f"no bytes for {self.read_timeout_s:.0f} s after {nbytes} bytes") from None
        except aiohttp.ClientConnectorError as exc:
            raise EngineFailure("runtime-crash", f"cannot connect to {self.base_url}: {exc}") from None
        except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
            elapsed = (time.monotonic_ns() - t_send) / 1e9
            raise EngineFailure("transport-distortion",
                                f"stream cut after {nbytes} bytes and {elapsed:.2f} s: {type(exc).__name__}: {exc}") from None
        if not done:
            elapsed = (time.monotonic_ns() - t_send) / 1e9
            raise EngineFailure("transport-distortion",
                                f"stream ended without [DONE] after {nbytes} bytes and {elapsed:.2f} s")

    def _parse(self, obj: dict, event_name: str | None, t: int):
        if self.api == "messages":
            yield from _parse_messages(obj, event_name, t)
            return
        usage = obj.get("usage")
        for ch in obj.get("choices") or []:
            if self.api == "chat":
                delta = ch.get("delta") or {}
                reasoning = delta.get("reasoning_content") or delta.get("reasoning")
                if reasoning:
                    yield TokenEvent(t_ns=t, text=reasoning, kind="reasoning", token_ids=ch.get("token_ids"))
                text = delta.get("content") or ""
            else:
                text = ch.get("text") or ""
            ids = ch.get("token_ids")
            if text or ids or ch.get("finish_reason"):
                yield TokenEvent(t_ns=t, text=text, token_ids=ids, finish_reason=ch.get("finish_reason"))
        if usage:
            yield TokenEvent(t_ns=t, usage=Usage(usage.get("prompt_tokens"), usage.get("completion_tokens")))


_STOP = object()


def _parse_messages(obj: dict, event_name: str | None, t: int):
    kind = obj.get("type") or event_name
    if kind == "content_block_delta":
        delta = obj.get("delta") or {}
        if delta.get("type") == "thinking_delta":
            yield TokenEvent(t_ns=t, text=delta.get("thinking", ""), kind="reasoning")
        elif delta.get("type") == "text_delta":
            yield TokenEvent(t_ns=t, text=delta.get("text", ""))
    elif kind == "message_start":
        u = (obj.get("message") or {}).get("usage") or {}
        if u.get("input_tokens") is not None:
            yield TokenEvent(t_ns=t, usage=Usage(u.get("input_tokens"), None))
    elif kind == "message_delta":
        u = obj.get("usage") or {}
        fr = (obj.get("delta") or {}).get("stop_reason")
        yield TokenEvent(t_ns=t, finish_reason=fr, usage=Usage(u.get("input_tokens"), u.get("output_tokens")))
    elif kind == "message_stop":
        yield _STOP
    elif kind == "error":
        err = obj.get("error") or {}
        raise EngineFailure("runtime-crash", f"server error event: {err.get('type')}: {err.get('message')}")


def _messages_as_prompt(messages: list[dict[str, str]] | None) -> str:
    return "\n".join(m.get("content", "") for m in (messages or []))
