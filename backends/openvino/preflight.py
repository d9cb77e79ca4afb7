"""OpenVINO's pre-flight rule (bakeoff/analysis/preflight.py): no prediction for architectures.

optimum-intel decides at export time which ``model_type`` it has an export config for; a
refusal is recorded then (``unsupported-architecture`` with the exporter's words), not guessed.
"""

from __future__ import annotations

from bakeoff.analysis.preflight import Rule

SRC_OV = "optimum/intel/openvino (export configs per model_type), optimum-intel 2.2.0"


def rule(q: dict, arch: str | None, cuda: bool, flags: set[str] | None = None) -> Rule:
    """Float checkpoints export (NNCF compresses them); pre-quantized ones: optimum-intel decides."""
    if not q.get("quantized"):
        return True, "float checkpoint: optimum-intel exports it and NNCF compresses weights when asked", SRC_OV
    return None, f"pre-quantized ({q.get('method')}) checkpoint: optimum-intel decides at export", SRC_OV
