"""Pydantic specs of the GGUF conversion adapter (no engine import, no side effects)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class GgufOptions(BaseModel):
    """What llama.cpp's converter is asked to write.

    Attributes:
        outtype: ``--outtype``: ``q8_0`` (bakeoff's default: llama.cpp's 8-bit blocks, written by
            the converter itself, the usual CPU serving choice that keeps a model's answers),
            ``f16``, ``bf16`` or ``f32`` (unquantized), ``auto`` (the converter picks f16 or bf16
            from the checkpoint's dtype).
    """

    model_config = ConfigDict(extra="forbid")

    outtype: Literal["q8_0", "f16", "bf16", "f32", "auto"] = "q8_0"


class GgufResult(BaseModel):
    """One conversion of a checkpoint to GGUF.

    Attributes:
        source, source_hash: the checkpoint folder and its fingerprint
            (:func:`adapters.ort_genai_export.cache.checkpoint_hash`).
        gguf: the written file; ``gguf_sha256`` its sha256, ``gguf_bytes`` its size.
        command: the exact converter command; ``versions`` the converter's packages.
        duration_s: the converter's wall time in seconds.
    """

    model_config = ConfigDict(extra="forbid")

    source: str
    source_hash: str
    architecture: str | None = None
    model_type: str | None = None
    options: GgufOptions
    cache_key: str
    gguf: str
    gguf_sha256: str
    gguf_bytes: int
    command: list[str]
    versions: dict[str, str] = Field(default_factory=dict)
    duration_s: float
    cached: bool = False
    created_at: str

    def notes(self) -> dict[str, str]:
        """Flat ``BackendInfo.notes`` entries for the verdict."""
        return {"gguf_converted_from": self.source, "gguf_convert_command": " ".join(self.command),
                "gguf_outtype": self.options.outtype, "gguf_convert_duration_s": str(self.duration_s),
                "gguf_convert_versions": ", ".join(f"{k}=={v}" for k, v in sorted(self.versions.items())),
                "gguf_convert_cached": str(self.cached), "source_hash": self.source_hash[:16]}
