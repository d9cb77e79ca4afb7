"""OpenAI-compatible streaming server around an in-process engine (the worker mode).

A worker backend (transformers, ORT GenAI, TRT-LLM's LLM API) runs its engine's Python API
in a child process; this module serves it over ``/v1/completions`` (SSE) so that every
backend is measured by the same client. Runs inside the engine's environment: it needs only
``aiohttp`` and the standard library.

Engine adapters implement :class:`WorkerEngine`. ``serve()`` loads the engine, then writes
``{"port": ..., "info": {...}}`` to the ready file, which tells the parent it is up.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import math
import os
import sys
import threading
import time
import traceback
import uuid
from typing import Any, AsyncIterator, Protocol


class WorkerEngine(Protocol):
    """What a worker engine adapter provides.

    ``generate`` yields ``(token_ids, text_delta, finish_reason)`` tuples; ``finish_reason``
    is None until the last one. When the request body asks for ``logprobs`` (top k) and the
    engine can give them, a tuple may carry a fourth item: per token of ``token_ids``,
    ``(logprob, [(id, logprob), ...top k])``; they are sent in the completions ``logprobs``
    shape with tokens named ``"token_id:N"`` (vLLM's ``return_tokens_as_token_ids``). ``prompt_tokens`` counts the prompt's tokens; an engine that
    counts them itself while generating (in another process) stores the count in
    ``body[PROMPT_TOKENS_KEY]`` instead, which wins. An engine may also have ``healthy()``,
    returning why it cannot serve (``/health`` then answers 503 with that reason) or None,
    and ``attach(loop)``, called once the server's event loop runs, and ``tokenize(prompt)``,
    returning (or awaiting to) the ids generation feeds the model for that prompt, from the
    engine's own tokenizer (served on ``/tokenize``; :meth:`backends.base.Backend.tokenize`).
    """

    def info(self) -> dict[str, Any]: ...

    def prompt_tokens(self, prompt: str) -> int: ...

    def generate(self, body: dict[str, Any]) -> AsyncIterator[tuple[list[int], str, str | None]]: ...

    def metrics(self) -> dict[str, float]: ...


PROMPT_TOKENS_KEY = "_bakeoff_prompt_tokens"


class TokenChannel:
    """Items from an engine thread to the event loop, waking the loop only when it waits.

    ``loop.call_soon_threadsafe`` per token writes the loop's self-pipe and takes a lock for
    every token; on a tiny model decoding a token every ~0.3 ms that is a measurable share of
    the engine's time (``benchmarks/bench_ort_genai.py``: worker vs bare ``og.Generator``).
    Here the engine thread appends under a lock and wakes the loop only when the consumer is
    parked; items that pile up while the loop writes an SSE event are taken together.

    Args:
        loop: the consumer's event loop.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.items: collections.deque = collections.deque()
        self.lock = threading.Lock()
        self.waiter: asyncio.Future | None = None

    def put(self, item: Any) -> None:
        """Append from any thread."""
        with self.lock:
            self.items.append(item)
            w, self.waiter = self.waiter, None
        if w is not None:
            self.loop.call_soon_threadsafe(_set_done, w)

    async def get_batch(self) -> list[Any]:
        """Every item queued so far (at least one), in order; waits when there is none."""
        while True:
            with self.lock:
                if self.items:
                    out = list(self.items)
                    self.items.clear()
                    return out
                fut = self.waiter = self.loop.create_future()
            await fut


def _set_done(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


def _prompt_problem(body: dict, chat: bool) -> str | None:
    """What is wrong with the prompt: one string ``prompt``, or for chat ``messages`` a list of objects."""
    if chat:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not all(isinstance(m, dict) for m in msgs):
            return "messages must be a list of objects"
        return None
    if isinstance(body.get("prompt"), list):
        return "only one string prompt per request"
    if not isinstance(body.get("prompt"), str):
        return "prompt must be a string"
    return None


def _max_tokens_problem(body: dict) -> str | None:
    """What is wrong with ``max_tokens``: a positive integer (a boolean is none) where given."""
    mt = body.get("max_tokens")
    if mt is not None and (isinstance(mt, bool) or not isinstance(mt, int) or mt < 1):
        return f"max_tokens must be a positive integer, not {mt!r}"
    return None


def _sampling_problem(body: dict) -> str | None:
    """What is wrong with ``temperature`` / ``top_p``: finite numbers, ``temperature >= 0`` and
    ``0 < top_p <= 1``, where given."""
    for key, lo_ok in (("temperature", lambda v: v >= 0), ("top_p", lambda v: 0 < v <= 1)):
        v = body.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
                              or not lo_ok(v)):
            return f"{key} out of range: {v!r}"
    return None


def _seed_and_logprobs_problem(body: dict) -> str | None:
    """What is wrong with ``seed`` (an integer) or ``logprobs`` (an integer from 0 to 20, or a boolean)."""
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        return f"seed must be an integer, not {seed!r}"
    lp = body.get("logprobs")  # completions: how many top logprobs; chat: a boolean (top_logprobs says how many)
    if lp is not None and not isinstance(lp, bool) and (not isinstance(lp, int) or not 0 <= lp <= 20):
        return f"logprobs must be an integer from 0 to 20 or a boolean, not {lp!r}"
    return None


def check_body(body: Any, chat: bool) -> str | None:
    """What is wrong with a completions request body, or None (OpenAI's field rules).

    Only what this server reads: a string ``prompt`` (or ``messages`` for chat),
    ``max_tokens`` a positive integer, ``temperature`` / ``top_p`` finite numbers
    (``temperature >= 0``, ``0 < top_p <= 1``), ``seed`` an integer, ``logprobs`` an integer from 0
    to 20 (OpenAI's completions bound) or a boolean.
    """
    if not isinstance(body, dict):
        return "the body must be a JSON object"
    return (_prompt_problem(body, chat) or _max_tokens_problem(body) or _sampling_problem(body)
            or _seed_and_logprobs_problem(body))


def chat_prompt(messages: list[dict[str, Any]]) -> str:
    """The prompt a worker generates from for chat ``messages``: their contents, one per line
    (workers apply no chat template; ``/tokenize`` reports the same rendering)."""
    return "\n".join(str(m.get("content", "")) for m in messages)


def logprobs_object(ids: list[int], lps: list) -> dict[str, Any]:
    """OpenAI completions ``logprobs`` for ``ids``: ``lps[i] = (logprob, [(id, logprob), ...])``."""
    return {"tokens": [f"token_id:{i}" for i in ids],
            "token_logprobs": [round(float(lp), 6) for lp, _ in lps],
            "top_logprobs": [{f"token_id:{t}": round(float(v), 6) for t, v in top} for _, top in lps]}


def _engine_error(exc: BaseException) -> dict[str, Any]:
    """The OpenAI-style error object for an engine failure (an SSE event or a JSON 500 body)."""
    return {"error": {"message": f"{type(exc).__name__}: {exc}", "type": "engine_error"}}


def _bad_request(message: str):
    from aiohttp import web

    return web.json_response({"error": {"message": message, "type": "invalid_request_error"}}, status=400)


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def build_app(engine: WorkerEngine, served_model: str):
    """The aiohttp application serving ``engine``."""
    from aiohttp import web

    counters = {"requests_total": 0, "generation_tokens_total": 0, "prompt_tokens_total": 0, "errors_total": 0}

    async def health(_request):
        why = engine.healthy() if hasattr(engine, "healthy") else None
        if why:
            return web.json_response({"status": "error", "reason": why}, status=503)
        return web.json_response({"status": "ok"})

    async def models(_request):
        return web.json_response({"object": "list", "data": [{"id": served_model, "object": "model"}]})

    async def metrics(_request):
        lines = []
        for k, v in {**counters, **engine.metrics()}.items():
            lines.append(f"bakeoff_worker:{k} {v}")
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    async def completions(request):
        try:
            body = await request.json()
        except ValueError as exc:
            return _bad_request(f"the body is not JSON: {exc}")
        chat = request.path.endswith("/chat/completions")
        problem = check_body(body, chat)
        if problem:
            return _bad_request(problem)
        if chat:
            body["prompt"] = chat_prompt(body["messages"])
        counters["requests_total"] += 1
        rid = f"cmpl-{uuid.uuid4().hex[:16]}"
        body.pop(PROMPT_TOKENS_KEY, None)

        def count_prompt() -> int:
            n = body.get(PROMPT_TOKENS_KEY)
            n = engine.prompt_tokens(body.get("prompt", "")) if n is None else n
            counters["prompt_tokens_total"] += n
            return n

        obj_name = "chat.completion.chunk" if chat else "text_completion"
        n_out = 0
        texts: list[str] = []
        if not body.get("stream"):
            finish = None
            gen = engine.generate(body)
            try:
                async for item in gen:
                    ids, text, fr = item[0], item[1], item[2]
                    n_out += len(ids)
                    texts.append(text)
                    finish = fr or finish
                    if request.transport is None or request.transport.is_closing():
                        return web.Response(status=499)  # the client left: closing gen cancels it
            except Exception as exc:  # noqa: BLE001 - the engine failed: say why, keep serving
                counters["errors_total"] += 1
                traceback.print_exc()
                return web.json_response(_engine_error(exc), status=500)
            finally:
                await gen.aclose()
            counters["generation_tokens_total"] += n_out
            n_prompt = count_prompt()
            usage = {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}
            choice = {"index": 0, "finish_reason": finish}
            if chat:
                choice["message"] = {"role": "assistant", "content": "".join(texts)}
            else:
                choice["text"] = "".join(texts)
            return web.json_response({"id": rid, "object": obj_name, "model": served_model,
                                      "choices": [choice], "usage": usage})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        gen = engine.generate(body)
        try:
            async for item in gen:
                ids, text, fr = item[0], item[1], item[2]
                n_out += len(ids)
                choice: dict[str, Any] = {"index": 0, "token_ids": ids, "finish_reason": fr}
                if len(item) > 3 and item[3]:
                    choice["logprobs"] = logprobs_object(ids, item[3])
                if chat:
                    choice["delta"] = {"content": text}
                else:
                    choice["text"] = text
                await resp.write(_sse({"id": rid, "object": obj_name, "model": served_model, "choices": [choice]}))
            counters["generation_tokens_total"] += n_out
            n_prompt = count_prompt()
            if (body.get("stream_options") or {}).get("include_usage"):
                usage = {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}
                await resp.write(_sse({"id": rid, "object": obj_name, "model": served_model, "choices": [], "usage": usage}))
            await resp.write(b"data: [DONE]\n\n")
        except ConnectionResetError:  # the client went away (aiohttp's ClientConnectionResetError): its
            return resp               # generation stops as the generator closes; no traceback in the log
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the engine failed mid-stream: tell the client, keep serving
            counters["errors_total"] += 1
            traceback.print_exc()
            await resp.write(_sse(_engine_error(exc)))
        finally:
            await gen.aclose()  # at once: a dropped stream's generation is cancelled now, not at collection
        return resp

    async def score(request):
        """Teacher-forced log-probabilities (engines with ``score``: the transformers reference)."""
        if not hasattr(engine, "score"):
            return web.json_response({"error": {"message": "this engine does not score", "type": "not_found"}}, status=404)
        try:
            body = await request.json()
        except ValueError as exc:
            return _bad_request(f"the body is not JSON: {exc}")
        if not isinstance(body, dict):
            return _bad_request("the body must be a JSON object")
        try:
            if asyncio.iscoroutinefunction(engine.score):  # an engine in another process
                return web.json_response(await engine.score(body))
            return web.json_response(await asyncio.to_thread(engine.score, body))
        except Exception as exc:  # noqa: BLE001 - the engine failed: say why, keep serving
            traceback.print_exc()
            return web.json_response(_engine_error(exc), status=500)

    async def tokenize(request):
        """The engine's own ids for a prompt, in vLLM's ``/tokenize`` shape (``prompt``, or
        ``messages`` rendered as the chat route renders them); ``add_special_tokens`` only at
        vLLM's default for the form: the ids are those generation feeds the model."""
        if not hasattr(engine, "tokenize"):
            return web.json_response({"error": {"message": "this engine does not tokenize", "type": "not_found"}},
                                     status=404)
        try:
            body = await request.json()
        except ValueError as exc:
            return _bad_request(f"the body is not JSON: {exc}")
        chat = isinstance(body, dict) and "messages" in body
        problem = check_body({k: v for k, v in body.items() if k in ("prompt", "messages")}, chat) \
            if isinstance(body, dict) else "the body must be a JSON object"
        if problem:
            return _bad_request(problem)
        if body.get("add_special_tokens", not chat) is not (not chat):
            return _bad_request(f"add_special_tokens must be {str(not chat).lower()} here: this route gives the ids "
                                "generation feeds the model")
        prompt = chat_prompt(body["messages"]) if chat else body["prompt"]
        try:
            ids = engine.tokenize(prompt)
            ids = [int(t) for t in (await ids if asyncio.iscoroutine(ids) else ids)]
        except Exception as exc:  # noqa: BLE001 - the engine failed: say why, keep serving
            traceback.print_exc()
            return web.json_response(_engine_error(exc), status=500)
        return web.json_response({"tokens": ids, "count": len(ids), "max_model_len": engine.info().get("max_model_len")})

    app = web.Application(client_max_size=64 * 2**20)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/v1/score", score)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", completions)
    return app


def serve(make_engine, argv: list[str] | None = None) -> None:
    """Entry point of a worker process.

    Args:
        make_engine: ``callable(args) -> WorkerEngine``; loads the model (may be slow).
        argv: ``--model M --port P --ready-file F [--served-model NAME] [--options JSON]``.
    """
    from aiohttp import web

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--ready-file", required=True)
    ap.add_argument("--served-model", default=None)
    ap.add_argument("--options", default="{}")
    args = ap.parse_args(argv)
    args.options = json.loads(args.options)
    t0 = time.monotonic()
    engine = make_engine(args)
    info = dict(engine.info())
    info["load_s"] = round(time.monotonic() - t0, 3)
    app = build_app(engine, args.served_model or args.model)

    async def main() -> None:
        if hasattr(engine, "attach"):  # an engine in another process: watch it from now on
            engine.attach(asyncio.get_running_loop())
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", args.port)
        await site.start()
        tmp = args.ready_file + ".tmp"
        with open(tmp, "w") as fh:
            json.dump({"port": args.port, "pid": os.getpid(), "info": info}, fh)
        os.replace(tmp, args.ready_file)
        print(f"worker ready on port {args.port}", flush=True)
        await asyncio.Event().wait()

    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        sys.exit(0)
