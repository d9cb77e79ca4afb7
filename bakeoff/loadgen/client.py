"""Streaming client for OpenAI-compatible servers (completions, chat) and Anthropic messages.

Timing: each SSE event carries the ``time.monotonic_ns()`` stamp of the network chunk that
completed it, taken in the socket's protocol callback (:mod:`bakeoff.loadgen.http`), not when
the consuming task resumed. The same clock is used by every process on the host, so the
synthetic server's send times (:mod:`bakeoff.loadgen.synth_server`) are directly comparable.

Each request carries its id in ``X-Bakeoff-Request-Id`` (servers ignore it; bakeoff's synthetic
server keys its records by it) and, as a UUID, in ``X-Request-Id`` (:func:`wire_request_id`), so a
server's own log of what it sent can be matched to the client's record: a server may refuse an
``X-Request-Id`` that is not a UUID (llama-cpp-python's answers HTTP 400 with an empty body).
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import os
import sys
import time
import uuid
from typing import Any, AsyncIterator, Literal
from urllib.parse import urlsplit

from bakeoff.api.errors import EngineFailure
from bakeoff.loadgen.http import Pool, TransportError
from bakeoff.loadgen.progress import Progress, ProgressWatch, timeout_failure
from bakeoff.loadgen.side_http import redirect_sentence
from bakeoff.loadgen.sse import SSEParser
from bakeoff.loadgen.stream_checks import STREAM_EVENT_SLACK, check_event_stream, end_failure, finish, over_bounds
from bakeoff.loadgen.stream_events import STOP, TOKENS, openai_events, parse_messages
from bakeoff.api.specs import GenerationRequest, TokenEvent

Api = Literal["completions", "chat", "messages"]
# run_request puts a two-item list here; stream() stores in [0] the time its request bytes were
# written (after the connection was ready), so "TTFT from send" excludes the client's own
# preparation, and in [1] the response headers that tell of a proxy or buffering (TRANSPORT_HEADERS).
TRANSPORT_HEADERS = ("via", "x-accel-buffering", "content-encoding", "content-length", "transfer-encoding",
                     "server", "x-cache", "cf-ray")
SENT_NS: contextvars.ContextVar[list | None] = contextvars.ContextVar("bakeoff_sent_ns", default=None)
_loads = json.JSONDecoder().decode  # str in: skips json.loads' per-call encoding detection
PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions", "messages": "/v1/messages"}
DEADLINE_FACTOR = 5.0  # default deadline of a request the engine computes without a byte: 5 read timeouts
# A stream's bounds, from its request (stream_bounds): a server that sends without end, a 10 MB
# line per token, or a byte a second (each byte resets the read timeout) is cut at one of them
# as ``protocol-violation``, with the figure, and the run goes on.
STREAM_BASE_BYTES = 1 << 20  # headers' worth, an error body, usage: 1 MiB
STREAM_BYTES_PER_TOKEN = 64 << 10  # a token event with 20 top logprobs is ~2 KB: 64 KiB is 30x that
STREAM_SECONDS_PER_TOKEN = 2.0  # the slowest stream bakeoff waits out: 0.5 tok/s, past the read timeouts
# and its events, at most max_tokens + STREAM_EVENT_SLACK (bakeoff.loadgen.stream_checks)


# Temperature 0 means the argmax of the model's own logits, but servers change those logits before it with
# penalties a request leaves at their defaults: llama-cpp-python's server a repeat_penalty of 1.1, vLLM the
# repetition_penalty of the model's generation_config.json, llama.cpp's DRY where its server enables it.
# A greedy request (the probes') states every such field neutral in the server's dialect; truncation
# (top_k, top_p, min_p) never moves an argmax and is left alone. sanity.greedy verifies the outcome from
# the engine's own logprobs (bakeoff/analysis/sanity.py non_greedy_steps).
NEUTRAL_OPENAI = {"frequency_penalty": 0.0, "presence_penalty": 0.0}  # OpenAI's own fields, every dialect
NEUTRAL_VLLM = {**NEUTRAL_OPENAI, "repetition_penalty": 1.0}  # vLLM, SGLang, TGI
NEUTRAL_LLAMACPP = {**NEUTRAL_OPENAI, "repeat_penalty": 1.0, "dry_multiplier": 0.0}  # llama-server, llama-cpp-python
NEUTRAL_ANY = {**NEUTRAL_VLLM, **NEUTRAL_LLAMACPP}  # a server of unknown dialect (servers ignore fields they lack)


# the fields the client sets per request: an ``extra_body`` that set them would turn streaming off,
# cap every output or change sampling behind the verdict's back (issue 36's census: 5.21, 5.22)
REQUEST_KEYS = ("model", "prompt", "messages", "max_tokens", "max_completion_tokens", "stream", "stream_options",
                "temperature", "top_p", "seed", "ignore_eos", "stop", "stop_sequences", "logprobs", "top_logprobs", "n",
                "cache_salt")

def stream_bounds(max_tokens: int, read_timeout_s: float) -> tuple[int, float]:
    """``(bytes, seconds)`` a stream of ``max_tokens`` may take: :data:`STREAM_BASE_BYTES` +
    :data:`STREAM_BYTES_PER_TOKEN` per token, and :data:`DEADLINE_FACTOR` read timeouts +
    :data:`STREAM_SECONDS_PER_TOKEN` per token."""
    n = max(1, int(max_tokens or 1))
    return STREAM_BASE_BYTES + n * STREAM_BYTES_PER_TOKEN, DEADLINE_FACTOR * read_timeout_s + n * STREAM_SECONDS_PER_TOKEN


class OpenAIClient:
    """Streams generations from one server.

    Args:
        base_url: e.g. ``http://127.0.0.1:8000`` (a trailing ``/v1`` is dropped).
        model: model name sent in each request.
        api: ``completions``, ``chat`` or ``messages`` (Anthropic).
        api_key_env: name of the environment variable holding the API key; the key itself
            is never stored in any spec or artifact.
        extra_body: extra JSON fields for every request (e.g. ``{"return_token_ids": true}``).
        greedy_body: JSON fields for every request at temperature 0 (the server's sampling options
            that change a greedy choice, sent neutral: :data:`NEUTRAL_VLLM` and the like);
            ``extra_body`` is applied after it.
        read_timeout_s: no byte within this many seconds ends the request as ``hang``; with
            ``progress``, only when the engine made none (:mod:`bakeoff.loadgen.progress`).
        progress: how to read the engine's progress (its processes' CPU time, its token
            counters); None: a timeout is a ``hang``.
        deadline_s: with ``progress``, the longest a request waits for a byte while the engine
            computes, from its send; past it the request ends ``slo-miss`` (slow, not hung).
            Default: ``DEADLINE_FACTOR`` read timeouts.
    """

    def __init__(self, base_url: str, model: str, api: Api = "completions", api_key_env: str | None = None,
                 extra_body: dict[str, Any] | None = None, read_timeout_s: float = 120.0,
                 progress: Progress | None = None, deadline_s: float | None = None,
                 greedy_body: dict[str, Any] | None = None):
        self.base_url = base_url.rstrip("/")
        if self.base_url.endswith("/v1"):
            self.base_url = self.base_url[:-3]
        self.model = model
        self.api = api
        self.api_key_env = api_key_env
        self.extra_body = dict(extra_body or {})
        self.greedy_body = dict(greedy_body or {})
        self.read_timeout_s = read_timeout_s
        # the first stream that got no byte within the read timeout (a backend that attaches to a
        # server fails later requests at once with it instead of waiting the timeout again)
        self.hung: EngineFailure | None = None
        # the first stream still sending at its time bound (a trickle: each byte resets the read
        # timeout); a backend that attaches to a server fails later requests at once with it
        self.overran: EngineFailure | None = None
        self._pools: dict[int, Pool] = {}
        self.watch = None if progress is None else ProgressWatch(progress, read_timeout_s,
                                                                 deadline_s or DEADLINE_FACTOR * read_timeout_s)

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
        key = os.environ.get(self.api_key_env) if self.api_key_env else None
        if self.api == "messages":
            headers["anthropic-version"] = "2023-06-01"
            if key:
                headers["x-api-key"] = key
        elif key:
            headers["Authorization"] = f"Bearer {key}"
        return headers

    def _pool(self) -> Pool:
        loop = asyncio.get_running_loop()
        pool = self._pools.get(id(loop))
        if pool is None:  # a connection, too, is given no longer than the read timeout
            pool = self._pools[id(loop)] = Pool(connect_timeout_s=min(30.0, self.read_timeout_s))
        return pool

    def _hang(self, what: str, nbytes: int, t_send_ns: int, patience=None) -> EngineFailure:
        """A request that got no byte within the read timeout, with how long it was open: ``hang``,
        or ``slo-miss`` when its checks saw the engine computing until the deadline."""
        return timeout_failure(what, self.base_url, nbytes, (time.monotonic_ns() - t_send_ns) / 1e9,
                               self.read_timeout_s, patience)

    async def _answers(self) -> bool:
        """Whether the server still accepts a connection (a cut stream from a server that is
        gone is a crash, not a hop's doing)."""
        u = urlsplit(self.base_url)
        try:
            _, w = await asyncio.wait_for(asyncio.open_connection(u.hostname, u.port or (443 if u.scheme == "https" else 80)), 2)
        except (OSError, asyncio.TimeoutError):
            return False
        w.close()
        return True

    async def aclose(self) -> None:
        """Close the connections of the running loop."""
        pool = self._pools.pop(id(asyncio.get_running_loop()), None)
        if pool is not None:
            await pool.aclose()

    async def get_json(self, path: str, timeout_s: float | None = None) -> tuple[int, Any]:
        """GET ``path`` (e.g. ``/v1/models``); returns ``(status, parsed JSON or text)``.

        Args:
            path: the route.
            timeout_s: read timeout in seconds; at most, and by default, ``read_timeout_s``.

        Raises:
            EngineFailure: ``hang`` when no byte came within the read timeout (its elapsed time
                in the message), ``runtime-crash`` when the server cannot be reached.
        """
        timeout_s = min(timeout_s or self.read_timeout_s, self.read_timeout_s)
        hdrs = {k: v for k, v in self._headers().items() if k != "Content-Type"}
        hdrs["Accept"] = "application/json"
        t_send = time.monotonic_ns()
        try:
            resp = await self._pool().request("GET", self.base_url + path, hdrs, timeout_s=timeout_s)
            raw = await resp.read_all(timeout_s)
            resp.release()
        except TransportError as exc:
            if exc.kind == "timeout":
                raise self._hang(f"GET {path}", exc.nbytes, t_send) from None
            raise EngineFailure("runtime-crash", f"GET {path} on {self.base_url}: {exc}") from None
        try:
            return resp.status, json.loads(raw)
        except ValueError:
            return resp.status, raw.decode("utf-8", "replace")

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
            if req.cache_salt:
                body["cache_salt"] = req.cache_salt
            if req.logprobs:
                if self.api == "chat":
                    body["logprobs"], body["top_logprobs"] = True, req.logprobs
                else:
                    body["logprobs"] = req.logprobs
        elif req.stop:
            body["stop_sequences"] = req.stop
        if not req.temperature and self.api != "messages":
            body.update(self.greedy_body)
        body.update(self.extra_body)  # never a key of REQUEST_KEYS: the openai backend's options refuse them
        return body

    def _refused(self, status: int, path: str, text: str, headers: dict[str, str], req: GenerationRequest) -> EngineFailure:
        """An HTTP error answer as a failure: 5xx ``runtime-crash``, 4xx ``config-rejected``, saying what
        the server said, or for an empty body the request headers sent (names, never values), and for a
        refused greedy request the neutral fields it carried (a strict server refusing fields it lacks)."""
        said = text.strip()[:300] or f"an empty body (request headers sent: {', '.join(headers)})"
        neutral = sorted(k for k in self.greedy_body if k not in self.extra_body)  # what body() sent of them
        if neutral and not req.temperature and status < 500 and self.api != "messages":
            said += f" [this greedy request set {', '.join(neutral)} neutral]"
        return EngineFailure("runtime-crash" if status >= 500 else "config-rejected", f"HTTP {status} from {path}: {said}",
                             {"response.txt": text})

    async def stream(self, req: GenerationRequest, on_sent=None) -> AsyncIterator[TokenEvent]:
        """Stream one request.

        Args:
            req: the generation.
            on_sent: optional callback given the ``time.monotonic_ns()`` taken just before the
                request bytes were written (after the connection was ready).

        Raises:
            EngineFailure: ``runtime-crash`` (cannot connect, HTTP 5xx, error event),
                ``config-rejected`` (HTTP 4xx), ``hang`` (read timeout; with ``progress``, a
                window without progress), ``slo-miss`` (the engine computed without a byte
                until the deadline),
                ``transport-distortion`` (stream cut, ended without ``[DONE]`` /
                ``message_stop``, malformed JSON event: raised after the rest of the stream
                was read, so every event before and after it was yielded).
        """
        path = PATHS[self.api]
        headers = self._headers()
        headers["X-Request-Id"] = wire_request_id(req.request_id)
        headers["X-Bakeoff-Request-Id"] = req.request_id
        payload = json.dumps(self.body(req), separators=(",", ":")).encode()
        t_send = time.monotonic_ns()
        holder = SENT_NS.get()

        def sent(t: int) -> None:
            if holder is not None:
                holder[0] = t
            if on_sent is not None:
                on_sent(t)

        resp = None
        done = False
        malformed: list[str] = []
        watch = self.watch
        patience = watch.patience(t_send / 1e9) if watch is not None else None
        try:
            resp = await self._pool().request("POST", self.base_url + path, headers, payload,
                                              self.read_timeout_s, sent, patience)
            await self._check_answer(resp, path, headers, req, holder)
            feed = SSEParser().feed  # comments (": keep-alive") and events without data never come out
            tokens = TOKENS[self.api]  # one call an event: stream_events reads the common chunk inline
            max_bytes, max_s = stream_bounds(req.max_tokens, self.read_timeout_s)
            end_ns = t_send + int(max_s * 1e9)
            max_events = max(1, int(req.max_tokens or 1)) + STREAM_EVENT_SLACK
            n_events = 0
            async for t, piece in resp.chunks(self.read_timeout_s):
                if watch is not None:
                    watch.touch()  # a float comparison, a sample in the background every quarter timeout
                if resp.nbytes > max_bytes or t > end_ns:
                    raise self._cut(resp, path, t, t_send, end_ns, max_bytes, max_s, req.max_tokens)
                for t, data, name, _ in feed(t, piece):
                    n_events += 1
                    if n_events > max_events:
                        resp.release()
                        raise over_bounds(path, resp.nbytes, (t - t_send) / 1e9, max_bytes, max_s, req.max_tokens,
                                           n_events)
                    if data == "[DONE]":  # the end: nothing after it is read, in this read or a later one
                        done = True
                        break
                    try:
                        obj = _loads(data)
                    except ValueError:
                        malformed.append(data[:200])
                        continue
                    if not isinstance(obj, dict):  # JSON, but no event of any API: `null`, `[1, 2]`, `5`
                        malformed.append(data[:200])
                        continue
                    try:  # an object of an event's shape gone wrong (a choice that is a string) is malformed too
                        events = tuple(tokens(obj, name, t, resp))
                    except (AttributeError, TypeError, KeyError, IndexError):
                        malformed.append(data[:200])
                        continue
                    for ev in events:
                        if ev is STOP:  # message_stop: the end of a Messages stream
                            done = True
                        else:
                            yield ev
                    if done:
                        break
                if done:
                    break
        except TransportError as exc:
            raise await self._transport_failure(exc, resp, path, t_send, patience) from None
        finally:
            if resp is not None:
                _end_stream(resp, done, self.read_timeout_s)
        failure = end_failure(malformed, done, resp.nbytes, (time.monotonic_ns() - t_send) / 1e9)
        if failure is not None:
            raise failure

    async def _check_answer(self, resp, path: str, headers: dict[str, str], req: GenerationRequest, holder) -> None:
        """The answer's head before its events: the transport headers kept in ``holder``; a redirect
        (``config-rejected``), an HTTP error (:meth:`_refused`) or no event stream
        (:func:`~bakeoff.loadgen.stream_checks.check_event_stream`) raised."""
        if holder is not None and len(holder) > 1:
            holder[1] = {k: v for k, v in resp.headers.items() if k in TRANSPORT_HEADERS}
        if 300 <= resp.status < 400:  # the load generator follows none: named, not parsed as a stream
            raise EngineFailure("config-rejected", f"{redirect_sentence(resp.status, resp.headers.get('location'))} "
                                                   f"from {path}")
        if resp.status >= 400:
            text = (await resp.read_all(self.read_timeout_s)).decode("utf-8", "replace")[:2000]
            raise self._refused(resp.status, path, text, headers, req)
        await check_event_stream(resp, path, self.read_timeout_s)

    def _cut(self, resp, path: str, t: int, t_send: int, end_ns: int, max_bytes: int, max_s: float,
             max_tokens: int) -> EngineFailure:
        """A stream past its byte or time bound, closed (nothing more is read); one past time kept as ``overran``."""
        resp.release()
        over = over_bounds(path, resp.nbytes, (t - t_send) / 1e9, max_bytes, max_s, max_tokens)
        if t > end_ns:
            self.overran = self.overran or over
        return over

    async def _transport_failure(self, exc: TransportError, resp, path: str, t_send: int, patience) -> EngineFailure:
        """A stream's transport error as its failure: a read timeout ``hang`` (kept as ``hung``) or ``slo-miss``, no
        connection or a cut from a server gone ``runtime-crash``, malformed HTTP ``protocol-violation``, else
        ``transport-distortion``."""
        elapsed = (time.monotonic_ns() - t_send) / 1e9
        nbytes = resp.nbytes if resp is not None else exc.nbytes
        if exc.kind == "timeout":
            hang = self._hang(f"POST {path}", nbytes, t_send, patience)
            if hang.failure_class == "hang":  # slow is not hung: later requests still go
                self.hung = self.hung or hang
            return hang
        if exc.kind == "connect":
            return EngineFailure("runtime-crash", str(exc))
        if exc.kind == "cut" and not await self._answers():
            return EngineFailure("runtime-crash", f"the server went away: stream cut after {nbytes} bytes and "
                                 f"{elapsed:.3f} s, and {self.base_url} refuses connections now")
        if exc.kind == "malformed":
            return EngineFailure("protocol-violation", f"POST {path}: {exc}")
        if exc.kind == "undecodable":
            return EngineFailure("transport-distortion", f"{exc} (a hop compressed the stream; measure without it)")
        return EngineFailure("transport-distortion", f"stream cut after {nbytes} bytes and {elapsed:.3f} s: {exc}",
                             {"cut.json": json.dumps({"bytes": nbytes, "elapsed_s": elapsed})})

    def _parse(self, obj: dict, event_name: str | None, t: int):
        """The token events of one event's JSON in this client's API (:mod:`bakeoff.loadgen.stream_events`)."""
        if self.api == "messages":
            yield from parse_messages(obj, event_name, t)
            return
        yield from openai_events(obj, t, self.api == "chat")


def _end_stream(resp, done: bool, timeout_s: float) -> None:
    """The end of a stream's reading: a consumer that stopped reading mid-stream (``GeneratorExit`` in
    flight: ``aclose()``, a ``break``) cancels the request as a client that goes away cancels it, the
    connection closed, not drained; otherwise :func:`finish`."""
    if not done and isinstance(sys.exc_info()[1], GeneratorExit):
        resp.release()
        return
    finish(resp, timeout_s)


REQUEST_ID_NAMESPACE = uuid.UUID("6f1c1a52-3b0e-5d2e-9a57-6b616b656f66")


def wire_request_id(request_id: str) -> str:
    """``X-Request-Id`` for a request: its id where that is a UUID already, else the UUID5 of it in
    bakeoff's namespace (the same id gives the same UUID on every run)."""
    try:
        return str(uuid.UUID(request_id))
    except ValueError:
        return str(uuid.uuid5(REQUEST_ID_NAMESPACE, request_id))


def _messages_as_prompt(messages: list[dict[str, str]] | None) -> str:
    return "\n".join(m.get("content", "") for m in (messages or []))
