"""optimum-ort's pre-flight rule (bakeoff/analysis/preflight.py): optimum-onnx's exporter, not OpenVINO's.

What optimum-onnx 0.1.0 does with a checkpoint (``optimum/exporters/onnx/__main__.py``
``main_export``, read in huggingface/optimum-onnx at tag v0.1.0): it reads ``config.json`` with
``AutoConfig``, looks the ``model_type`` up in ``TasksManager``'s ONNX export configs (an unknown
one is a custom architecture, refused at export unless custom configs are given: recorded then as
``unsupported-architecture`` with the exporter's words, not guessed here), and loads the model
with transformers' ``from_pretrained`` before tracing it. Of ``quantization_config`` it reads
``quant_method`` only to dequantize ``mxfp4`` to bf16 (``Mxfp4Config(dequantize=True)``,
transformers >= 4.55: the optimum-onnx environment pins 4.57); every other method goes to
transformers' own quantizer (its package is not in bakeoff's optimum-onnx environment) and then
to a tracer made for float modules, so the exporter decides.
"""

from __future__ import annotations

from bakeoff.analysis.preflight import Rule

SRC_ONNX = ("optimum/exporters/onnx/__main__.py main_export (AutoConfig, TasksManager ONNX export configs per "
            "model_type; quantization_config read for mxfp4 only, dequantized to bf16), optimum-onnx 0.1.0")


def rule(q: dict, arch: str | None, cuda: bool, flags: set[str] | None = None) -> Rule:
    """Float checkpoints export; ``mxfp4`` is dequantized first; other pre-quantized ones: optimum-onnx decides."""
    if not q.get("quantized"):
        return True, "float checkpoint: optimum-onnx's exporter loads it with transformers and traces it", SRC_ONNX
    if q.get("method") == "mxfp4":
        return True, "mxfp4 checkpoint: optimum-onnx's main_export dequantizes it to bf16 before the export", SRC_ONNX
    return None, (f"pre-quantized ({q.get('method')}) checkpoint: optimum-onnx's main_export has no path of its own for "
                  "it (mxfp4 only); transformers' quantizer loads it and the exporter decides"), SRC_ONNX
