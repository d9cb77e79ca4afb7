"""OpenVINO export: ``optimum-cli export openvino`` (optimum-intel + NNCF) on a checkpoint, cached.

Names load lazily: ``python -m adapters.openvino_export._inspect_ir`` runs in the openvino
environment, which has no pydantic.

Example:
    >>> from adapters.openvino_export import OpenVinoExportOptions, export
    >>> res = export("/path/to/checkpoint", OpenVinoExportOptions(weight_format="int8"))
    >>> res.compression["report"]  # NNCF's bitwidth table
"""

import importlib

_WHERE = {"OPENVINO_VERSION": "env", "env_spec": "env", "compression_report": "build", "export": "build",
          "OpenVinoExportOptions": "specs", "OpenVinoExportResult": "specs"}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(name)
    return getattr(importlib.import_module(f"adapters.openvino_export.{_WHERE[name]}"), name)
