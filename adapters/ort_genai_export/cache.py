"""Export cache: one folder per (source checkpoint, options, builder version).

Key: sha256 of the checkpoint fingerprint (:func:`checkpoint_hash`), the export options and
the onnxruntime-genai version. Folder: ``bakeoff.host.envs.cache_root()/exports/<slug>-<key12>``;
it counts only once its ``export.json`` (the :class:`ExportResult`) exists, written last.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
from pathlib import Path

from adapters.ort_genai_export.specs import ExportOptions
from bakeoff.host import envs

# Small files hashed by content; weight files by name, size, mtime and safetensors header.
CONTENT_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "quantize_config.json")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
RESULT_FILE = "export.json"


def _safetensors_header(path: Path) -> bytes:
    """The JSON header of a safetensors file (tensor names, dtypes, shapes, offsets), b'' if unreadable."""
    try:
        with open(path, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            return fh.read(min(n, 64 * 2**20))
    except (OSError, struct.error):
        return b""


def checkpoint_hash(model_path: str | Path) -> str:
    """Fingerprint of a Hugging Face checkpoint folder (sha256 hex).

    Hashes the content of ``config.json`` and the tokenizer/generation files, and for each
    weight file its name, size in bytes, mtime in ns and (safetensors) its header. Cheap on
    multi-GB checkpoints; a rewritten weight file changes its mtime.

    Args:
        model_path: the checkpoint folder.

    Returns:
        64 hex characters.
    """
    root = Path(model_path)
    h = hashlib.sha256()
    for name in CONTENT_FILES:
        p = root / name
        if p.is_file():
            h.update(name.encode() + b"\0" + hashlib.sha256(p.read_bytes()).digest())
    for p in sorted(root.iterdir()):
        if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES):
            st = p.stat()
            h.update(f"{p.name}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
            if p.suffix == ".safetensors":
                h.update(hashlib.sha256(_safetensors_header(p)).digest())
    return h.hexdigest()


def cache_key(source_hash: str, options: ExportOptions, builder_version: str) -> str:
    """sha256 hex of what determines an export's content."""
    blob = json.dumps({"source": source_hash, "options": options.model_dump(mode="json"),
                       "builder": builder_version}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def export_dir(model_path: str | Path, options: ExportOptions, key: str) -> Path:
    """``<cache>/exports/<checkpoint name>-<precision>-<ep>[-paged]-<key12>``."""
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", Path(model_path).resolve().name)[:48] or "model"
    paged = "-paged" if options.paged_attention else ""
    return envs.cache_root() / "exports" / f"{slug}-{options.precision}-{options.execution_provider}{paged}-{key[:12]}"


def folder_size(folder: Path) -> tuple[int, dict[str, int]]:
    """Total bytes and ``{relative name: bytes}`` of every file under ``folder``."""
    files: dict[str, int] = {}
    for dirpath, _dirs, names in os.walk(folder):
        for n in names:
            p = Path(dirpath) / n
            files[str(p.relative_to(folder))] = p.stat().st_size
    return sum(files.values()), dict(sorted(files.items()))
