"""Adapters: build/export/load steps that turn a source checkpoint into what an engine loads.

Each adapter is a package (``ort_genai_export``, ...) that runs its tool in the tool's own
environment (``bakeoff.host.envs``) and returns a pydantic result, or raises
``bakeoff.api.errors.EngineFailure`` with a failure class and evidence. The ones jobs and the
CLI run by name implement :class:`adapters.base.Adapter` and are listed in :data:`REGISTRY`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from bakeoff.api.errors import UserError

if TYPE_CHECKING:
    from adapters.base import Adapter

# name -> "module:Class", imported only when used (like backends.REGISTRY)
REGISTRY: dict[str, str] = {
    "ort-genai": "adapters.ort_genai_export.adapter:OrtGenaiExportAdapter",
    "awq-int4": "adapters.awq_int4.adapter:AwqInt4Adapter",
    "openvino": "adapters.openvino_export.adapter:OpenVinoExportAdapter",
    "optimum-onnx": "adapters.optimum_onnx_export.adapter:OptimumOnnxExportAdapter",
    "gguf": "adapters.gguf_convert.adapter:GgufConvertAdapter",
}


def names() -> list[str]:
    return sorted(REGISTRY)


def validate(name: str) -> str:
    """``name`` when it is a registered adapter.

    Raises:
        UserError: one line naming the adapters there are.
    """
    if name not in REGISTRY:
        raise UserError(f"unknown adapter {name!r}; choose one of: {', '.join(names())}")
    return name


def resolve(name: str) -> type[Adapter]:
    """The adapter class registered as ``name`` (its module imported now)."""
    module, cls = REGISTRY[validate(name)].split(":")
    return getattr(importlib.import_module(module), cls)
