"""ONNX Runtime GenAI export: the model builder on a checkpoint, then a graph inspection.

The builder (``onnxruntime_genai.models.builder``, 0.18.0) runs in its own environment
(:mod:`adapters.ort_genai_export.env`). Each export is inspected (op counts, requested
precision visible, a paged graph consistent with its ``genai_config.json``, ONNX checker and
strict shape inference, one ORT forward step, ``og.Model`` load) and every problem becomes an :class:`bakeoff.api.errors.EngineFailure` with a failure class
(``unsupported-architecture``, ``export-defect``, ``load-failure``, ...) and evidence.
Exports are cached under ``bakeoff.host.envs.cache_root()/exports/``.

Example:
    >>> from adapters.ort_genai_export import ExportOptions, export
    >>> res = export("/path/to/checkpoint", ExportOptions(precision="int4", block_size=32))
    >>> res.graph.op_counts["com.microsoft.MatMulNBits"]
"""

from adapters.ort_genai_export.cache import checkpoint_hash
from adapters.ort_genai_export.env import ORT_GENAI_VERSION, env_spec
from adapters.ort_genai_export.export import export, inspect_graph, raise_for_problems
from adapters.ort_genai_export.specs import ExportOptions, ExportResult, GraphProblem, GraphReport

__all__ = ["ORT_GENAI_VERSION", "ExportOptions", "ExportResult", "GraphProblem", "GraphReport", "checkpoint_hash",
           "env_spec", "export", "inspect_graph", "raise_for_problems"]
