"""Continuous batching for the transformers engine process (``--backend-opt batching=continuous``).

transformers (5.x) ships a continuous batching engine: ``model.init_continuous_batching()``
returns a ``ContinuousBatchingManager`` (``transformers.generation.continuous_batching``) whose
background thread schedules requests into a paged KV cache; ``add_request(input_ids,
request_id, max_new_tokens, streaming=True, eos_token_id=...)`` queues one, and
``register_result_handler(request_id, callback)`` delivers its outputs on the caller's event
loop (``generated_tokens`` is cumulative). Seen in transformers 5.17.0 and 5.19.0. The engine
process (:mod:`backends.transformers.engine`) runs that loop on its main thread, reading the
worker's commands on it too, and sends each request's tokens as frames.

The manager serves greedy requests without logprobs (its generation config has
``do_sample=False``, its outputs carry no scores). Greedy requests that ask for logprobs (the
probes) run as static batches of the like requests waiting (:mod:`backends.transformers.static`:
each row's tokens and logprobs as ``generate`` alone gives them), a sampled one (``temperature >
0``) through ``generate`` alone, and ``/v1/score`` as a forward pass, each with the manager paused
(``ContinuousBatchingManager.pause()``: its loop parks between steps, keeping its cache and its
requests) and the model's own attention implementation: the reference's path, token for token
(seen on CPU with transformers 5.19.0). When the manager is missing or its
warm-up request fails, :func:`start_batcher` returns the reason and the worker serves one request
at a time.
"""

from __future__ import annotations

import asyncio
import collections
import time
import uuid
from typing import Any

from backends._hosting.engine_frames import Out, answer_tokenize
from backends.transformers.engine import answer_call
from backends.transformers.static import batch_key, serve_static

WARMUP_TIMEOUT_S = 300.0


