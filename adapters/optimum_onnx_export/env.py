"""The optimum ONNX environment: ``optimum-cli export onnx`` and ``ORTModelForCausalLM`` in one venv.

Pins (found with pip's resolver, 2026-12): optimum's ONNX exporter and ``ORTModelForCausalLM``
moved out of ``optimum`` into ``optimum-onnx`` (0.1.0), which requires ``optimum~=2.1.0`` and
``transformers>=4.36,<4.58``: the known transformers skew (the ort-genai environment runs
5.19, openvino's 5.5). Architectures newer than transformers 4.57 (e.g. ``qwen3_5_moe``) are
unknown here, which is what users of this route meet. ``onnx`` and ``onnxruntime`` run the
graph inspection shared with the ORT GenAI adapter; the worker needs ``aiohttp``.
"""

from __future__ import annotations

from bakeoff.host import envs

OPTIMUM_ONNX_VERSION = "0.1.0"

REQUIREMENTS = (
    f"optimum-onnx[onnxruntime]=={OPTIMUM_ONNX_VERSION}",
    "optimum==2.1.0",
    "onnx",
    "onnxruntime",
    "torch==2.13.0",
    "transformers>=4.57,<4.58",
    "tokenizers",
    "safetensors",
    "aiohttp",
    "numpy",
)

MODULES = ("optimum.onnxruntime", "optimum.exporters.onnx", "onnx", "onnxruntime", "torch", "transformers",
           "tokenizers", "aiohttp", "numpy")


def env_spec() -> envs.EnvSpec:
    """The ``optimum-onnx`` environment spec (CPU onnxruntime; ``onnxruntime-gpu`` users install it themselves)."""
    return envs.EnvSpec("optimum-onnx", REQUIREMENTS, modules=MODULES)
