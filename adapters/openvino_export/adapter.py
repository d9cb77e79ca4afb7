"""The ``openvino`` adapter: optimum-intel's export to OpenVINO IR, copied where it is asked."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from adapters.base import Adapter, copy_cached_export
from adapters.openvino_export.env import env_spec
from adapters.openvino_export.build import export
from adapters.openvino_export.specs import OpenVinoExportOptions


class OpenVinoExportAdapter(Adapter):
    """fp32 / fp16 / int8 / int4 OpenVINO IR with ``optimum-cli export openvino`` (:func:`export`)."""

    name = "openvino"
    Options = OpenVinoExportOptions

    @classmethod
    def env_spec(cls):
        return env_spec()

    def run(self, source: str | Path, out: Path, log: Callable[[str], None] = print) -> dict[str, Any]:
        res = export(source, self.options, log=log)
        src = copy_cached_export(res.output_dir, out)
        return {"cache_dir": str(src), "duration_s": res.duration_s, "output_bytes": res.output_bytes,
                "compression": res.compression, "cached": res.cached}
