"""The source's MTP head, carried into the quantized checkpoint as stored.

transformers has no MTP module: loading a Qwen3.5 / Qwen3-Next / DeepSeek-V3 checkpoint drops
its ``mtp.*`` tensors (``_keys_to_ignore_on_load_unexpected``), so llm-compressor neither
quantizes nor saves them, and the quantized checkpoint has no head for
``speculative_config={"method": "mtp"}``. Released INT4 checkpoints put the head back as the
source stored it (BF16); this module does the same, byte for byte, from the safetensors
headers (no torch, no weight loaded into memory at once: a 35B checkpoint's head is copied
shard range by shard range).

Where the head goes: one more shard; the checkpoint is renamed to the sharded layout
(``model-0000i-of-0000N.safetensors`` and ``model.safetensors.index.json``) when it was one file.

Whether the exclusion list names the head is the caller's choice (``quantize_awq(mtp_ignore=)``):
a BF16 head that ``quantization_config.ignore`` does not cover is the released Qwen3.5/3.6-35B-A3B
INT4 checkpoint's defect (``bakeoff/analysis/checkpoint_layout.py``).
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

from bakeoff.analysis.checkpoint_layout import INDEX, MTP_PREFIXES, read_tensors

MTP_IGNORE = r"re:.*mtp\..*"
CHUNK = 64 * 2**20


def _header(path: Path) -> tuple[dict, int]:
    with path.open("rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        return json.loads(fh.read(n)), 8 + n


def _shards(folder: Path) -> list[Path]:
    if (folder / INDEX).is_file():
        wmap = json.loads((folder / INDEX).read_text()).get("weight_map") or {}
        return [folder / s for s in sorted(set(wmap.values()))]
    return sorted(folder.glob("*.safetensors"))


def dropped_mtp(src: Path, out: Path) -> list[str]:
    """Names of the source's MTP tensors that the output lacks."""
    have = {t.name for t in read_tensors(out)}
    return [t.name for t in read_tensors(src) if t.name.startswith(MTP_PREFIXES) and t.name not in have]


def _write_shard(src: Path, names: list[str], dest: Path) -> tuple[dict, int]:
    """Copies the named tensors of ``src``'s shards into one new safetensors file."""
    wanted, where = set(names), []
    for shard in _shards(src):
        head, base = _header(shard)
        where += [(n, shard, base, m) for n, m in head.items() if n in wanted]
    where.sort(key=lambda w: w[0])
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for n, _, _, m in where:
        size = m["data_offsets"][1] - m["data_offsets"][0]
        header[n] = {"dtype": m["dtype"], "shape": m["shape"], "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with dest.open("wb") as fh:
        fh.write(struct.pack("<Q", len(raw)) + raw)
        for _, shard, base, m in where:
            start, end = m["data_offsets"]
            with shard.open("rb") as fs:
                fs.seek(base + start)
                left = end - start
                while left:
                    chunk = fs.read(min(CHUNK, left))
                    fh.write(chunk)
                    left -= len(chunk)
    dtypes = {m["dtype"] for _, _, _, m in where}
    return {"dtypes": sorted(dtypes)}, offset


def carry_mtp(src: str | Path, out: str | Path, ignore: bool) -> dict:
    """Copies the MTP tensors transformers dropped from ``src`` into ``out`` (sharded layout).

    Args:
        src: the unquantized source checkpoint.
        out: the quantized checkpoint, as llm-compressor saved it.
        ignore: also append ``re:.*mtp\\..*`` to ``quantization_config.ignore`` (a consistent
            checkpoint); False leaves the list as the tool wrote it (the released layout).

    Returns:
        ``{}`` when the source has no MTP tensors, else ``{"tensors", "dtypes", "shard",
        "bytes", "ignore_pattern_added", "ignore"}``.
    """
    src, out = Path(src), Path(out)
    names = dropped_mtp(src, out)
    if not names:
        return {}
    shards = _shards(out)
    n = len(shards) + 1
    renamed = {s.name: f"model-{i:05d}-of-{n:05d}.safetensors" for i, s in enumerate(shards, 1)}
    new = out / f"model-{n:05d}-of-{n:05d}.safetensors"
    facts, size = _write_shard(src, names, new)
    wmap: dict[str, str] = {}
    for s in shards:
        head, _ = _header(s)
        wmap.update({k: renamed[s.name] for k in head if k != "__metadata__"})
        os.rename(s, out / renamed[s.name])
    wmap.update({k: new.name for k in names})
    total = sum((out / f).stat().st_size for f in set(wmap.values()))
    (out / INDEX).write_text(json.dumps({"metadata": {"total_size": total},
                                         "weight_map": dict(sorted(wmap.items()))}, indent=2) + "\n")
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    qc = cfg.get("quantization_config") or {}
    if ignore and MTP_IGNORE not in (qc.get("ignore") or []):
        qc["ignore"] = list(qc.get("ignore") or []) + [MTP_IGNORE]
        cfg["quantization_config"] = qc
        cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return {"tensors": len(names), **facts, "shard": new.name, "bytes": size, "ignore_pattern_added": ignore,
            "ignore": list(qc.get("ignore") or [])}
