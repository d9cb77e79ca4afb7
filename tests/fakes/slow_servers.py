"""A FAKE engine that is slow, or stops, before its first byte (``tests/test_slow_not_hung.py``).

An OpenAI-compatible completions server (aiohttp), launched as bakeoff launches engines (its own
process group, ``ready_mode = "health"``); not a backend of bakeoff. What a request does is
written in its prompt, so one server plays every case:

- ``burn S``: sends the response head, then burns CPU for S seconds (a Python loop in a thread:
  a prefill that takes long), then streams ``max_tokens`` tokens, usage and ``[DONE]``;
- ``burn-head S``: burns S seconds on the event loop before the response head (a server that
  answers nothing until its engine is done);
- ``sleep S``: sends the head and sleeps S seconds without CPU (a wedged engine), then answers;
- ``stall S``: burns 0.5 s, streams two tokens, then sleeps S seconds (wedged mid-stream);
- anything else: answers at once.

``GET /metrics`` shows vLLM's counters: ``vllm:iteration_tokens_total_count`` grows by one every
50 ms of burning (engine steps), ``vllm:prompt_tokens_total`` / ``vllm:generation_tokens_total``
when a request ends; none grows while a request sleeps. ``--no-metrics`` serves a 404 instead.

Run as ``python -m tests.fakes.slow_servers --port P [--no-metrics]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time


def _sse(obj) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def burn(seconds: float, counters: dict) -> None:
    """Burn one core for ``seconds``, one engine step counted per 50 ms."""
    end = time.monotonic() + seconds
    step = time.monotonic() + 0.05
    x = 0
    while (now := time.monotonic()) < end:
        x += 1
        if now >= step:
            counters["steps"] += 1
            step = now + 0.05


def slow_app(metrics: bool = True):
    """The FAKE server (module docstring) as an aiohttp application."""
    from aiohttp import web

    counters = {"steps": 0, "prompt": 0, "generation": 0}

    async def health(_):
        return web.json_response({"status": "ok"})

    async def models(_):
        return web.json_response({"object": "list", "data": [{"id": "slow-double", "object": "model"}]})

    async def prometheus(_):
        if not metrics:
            return web.Response(status=404, text="not found")
        text = (f"# TYPE vllm:prompt_tokens counter\nvllm:prompt_tokens_total{{model_name=\"slow-double\"}} {counters['prompt']}\n"
                f"# TYPE vllm:generation_tokens counter\nvllm:generation_tokens_total{{model_name=\"slow-double\"}} "
                f"{counters['generation']}\n# TYPE vllm:iteration_tokens_total histogram\n"
                f"vllm:iteration_tokens_total_count{{model_name=\"slow-double\"}} {counters['steps']}\n"
                f"vllm:iteration_tokens_total_sum{{model_name=\"slow-double\"}} {counters['steps']}\n")
        return web.Response(text=text, content_type="text/plain")

    async def completions(request):
        body = await request.json()
        words = str(body.get("prompt") or "").split()
        what, seconds = (words[0], float(words[1])) if len(words) == 2 and words[0] in ("burn", "burn-head", "sleep", "stall") \
            else ("now", 0.0)
        if what == "burn-head":
            burn(seconds, counters)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if what == "burn":
            await asyncio.to_thread(burn, seconds, counters)
        elif what == "sleep":
            await asyncio.sleep(seconds)
        elif what == "stall":
            await asyncio.to_thread(burn, 0.5, counters)
            for k in range(2):
                await resp.write(_sse({"choices": [{"index": 0, "text": f" s{k}", "token_ids": [k], "finish_reason": None}]}))
            await asyncio.sleep(seconds)
        n = int(body.get("max_tokens") or 4)
        for k in range(n):
            await resp.write(_sse({"choices": [{"index": 0, "text": f" t{k}", "token_ids": [k],
                                                "finish_reason": "length" if k == n - 1 else None}]}))
        counters["prompt"] += len(words)
        counters["generation"] += n
        await resp.write(_sse({"choices": [], "usage": {"prompt_tokens": len(words), "completion_tokens": n,
                                                        "total_tokens": len(words) + n}}))
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", prometheus)
    app.router.add_post("/v1/completions", completions)
    return app


def main(argv: list[str] | None = None) -> None:
    from aiohttp import web

    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--no-metrics", action="store_true")
    args = ap.parse_args(argv)
    web.run_app(slow_app(not args.no_metrics), host="127.0.0.1", port=args.port, access_log=None, print=None,
                shutdown_timeout=0.5)  # a sleeping handler does not hold the stop


if __name__ == "__main__":
    main()