class ContinuousBatcher:
    """Streams requests through a started ContinuousBatchingManager.

    Args:
        engine: the worker's :class:`TransformersEngine` (model, tokenizer).
        manager: a started manager.
    """

    def __init__(self, engine, manager, original_attn: str | None = None, lone_wait_s: float = 0.0):
        self.engine = engine
        self.manager = manager
        self.original_attn = original_attn  # the model's own attention implementation (generate's)
        self.lone_wait_s = lone_wait_s  # 0: every greedy request joins the batch
        self.live: dict[str, list] = {}  # request key -> [Out, max_new_tokens, tokens sent]
        self.held: list = []  # gen commands that found the engine idle, waiting for company
        self.hold_timer = None
        self.outside = self.lone = 0  # requests served outside the manager: logprobs / sampled; and lone ones
        self.batched = 0  # requests the manager served

    def info(self) -> dict[str, Any]:
        """``batching``, ``attn_implementation`` and the paged cache's size in tokens when known."""
        out: dict[str, Any] = {"batching": "continuous",
                               "attn_implementation": getattr(self.engine.model.config, "_attn_implementation", None),
                               "paused_path": "greedy requests with logprobs as static batches; requests with "
                                              "temperature > 0, scoring, and"
                                              + (f" a request that found the engine idle and no other within "
                                                 f"{self.lone_wait_s * 1000:g} ms," if self.lone_wait_s else "")
                                              + " through generate / a forward pass; all with the manager paused"}
        cache = getattr(getattr(self.manager, "batch_processor", None), "cache", None)
        pages = getattr(cache, "num_pages", None)
        if pages is None and getattr(cache, "num_blocks", None) and getattr(cache, "block_size", None):
            pages = cache.num_blocks * cache.block_size
        if pages:
            out["kv_cache_tokens"] = int(pages)
        return out

    def _eos(self, body: dict[str, Any]):
        if body.get("ignore_eos"):
            return -1  # no EOS: the request runs to max_tokens
        return None  # the manager's generation config (the tokenizer's EOS)

    def serve(self, chan) -> None:
        """Serve the worker's commands until it goes: an asyncio loop on this (the main) thread reads
        them as they come (``add_reader`` on the command pipe) and gets each request's outputs
        through ``register_result_handler``; the manager's own thread steps the model."""
        asyncio.run(self._serve(chan))

    async def _serve(self, chan) -> None:
        loop = asyncio.get_running_loop()
        gone = loop.create_future()

        def on_commands() -> None:
            try:
                msgs = chan.poll()
            except EOFError:  # the worker is gone
                loop.remove_reader(chan.cmd_fd)
                if not gone.done():
                    gone.set_result(None)
                return
            for msg in msgs:
                self.command(msg, chan)

        chan.poll()  # the pipe non-blocking before the loop watches it
        loop.add_reader(chan.cmd_fd, on_commands)
        await gone
        raise EOFError("the worker closed the command pipe")

    def paused(self, fn) -> None:
        """``fn()`` with the manager paused and the model's own attention implementation."""
        model = self.engine.model
        with self.manager.pause():
            current = getattr(model.config, "_attn_implementation", None)
            if self.original_attn and current != self.original_attn:
                model.set_attn_implementation(self.original_attn)
            try:
                fn()
            finally:
                if self.original_attn and current != self.original_attn:
                    model.set_attn_implementation(current)

    def command(self, msg: tuple, chan) -> None:
        """One command from the worker (``backends/_hosting/engine_frames.py``)."""
        kind, rid, send = msg[0], msg[1], chan.send
        if kind == "tokenize":
            answer_tokenize(self.engine, send, rid, msg[2])
        elif kind == "score":
            self.paused(lambda: answer_call(send, rid, self.engine.score, msg[2]))
        elif kind == "cancel":
            self.held = [m for m in self.held if m[1] != rid]
            entry = self.live.pop(f"r-{rid}", None)
            if entry is not None:
                self.manager.cancel_request(f"r-{rid}")
                entry[0].finish("abort", self.engine.stats())
        elif kind == "gen":
            body = msg[2]
            if _outside(body):  # not the manager's to serve
                self.alone(msg, chan)
            elif self.lone_wait_s and not self.live:  # idle: wait a moment for company
                self.held.append(msg)
                if self.hold_timer is None:
                    self.hold_timer = asyncio.get_running_loop().call_later(self.lone_wait_s, self.decide, chan)
            else:
                self.add(msg, chan)

    def decide(self, chan) -> None:
        """End of an idle engine's wait: one request alone runs on ``generate``, more join the batch."""
        self.hold_timer = None
        held, self.held = self.held, []
        if len(held) == 1 and not self.live:
            self.lone += 1
            self.alone(held[0], chan)
            return
        for msg in held:
            self.add(msg, chan)

    def alone(self, msg: tuple, chan) -> None:
        """A request outside the manager's batch, with the manager paused: greedy requests with
        logprobs (probes) as static batches with the like requests waiting
        (:func:`backends.transformers.static.serve_static`: each row's tokens and logprobs as
        ``generate`` alone gives them), a sampled one or a lone greedy one through ``generate``.
        Commands that come meanwhile are handled after it, the outside requests among them the same way."""
        waiting: collections.deque = collections.deque([msg])
        while waiting:
            m = waiting.popleft()
            if m is not msg and not (m[0] == "gen" and _outside(m[2])):
                self.command(m, chan)
                continue
            if m[2].get("logprobs") and batch_key(m[2]) is not None:
                before = self.engine.batched_requests
                self.paused(lambda: serve_static(self.engine, m, chan, waiting))
                self.outside += self.engine.batched_requests - before  # the batch's rows, joiners too
            else:
                self.outside += _outside(m[2])
                self.paused(lambda: self.engine.generate(m[1], m[2], chan, waiting))

    def add(self, msg: tuple, chan) -> None:
        """A greedy request into the manager's batch."""
        rid, body = msg[1], msg[2]
        out = Out(chan.send, rid, self.engine.interval_s)
        ids = self.engine.encode(body.get("prompt", ""))
        out.start(len(ids))
        max_new = int(body.get("max_tokens") or 16)
        key = f"r-{rid}"
        self.live[key] = [out, max_new, 0]
        self.batched += 1
        self.manager.register_result_handler(key, lambda res, key=key: self.on_result(key, res))
        got = self.manager.add_request(ids, request_id=key, max_new_tokens=max_new, streaming=True,
                                       eos_token_id=self._eos(body))
        if got is None:
            self.live.pop(key, None)
            out.fail(RuntimeError("continuous batching manager refused the request (stopping or failed)"))

    def on_result(self, key: str, res) -> None:
        """A manager output for request ``key`` (``generated_tokens`` is cumulative)."""
        entry = self.live.get(key)
        if entry is None:
            return
        out, max_new, sent = entry
        if getattr(res, "error", None):
            del self.live[key]
            out.fail(RuntimeError(f"continuous batching: {res.error}"))
            return
        new = [int(x) for x in res.generated_tokens[sent:]]
        if new:
            entry[2] = sent + len(new)
            out.pending += new
            out.due(time.perf_counter())
        if res.is_finished():
            del self.live[key]
            self.engine.n_generated += entry[2]
            out.finish("length" if entry[2] >= max_new else "stop", self.engine.stats())

    def warmup(self) -> None:
        """One short request through the manager, blocking (also sizes the paged cache).

        Raises:
            RuntimeError: no result within :data:`WARMUP_TIMEOUT_S` or a failed request.
        """
        tok = self.engine.tokenizer
        rid = f"warmup-{uuid.uuid4().hex[:8]}"
        self.manager.add_request(tok("warm up")["input_ids"], request_id=rid, max_new_tokens=4, eos_token_id=-1)
        deadline = time.monotonic() + WARMUP_TIMEOUT_S
        while time.monotonic() < deadline:
            out = self.manager.get_result(timeout=0.5)
            if out is None:
                status = getattr(self.manager, "background_thread_status", None)
                if status is not None and getattr(status, "fatal_error", None) is not None:
                    raise RuntimeError(f"manager failed: {status.fatal_error}")
                continue
            if out.request_id != rid:
                continue
            if getattr(out, "error", None):
                raise RuntimeError(out.error)
            if out.is_finished():
                return
        raise RuntimeError(f"warm-up request got no result within {WARMUP_TIMEOUT_S:.0f} s")


