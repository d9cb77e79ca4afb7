"""FAKE tensorrt_llm for tests (see tests/fakes/README.md): the LLM API surface bakeoff uses.

Mirrors the real semantics that matter: streaming outputs are CUMULATIVE and expose the new
part as ``text_diff`` / ``token_ids_diff`` (tensorrt_llm/executor/result.py), several tokens
may arrive in one item, and ``finished`` / ``finish_reason`` come with the last item.
"""

from __future__ import annotations

import asyncio
import json
import os
from dataclasses import dataclass, field
from typing import Any

__version__ = "0.0.0+fake"
FAKE = True
PIECES = ["Hel", "lo", ",", " wor", "ld", " é", "t", "é", "!", " "]


def _record(kind: str, **data: Any) -> None:
    path = os.environ.get("FAKE_TRTLLM_RECORD")
    if path:
        with open(path, "a") as fh:
            fh.write(json.dumps({"kind": kind, **data}, default=repr) + "\n")


class SamplingParams:
    """Keeps its keyword arguments (the real one is a dataclass with these names)."""

    def __init__(self, **kwargs: Any):
        allowed = {"max_tokens", "temperature", "top_p", "top_k", "seed", "ignore_eos", "stop", "end_id", "pad_id"}
        unknown = set(kwargs) - allowed
        if unknown:
            raise TypeError(f"SamplingParams got unexpected keyword arguments {sorted(unknown)}")
        self.kwargs = kwargs
        self.max_tokens = kwargs.get("max_tokens", 32)


@dataclass
class CompletionOutput:
    index: int = 0
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    _last_text_len: int = 0
    _last_token_ids_len: int = 0

    @property
    def text_diff(self) -> str:
        return self.text[self._last_text_len:]

    @property
    def token_ids_diff(self) -> list[int]:
        return self.token_ids[self._last_token_ids_len:]


class RequestOutput:
    """Async-iterable result of ``generate_async(..., streaming=True)``."""

    def __init__(self, prompt: str, sp: SamplingParams):
        self.prompt = prompt
        self.sampling_params = sp
        self.outputs = [CompletionOutput()]
        self.finished = False

    def __aiter__(self):
        return self._steps()

    async def _steps(self):
        comp = self.outputs[0]
        n, step = self.sampling_params.max_tokens, 0
        while len(comp.token_ids) < n:
            comp._last_text_len, comp._last_token_ids_len = len(comp.text), len(comp.token_ids)
            k = min(1 + step % 2, n - len(comp.token_ids))  # 1, 2, 1, 2 ... tokens per item
            for _ in range(k):
                i = len(comp.token_ids)
                comp.token_ids.append(100 + i)
                comp.text += PIECES[i % len(PIECES)]
            step += 1
            if len(comp.token_ids) >= n:
                self.finished, comp.finish_reason = True, "length"
            await asyncio.sleep(0)
            yield self


class _Tokenizer:
    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]


class LLM:
    """Records its construction arguments; generates a fixed text, cumulatively."""

    def __init__(self, model: str, **kwargs: Any):
        kv = kwargs.get("kv_cache_config")
        _record("LLM", model=model, kwargs={k: v for k, v in kwargs.items() if k != "kv_cache_config"},
                kv_cache_config=getattr(kv, "kwargs", None))
        self.model = model
        self.tokenizer = _Tokenizer()
        print("[MemUsageChange] Allocated 1.00 GiB for max tokens in paged KV cache (4096).", flush=True)

    def generate_async(self, inputs: str, sampling_params: SamplingParams | None = None, streaming: bool = False):
        sp = sampling_params or SamplingParams()
        _record("generate_async", prompt=inputs, sampling_params=sp.kwargs, streaming=streaming)
        return RequestOutput(inputs, sp)

    def shutdown(self) -> None:
        _record("shutdown")
