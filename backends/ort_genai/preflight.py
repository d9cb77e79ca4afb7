"""ONNX Runtime GenAI's pre-flight rule (bakeoff/analysis/preflight.py)."""

from __future__ import annotations

from bakeoff.analysis.preflight import Rule

SRC_ORT = ("onnxruntime_genai/models/loaders/quant_model.py (QuantModel.from_pretrained: awq, gptq, olive, quark, "
           "modelopt, compressed-tensors, quant_auto), loaders/modelopt.py (NVFP4 + FP8 only) and builder.py "
           "create_model ('ModelOpt FP8/NVFP4 checkpoints are only supported on the CUDA EP.'), onnxruntime-genai 0.18.0")
SRC_ORT_ARCH = ("onnxruntime_genai/models/builder.py create_model (dispatch on config.architectures[0]), "
                "0.18.0; seen in docs/field-notes.md 'ONNX Runtime GenAI'")
# Architectures ORT GenAI 0.18.0's builder refuses ("The <path> model is not currently supported.").
ORT_REFUSED_ARCHS = {"Qwen3MoeForCausalLM", "Qwen3_5MoeForCausalLM"}
# Refused architectures whose other layout of the same weights the 0.18.0 builder does export.
ORT_LAYOUT_HINTS = {"Qwen3_5MoeForCausalLM": (
    "the builder exports Qwen3_5MoeForConditionalGeneration (the layout released Qwen3.5-MoE checkpoints ship); "
    "the same weights in that layout: fixture:tiny-qwen3.5-moe-cg")}

def rule(q: dict, arch: str | None, cuda: bool, flags: set[str] | None = None) -> Rule:
    """The 0.18.0 builder's architectures and pre-quantized loaders."""
    m, s = q.get("method"), q.get("scheme") or "?"
    if arch in ORT_REFUSED_ARCHS:
        hint = f"; {ORT_LAYOUT_HINTS[arch]}" if arch in ORT_LAYOUT_HINTS else ""
        return (False, f"NotImplementedError: The {arch} model is not currently supported by the ORT GenAI builder{hint}",
                SRC_ORT_ARCH, "unsupported-architecture")
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
