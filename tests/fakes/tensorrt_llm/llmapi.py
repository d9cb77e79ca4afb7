"""FAKE tensorrt_llm.llmapi (tests only): ``KvCacheConfig`` keeps its keyword arguments."""

from __future__ import annotations

from typing import Any


class KvCacheConfig:
    def __init__(self, **kwargs: Any):
        allowed = {"free_gpu_memory_fraction", "enable_block_reuse", "max_tokens", "dtype"}
        unknown = set(kwargs) - allowed
        if unknown:
            raise TypeError(f"KvCacheConfig got unexpected keyword arguments {sorted(unknown)}")
        self.kwargs = kwargs
