"""The ``ort-genai`` adapter: the model builder's export, inspected, copied where it is asked."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from adapters.base import Adapter, copy_cached_export
from adapters.ort_genai_export.env import env_spec
from adapters.ort_genai_export.export import export
from adapters.ort_genai_export.specs import ExportOptions


class OrtGenaiExportAdapter(Adapter):
    """INT4 / QMoE / float export with ONNX Runtime GenAI's model builder (:func:`export`)."""

    name = "ort-genai"
    Options = ExportOptions

    @classmethod
    def env_spec(cls):
        return env_spec()

    def run(self, source: str | Path, out: Path, log: Callable[[str], None] = print) -> dict[str, Any]:
        res = export(source, self.options, log=log)
        src = copy_cached_export(res.output_dir, out)
        return {"cache_dir": str(src), "duration_s": res.duration_s, "output_bytes": res.output_bytes,
                "ops": res.graph.summary(), "cached": res.cached}
