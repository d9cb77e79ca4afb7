"""The llama.cpp environment: ``xllamacpp``, llama.cpp's ``llama-server`` built as a Python extension.

Why this package (2026-12): the registry carries llama.cpp's own server only as a prebuilt
binary in ``xllamacpp`` (a 34 MB abi3 wheel of llama.cpp's ``tools/server`` C++ code: parallel
slots, continuous batching, ``/metrics``, ``/props``, ``/tokenize``), CPU build with OpenMP and
AVX2 (``xllamacpp.get_system_info()`` on an AVX-512 host: ``AVX2 = 1``, no ``AVX512``).
``llama-cpp-python`` ships only a source distribution (29 min to compile on a loaded 2-core
host, issue 37) and its Python server has neither parallel slots nor continuous batching. The
install is one wheel, seconds. The worker serves with the extension alone (no aiohttp).
"""

from __future__ import annotations

from bakeoff.host import envs

XLLAMACPP_VERSION = "2026.10.11549"
REQUIREMENTS = (f"xllamacpp=={XLLAMACPP_VERSION}",)
MODULES = ("xllamacpp",)


def env_spec() -> envs.EnvSpec:
    """The ``llamacpp`` environment spec (one prebuilt CPU wheel)."""
    return envs.EnvSpec("llamacpp", REQUIREMENTS, modules=MODULES)
