"""The ``optimum-onnx`` adapter: optimum's ONNX export (fp32, or int8 by its quantizer), inspected, copied."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from adapters.base import Adapter, copy_cached_export
from adapters.optimum_onnx_export.build import export
from adapters.optimum_onnx_export.env import env_spec
from adapters.optimum_onnx_export.specs import OptimumOnnxOptions


class OptimumOnnxExportAdapter(Adapter):
    """``optimum-cli export onnx --task text-generation-with-past`` (:func:`export`)."""

    name = "optimum-onnx"
    Options = OptimumOnnxOptions

    @classmethod
    def env_spec(cls):
        return env_spec()

    def run(self, source: str | Path, out: Path, log: Callable[[str], None] = print) -> dict[str, Any]:
        res = export(source, self.options, log=log)
        src = copy_cached_export(res.output_dir, out)
        return {"cache_dir": str(src), "duration_s": res.duration_s, "output_bytes": res.output_bytes,
                "ops": res.graph.summary(), "cached": res.cached}
