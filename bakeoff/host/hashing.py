"""File digests: the one sha256 reader of the shipped fixtures, the packaged models, GGUF files and
conversions (each records or checks files by it)."""

from __future__ import annotations

import hashlib
from pathlib import Path


def sha256_file(path: str | Path, block_bytes: int = 1 << 20) -> str:
    """The sha256 (hex) of a file's bytes, read in ``block_bytes`` blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(block_bytes), b""):
            h.update(block)
    return h.hexdigest()
