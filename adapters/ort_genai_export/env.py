"""The ONNX Runtime GenAI environment: the model builder and the runtime, in one venv.

Pins (docs/field-notes.md, "ONNX Runtime GenAI"): the builder in ``onnxruntime-genai`` 0.18.0
imports ``onnx``, ``onnx_ir``, ``onnxscript``, ``torch`` and ``transformers``; the worker
needs ``aiohttp`` (``backends._hosting.worker_server``) and ``tokenizers`` (the HF tokenizer fallback).
torch is pinned to 2.13.0: on this host pip takes the local CPU wheel; on a CUDA host the
user's index decides.
"""

from __future__ import annotations

from bakeoff.host import envs

ORT_GENAI_VERSION = "0.18.0"

REQUIREMENTS = (
    f"onnxruntime-genai=={ORT_GENAI_VERSION}",
    "onnx",
    "onnxruntime",
    "onnx-ir",
    "onnxscript",
    "torch==2.13.0",
    "transformers>=5.17,<5.20",
    "tokenizers",
    "safetensors",
    "aiohttp",
    "numpy",
)


# what the builder, the inspection child and the worker import: an interpreter holding these
# (``onnxruntime-genai-cuda`` and ``onnxruntime-gpu`` provide the same modules) is a
# preinstalled ort-genai environment (bakeoff/host/envs.py)
MODULES = ("onnxruntime_genai", "onnxruntime", "onnx", "onnx_ir", "onnxscript", "torch", "transformers",
           "tokenizers", "safetensors", "aiohttp", "numpy")


def env_spec() -> envs.EnvSpec:
    """The ``ort-genai`` environment spec (CPU wheel of onnxruntime-genai)."""
    return envs.EnvSpec("ort-genai", REQUIREMENTS, modules=MODULES)
