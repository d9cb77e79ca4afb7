"""Export cache: one folder per (source checkpoint, options, builder version, metadata schema).

Key: sha256 of the checkpoint fingerprint (:func:`checkpoint_hash`), the export options, the
onnxruntime-genai version and the schema version of the metadata (:func:`schema_version` of
:class:`ExportResult`). Folder: ``bakeoff.host.envs.cache_root()/exports/<slug>-<key12>``; it
counts only once its ``export.json`` (the :class:`ExportResult`) exists, written last, and reads
as this bakeoff's result model (:func:`read_result`). The optimum exporters' caches
(``adapters/_optimum.py``) key and read their entries with the same two functions.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import struct
from pathlib import Path
from typing import Callable, TypeVar

from pydantic import BaseModel

from adapters.ort_genai_export.specs import ExportOptions, ExportResult
from bakeoff.host import envs

M = TypeVar("M", bound=BaseModel)

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


@functools.lru_cache(maxsize=None)
def schema_version(result_model: type[BaseModel]) -> str:
    """The schema version of an export's metadata: 12 hex characters of the sha256 of the result
    model's JSON schema (nested models included), its titles and descriptions left out.

    A field added, removed, renamed or retyped (``graph.input_shapes`` was one) changes it, a
    docstring does not. Being part of the cache key, an entry is found only by a bakeoff whose
    result model has the same fields: an older bakeoff never finds (and refuses, its models being
    ``extra="forbid"``) an entry a newer one wrote, and a newer one never takes an older entry
    that lacks a field it relies on. A change of a field's meaning alone must rename the field.
    """
    def strip(node):
        if isinstance(node, dict):
            return {k: strip(v) for k, v in node.items() if not (k in ("title", "description") and isinstance(v, str))}
        if isinstance(node, list):
            return [strip(v) for v in node]
        return node

    schema = json.dumps(strip(result_model.model_json_schema()), sort_keys=True)
    return hashlib.sha256(schema.encode()).hexdigest()[:12]


def read_result(path: Path, result_model: type[M], log: Callable[[str], None] = lambda s: None) -> M | None:
    """A cache entry's result file as ``result_model``; None when it is missing or does not read
    as this bakeoff's model (damaged, or written by a bakeoff whose schema hashed the same but
    whose fields differ): the export is then made again and replaces the entry, never refused."""
    try:
        res = result_model.model_validate_json(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:  # pydantic's ValidationError is a ValueError
        first = str(exc).strip().splitlines()[:3]
        log(f"cached export {path.parent} does not read as this bakeoff's {result_model.__name__} "
            f"({type(exc).__name__}: {' '.join(first)[:200]}); exporting again")
        return None
    return _where_it_is(res, path.parent, log)


def _where_it_is(res: M, entry: Path, log: Callable[[str], None]) -> M | None:
    """The entry's result as found where the entry is now (issue 36: a cache copied under another
    ``BAKEOFF_CACHE`` loaded the export from the old place, and with that gone the engine was
    blamed): ``output_dir`` is the entry's own ``model`` folder, and every file its ``files``
    table lists must be there at its recorded size (a copy cut off, a file removed: None, and the
    export is made again, saying why). Sizes, not hashes: hashing a GB export on every use costs
    more than the truncation it would add to catch."""
    here = entry / "model"
    if getattr(res, "output_dir", None) not in (None, str(here)):
        log(f"cached export {entry}: recorded at {res.output_dir}, used where it is now")
        res = res.model_copy(update={"output_dir": str(here)})
    files = getattr(res, "files", None) or {}
    hurt = []
    for name, size in files.items():
        try:
            got = (here / name).stat().st_size
        except OSError:
            hurt.append(f"{name} is missing")
            continue
        if got != size:
            hurt.append(f"{name} holds {got:,} bytes, recorded {size:,}")
    if hurt:
        log(f"cached export {entry} is damaged ({'; '.join(hurt[:3])}); exporting again")
        return None
    return res


def cache_key(source_hash: str, options: ExportOptions, builder_version: str, schema: str | None = None) -> str:
    """sha256 hex of what determines an export's content and how its metadata reads (``schema``:
    :func:`schema_version` of :class:`ExportResult` unless given)."""
    blob = json.dumps({"source": source_hash, "options": options.model_dump(mode="json"),
                       "builder": builder_version, "schema": schema or schema_version(ExportResult)}, sort_keys=True)
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
