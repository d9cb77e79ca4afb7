"""TensorRT-LLM's pre-flight rule (bakeoff/analysis/preflight.py)."""

from __future__ import annotations

from bakeoff.analysis.preflight import Rule

SRC_TRT = ("https://github.com/NVIDIA/TensorRT-LLM/blob/main/tensorrt_llm/llmapi/llm_utils.py "
           "(ModelLoader._update_from_hf_quant_config: modelopt, fp8, mxfp4, mxfp8, compressed-tensors, nvfp4; "
           "else NotImplementedError 'Unsupported quantization_config'), "
           "update_quant_config_from_compressed_tensors (num_bits 8 FP8 channel/block, or 4-bit float "
           "tensor_group NVFP4), tensorrt_llm/quantization/modelopt_config.py (is_modelopt_quant_config); "
           "https://nvidia.github.io/TensorRT-LLM/features/quantization.html")

def rule(q: dict, arch: str | None, cuda: bool, flags: set[str] | None = None) -> Rule:
    """What TensorRT-LLM's HF quant-config reader accepts."""
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
