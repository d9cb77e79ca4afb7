"""The ``gguf`` adapter: llama.cpp's converter writes one GGUF file of a checkpoint, copied out."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Callable

from adapters.base import Adapter
from adapters.gguf_convert.build import GGUF_FILE, convert
from adapters.gguf_convert.env import env_spec
from adapters.gguf_convert.specs import GgufOptions


class GgufConvertAdapter(Adapter):
    """``convert_hf_to_gguf SRC --outtype T`` (:func:`convert`)."""

    name = "gguf"
    Options = GgufOptions

    @classmethod
    def env_spec(cls):
        return env_spec()

    def run(self, source: str | Path, out: Path, log: Callable[[str], None] = print) -> dict[str, Any]:
        res = convert(source, self.options, log=log)
        out.mkdir(parents=True, exist_ok=True)
        shutil.copy2(res.gguf, out / GGUF_FILE)
        return {"cache_dir": str(Path(res.gguf).parent), "duration_s": res.duration_s, "output_bytes": res.gguf_bytes,
                "gguf_sha256": res.gguf_sha256, "outtype": res.options.outtype, "cached": res.cached}
