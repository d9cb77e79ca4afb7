"""Continuous batching for the transformers worker (``--backend-opt batching=continuous``).

transformers (5.x) ships a continuous batching engine: ``model.init_continuous_batching()``
returns a ``ContinuousBatchingManager`` (``transformers.generation.continuous_batching``) whose
background thread schedules requests into a paged KV cache; ``add_request(input_ids,
request_id, max_new_tokens, streaming=True, eos_token_id=...)`` queues one, and
``register_result_handler(request_id, callback)`` delivers its outputs on the caller's event
loop (``generated_tokens`` is cumulative). Seen in transformers 5.17.0 and 5.19.0.

Requests are greedy (the manager's generation config has ``do_sample=False``); a request
with ``temperature > 0`` is refused with an error rather than served greedily. When the
manager is missing or its warm-up request fails, :func:`start_batcher` returns the reason and
the worker serves one request at a time.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

WARMUP_TIMEOUT_S = 300.0


class ContinuousBatcher:
    """Streams requests through a started ContinuousBatchingManager.

    Args:
        engine: the worker's :class:`TransformersEngine` (model, tokenizer).
        manager: a started manager.
    """

    def __init__(self, engine, manager):
        self.engine = engine
        self.manager = manager

    def info(self) -> dict[str, Any]:
        """``batching``, ``attn_implementation`` and the paged cache's size in tokens when known."""
        out: dict[str, Any] = {"batching": "continuous",
                               "attn_implementation": getattr(self.engine.model.config, "_attn_implementation", None)}
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

    async def generate(self, body: dict[str, Any]):
        """Yield ``(new_token_ids, text_delta, finish_reason)`` as the manager produces tokens.

        Raises:
            ValueError: a sampled request (``temperature > 0``).
            RuntimeError: the manager refused or failed the request (its error message).
        """
        if float(body.get("temperature") or 0.0) > 0:
            raise ValueError("batching=continuous serves greedy requests only (temperature 0)")
        tok = self.engine.tokenizer
        ids = tok(body.get("prompt", ""))["input_ids"]
        max_new = int(body.get("max_tokens") or 16)
        q: asyncio.Queue = asyncio.Queue()
        rid = f"r-{uuid.uuid4().hex[:12]}"
        self.manager.register_result_handler(rid, q.put_nowait)
        got = self.manager.add_request(ids, request_id=rid, max_new_tokens=max_new, streaming=True,
                                       eos_token_id=self._eos(body))
        if got is None:
            raise RuntimeError("continuous batching manager refused the request (stopping or failed)")
        sent: list[int] = []
        text = ""
        while True:
            out = await q.get()
            if getattr(out, "error", None):
                raise RuntimeError(f"continuous batching: {out.error}")
            new = [int(x) for x in out.generated_tokens[len(sent):]]
            if new:
                sent.extend(new)
                full = tok.decode(sent, skip_special_tokens=True)
                delta = "" if full.endswith("\ufffd") else full[len(text):]
                if delta:
                    text = full
                yield new, delta, None
            if out.is_finished():
                break
        self.engine.n_generated += len(sent)
        yield [], "", "length" if len(sent) >= max_new else "stop"

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
        if options.get("kv_memory_fraction"):
            from transformers.generation.configuration_utils import ContinuousBatchingConfig

            kwargs["continuous_batching_config"] = ContinuousBatchingConfig(
                max_memory_percent=float(options["kv_memory_fraction"]))
        manager = model.init_continuous_batching(**kwargs)
        manager.start()
        batcher = ContinuousBatcher(engine, manager)
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
