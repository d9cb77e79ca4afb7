"""Pydantic specs of the OpenVINO export adapter (no engine import, no side effects)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid")


class OpenVinoExportOptions(_Spec):
    """What ``optimum-cli export openvino`` is asked to produce (optimum-intel 2.2.0's CLI).

    Attributes:
        weight_format: ``--weight-format``: ``fp32``/``fp16`` keep float weights (fp16
            compressed IR); ``int8``/``int4`` compress weights with NNCF (a compression report
            is recorded).
        group_size: ``--group-size`` of int4 compression (optimum's default 128; -1 per
            channel); must divide the hidden size.
        ratio: ``--ratio``: share of layers in int4, the rest int8 (optimum default 1.0).
        sym: ``--sym``: symmetric int4/int8 compression (optimum default asymmetric).
        task: ``--task``; ``text-generation-with-past`` exports the stateful KV-cache model
            OpenVINO GenAI serves.
    """

    weight_format: Literal["fp32", "fp16", "int8", "int4"] = "fp16"
    group_size: int | None = Field(None, ge=-1)
    ratio: float | None = Field(None, gt=0, le=1)
    sym: bool = False
    task: Literal["text-generation-with-past"] = "text-generation-with-past"

    @model_validator(mode="after")
    def _only_options_the_format_uses(self) -> "OpenVinoExportOptions":
        """optimum-intel 2.2.0 ignores ``--group-size``/``--ratio`` unless int4 (int8 forces
        ratio 1.0, group -1) and ``--sym`` for float formats: an option it would drop silently
        is refused, so the options (and the export cache key) never claim a compression that
        did not happen."""
        if self.group_size == 0:
            raise ValueError("group_size 0: pass a positive group, or -1 for per-channel")
        unused = [n for n, v in (("group_size", self.group_size), ("ratio", self.ratio)) if v is not None]
        if unused and self.weight_format != "int4":
            raise ValueError(f"{', '.join(unused)} apply to weight_format int4 only (got {self.weight_format})")
        if self.sym and self.weight_format not in ("int4", "int8"):
            raise ValueError(f"sym applies to int4/int8 compression only (got {self.weight_format})")
        return self

    def cli_args(self) -> list[str]:
        """The options as ``optimum-cli export openvino`` arguments."""
        args = ["--task", self.task, "--weight-format", self.weight_format]
        if self.group_size is not None:
            args += ["--group-size", str(self.group_size)]
        if self.ratio is not None:
            args += ["--ratio", str(self.ratio)]
        if self.sym:
            args.append("--sym")
        return args


class OpenVinoExportResult(_Spec):
    """One export of a checkpoint to OpenVINO IR.

    Attributes:
        source: the source checkpoint folder.
        source_hash: fingerprint of the checkpoint (config + weight files), sha256 hex.
        architecture: ``config.architectures[0]``; model_type: ``config.model_type``.
        options: what was asked.
        cache_key: sha256 of source hash + options + the environment's pins + the metadata's schema version.
        output_dir: the IR folder (``openvino_model.xml/.bin``, tokenizer and detokenizer IR).
        command: the exact exporter command line.
        versions: package versions of the export environment.
        duration_s: exporter wall time in seconds (of the original export when cached).
        output_bytes: total size of the IR folder in bytes; files: ``{name: bytes}``.
        compression: NNCF's bitwidth distribution as it printed it (``int8``/``int4``; empty
            for float formats) and the weight precisions observed in the IR.
        ir_ops: ``{op type: count}`` of the IR (``openvino.Core().read_model``).
        cached: True when this call reused an earlier export.
        created_at: UTC time of the export.
    """

    source: str
    source_hash: str
    architecture: str | None = None
    model_type: str | None = None
    options: OpenVinoExportOptions
    cache_key: str
    output_dir: str
    command: list[str]
    versions: dict[str, str] = Field(default_factory=dict)
    duration_s: float
    output_bytes: int
    files: dict[str, int] = Field(default_factory=dict)
    compression: dict = Field(default_factory=dict)
    ir_ops: dict[str, int] = Field(default_factory=dict)
    cached: bool = False
    created_at: str

    def notes(self) -> dict[str, str]:
        """Flat ``BackendInfo.notes`` entries for the verdict."""
        weights = self.compression.get("ir_weight_types") or {}
        return {
            "export_command": " ".join(self.command),
            "export_weight_format": self.options.weight_format,
            "export_weight_types": ", ".join(f"{k}={v}" for k, v in weights.items()),
            "export_compression_report": self.compression.get("report", "")[:2000],
            "export_size_bytes": str(self.output_bytes),
            "export_duration_s": str(self.duration_s),
            "export_versions": ", ".join(f"{k}=={v}" for k, v in sorted(self.versions.items())),
            "export_cached": str(self.cached),
            "export_dir": self.output_dir,
            "source_hash": self.source_hash[:16],
        }
