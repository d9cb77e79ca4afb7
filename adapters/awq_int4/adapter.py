"""The ``awq-int4`` adapter: llm-compressor's AWQ W4A16 as compressed-tensors (:func:`quantize_awq`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from pydantic import Field

from adapters.awq_int4 import env_spec, quantize_awq
from adapters.base import Adapter
from bakeoff.api.specs import Spec


class AwqOptions(Spec):
    """Calibration of the AWQ pass.

    Attributes:
        num_samples: calibration samples.
        max_seq_length: tokens per calibration sample.
        mtp_as_released: leave an MTP head out of the ignore list (the released Qwen3.5 INT4
            layout; default: named, so that engines build it unquantized).
    """

    num_samples: int = Field(64, ge=1)
    max_seq_length: int = Field(256, ge=8)
    mtp_as_released: bool = False


class AwqInt4Adapter(Adapter):
    """W4A16 (AWQ, asymmetric, group 128, lm_head left out) for vLLM."""

    name = "awq-int4"
    Options = AwqOptions

    @classmethod
    def env_spec(cls):
        return env_spec()

    def run(self, source: str | Path, out: Path, log: Callable[[str], None] = print) -> dict[str, Any]:
        res = quantize_awq(source, out / "model", num_samples=self.options.num_samples,
                           max_seq_length=self.options.max_seq_length, log=log,
                           mtp_as_released=self.options.mtp_as_released)
        return {"duration_s": res.duration_s, "scheme": res.scheme, "device": res.device}
