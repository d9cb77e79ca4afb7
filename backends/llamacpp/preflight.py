"""llama.cpp's pre-flight rule (bakeoff/analysis/preflight.py): llama.cpp decides at load.

The server reads the architecture from the GGUF's ``general.architecture`` and refuses one it
has no graph for at load ("unknown model architecture"), recorded then with its words.
"""

from __future__ import annotations

from bakeoff.analysis.preflight import Rule

SRC = "llama.cpp src/llama-arch.cpp (architectures by GGUF name), xllamacpp 2026.10.11549"


def rule(q: dict, arch: str | None, cuda: bool, flags: set[str] | None = None) -> Rule:
    """No prediction: the GGUF served, not the checkpoint's config, names the architecture."""
    return None, "llama.cpp serves the GGUF's architecture and decides at load", SRC
