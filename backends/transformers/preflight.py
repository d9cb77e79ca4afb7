"""The transformers reference's pre-flight rule (bakeoff/analysis/preflight.py)."""

from __future__ import annotations

import importlib.util

from bakeoff.analysis.preflight import Rule

SRC_HF = ("https://huggingface.co/docs/transformers/main/en/quantization/overview; "
          "transformers/quantizers/auto.py (AUTO_QUANTIZER_MAPPING)")

# quant_method -> Python package transformers needs to load it.
HF_PACKAGES = {"awq": "gptqmodel", "gptq": "gptqmodel", "compressed-tensors": "compressed_tensors",
               "fp8": "torch", "bitsandbytes": "bitsandbytes", "modelopt": "modelopt", "quark": "quark",
               "mxfp4": "kernels", "torchao": "torchao", "gguf": "gguf"}



def rule(q: dict, arch: str | None, cuda: bool, flags: set[str] | None = None) -> Rule:
    """Whether transformers has the quantizer package for the checkpoint's method."""
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
