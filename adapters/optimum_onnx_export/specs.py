"""Pydantic specs of the optimum ONNX export adapter (no engine import, no side effects)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from adapters.ort_genai_export.specs import GraphReport


class OptimumOnnxOptions(BaseModel):
    """What ``optimum-cli export onnx`` is asked to produce (optimum-onnx 0.1.0).

    Attributes:
        precision: ``fp32`` (the exporter's graph) or ``int8`` (that graph quantized by
            optimum's ``ORTQuantizer`` with ``AutoQuantizationConfig.avx2(is_static=False)``:
            dynamic int8 MatMuls).
        task: ``--task``; ``text-generation-with-past`` exports the decoder with KV-cache
            inputs and outputs ``ORTModelForCausalLM`` serves.
        opset: ``--opset``; None: the exporter's default for the architecture.
    """

    model_config = ConfigDict(extra="forbid")

    precision: Literal["fp32", "int8"] = "fp32"
    task: Literal["text-generation-with-past"] = "text-generation-with-past"
    opset: int | None = Field(None, ge=13)

    def cli_args(self) -> list[str]:
        return ["--task", self.task] + (["--opset", str(self.opset)] if self.opset else [])

    @property
    def onnx_file(self) -> str:
        """The graph ``ORTModelForCausalLM`` loads: ``model.onnx`` or the quantizer's ``model_quantized.onnx``."""
        return "model_quantized.onnx" if self.precision == "int8" else "model.onnx"


class OptimumOnnxResult(BaseModel):
    """One export of a checkpoint with optimum's ONNX exporter, and its graph inspection.

    Attributes mirror :class:`adapters.ort_genai_export.specs.ExportResult`: source and its
    hash, ``architecture`` and ``model_type``, options, cache key, ``output_dir``, the exact
    ``command`` (and ``quantize_command`` for int8), package ``versions``, ``duration_s``
    (exporter plus quantizer wall time, seconds), ``output_bytes`` and ``files``, the ``graph``
    report (op counts, checker, strict shape inference, one forward step), ``cached``.
    """

    model_config = ConfigDict(extra="forbid")

    source: str
    source_hash: str
    architecture: str | None = None
    model_type: str | None = None
    options: OptimumOnnxOptions
    cache_key: str
    output_dir: str
    onnx_file: str
    command: list[str]
    quantize_command: list[str] = Field(default_factory=list)
    versions: dict[str, str] = Field(default_factory=dict)
    duration_s: float
    output_bytes: int
    files: dict[str, int] = Field(default_factory=dict)
    graph: GraphReport
    cached: bool = False
    created_at: str

    def notes(self) -> dict[str, str]:
        """Flat ``BackendInfo.notes`` entries for the verdict."""
        return {
            "export_command": " ".join(self.command),
            "export_quantize_command": " ".join(self.quantize_command),
            "export_precision": self.options.precision,
            "export_ops": self.graph.summary(),
            "export_size_bytes": str(self.output_bytes),
            "export_duration_s": str(self.duration_s),
            "export_versions": ", ".join(f"{k}=={v}" for k, v in sorted(self.versions.items())),
            "export_cached": str(self.cached),
            "export_dir": self.output_dir,
            "source_hash": self.source_hash[:16],
        }