def _outside(body: dict[str, Any]) -> bool:
    """A request the manager does not serve: sampled, or asking for logprobs."""
    return float(body.get("temperature") or 0.0) > 0 or bool(body.get("logprobs"))


def kv_fraction(engine, options: dict[str, Any]) -> float | None:
    """The manager's ``max_memory_percent``: ``kv_memory_fraction`` when set; on CPU the share of free
    host memory that makes ``kv_cache_gib`` GiB (default 1). transformers sizes the paged cache from
    the device's free memory, 90% of it by default: on CPU the host's RAM (psutil's total less this
    process's RSS), 20 GiB of a 24 GiB host, and two workers at once were killed by the kernel's
    out-of-memory killer (seen 2026-12-03). None: transformers' own default (GPU)."""
    if options.get("kv_memory_fraction"):
        return float(options["kv_memory_fraction"])
    if engine.device != "cpu":
        return None
    import psutil

    free = psutil.virtual_memory().total - psutil.Process().memory_info().rss
    want = float(options.get("kv_cache_gib") or 1.0) * 2**30
    return min(0.9, max(1e-4, want / max(free, 1)))


def start_batcher(engine, options: dict[str, Any]) -> tuple[ContinuousBatcher | None, str]:
    """Start a continuous batching manager for ``engine``'s model and warm it up.

    Args:
        engine: the worker's engine (``model``, ``tokenizer``).
        options: backend options (``kv_memory_fraction``).

    Returns:
        ``(batcher, "")``, or ``(None, reason)`` when continuous batching is unavailable or
        failed; the model is then left as it was (its attention implementation restored).
    """
    model, tok = engine.model, engine.tokenizer
    if not hasattr(model, "init_continuous_batching"):
        import transformers

        return None, f"transformers {transformers.__version__} has no init_continuous_batching"
    original_attn = getattr(model.config, "_attn_implementation", None)
    manager = None
    try:
        from transformers import GenerationConfig

        eos = tok.eos_token_id if tok.eos_token_id is not None else -1
        gen = GenerationConfig(do_sample=False, max_new_tokens=256, eos_token_id=eos,
                               pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else eos)
        kwargs: dict[str, Any] = {"generation_config": gen}
        fraction = kv_fraction(engine, options)
        if fraction is not None:
            from transformers.generation.configuration_utils import ContinuousBatchingConfig

            kwargs["continuous_batching_config"] = ContinuousBatchingConfig(max_memory_percent=fraction)
        manager = model.init_continuous_batching(**kwargs)
        manager.start()
        lone = options.get("lone_request", "generate") == "generate"
        batcher = ContinuousBatcher(engine, manager, original_attn,
                                    float(options.get("lone_wait_ms", 2.0)) / 1000 if lone else 0.0)
        batcher.warmup()
        return batcher, ""
    except Exception as exc:  # the reason is recorded; the worker serves one at a time
        reason = f"{type(exc).__name__}: {str(exc)[:300]}"
        if manager is not None:
            try:
                manager.stop(block=True, timeout=30)
            except Exception:
                pass
        if original_attn and getattr(model.config, "_attn_implementation", None) != original_attn:
            try:
                model.set_attn_implementation(original_attn)
            except Exception as exc2:
                reason += f"; attention implementation not restored: {exc2}"
        return None, reason
