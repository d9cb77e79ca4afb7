"""The MTP head in the quantized checkpoint: what llm-compressor did with it, and the released layout.

transformers has no MTP module: loading a Qwen3.5 / Qwen3-Next checkpoint drops its ``mtp.*``
tensors (``_keys_to_ignore_on_load_unexpected``), so llm-compressor neither calibrates nor
quantizes them. compressed-tensors 0.19 (llm-compressor 0.14.0.1's save path,
``compressed_tensors/utils/mtp.py save_mtp_tensors_to_checkpoint``, called when the config states
``mtp_num_hidden_layers``) copies them from the source as stored into ``model_mtp.safetensors``,
indexes that shard and appends ``re:^mtp.*`` to ``quantization_config.ignore``: a consistent
checkpoint (seen 2026-12-02 on ``tiny-qwen3.5-moe``).

The released Qwen3.5/3.6-35B-A3B INT4 checkpoint has the same BF16 head but no ``mtp`` pattern in
its ignore list, and vLLM's MTP fails to load it until patched. ``as_released=True`` reproduces
that layout by removing the pattern, and records what it removed.
"""

from __future__ import annotations

import json
from pathlib import Path

from bakeoff.analysis.checkpoint_layout import INDEX, MTP_PREFIXES, read_tensors


def _mtp_patterns(ignore: list) -> list[str]:
    return [str(p) for p in ignore if "mtp" in str(p)]


def mtp_record(src: str | Path, out: str | Path, as_released: bool) -> dict:
    """The output's MTP head against the source's, and its ignore patterns.

    Args:
        src: the unquantized source checkpoint.
        out: the quantized checkpoint llm-compressor saved.
        as_released: remove the ignore patterns that name the head (the released layout).

    Returns:
        ``{}`` when the source has no MTP tensors, else ``{"source_tensors", "tensors",
        "dtypes", "shards", "ignore_patterns", "removed_from_ignore"}``.
    """
    src, out = Path(src), Path(out)
    n_src = sum(t.name.startswith(MTP_PREFIXES) for t in read_tensors(src))
    if not n_src:
        return {}
    head = [t for t in read_tensors(out) if t.name.startswith(MTP_PREFIXES)]
    shards: set[str] = set()
    if (out / INDEX).is_file():
        wmap = json.loads((out / INDEX).read_text()).get("weight_map") or {}
        shards = {wmap[t.name] for t in head if t.name in wmap}
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    qc = cfg.get("quantization_config") or {}
    ignore = list(qc.get("ignore") or [])
    removed: list[str] = []
    if as_released and _mtp_patterns(ignore):
        removed = _mtp_patterns(ignore)
        qc["ignore"] = ignore = [p for p in ignore if p not in removed]
        cfg["quantization_config"] = qc
        cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return {"source_tensors": n_src, "tensors": len(head), "dtypes": sorted({t.dtype or "?" for t in head}),
            "shards": sorted(shards), "ignore_patterns": _mtp_patterns(ignore), "removed_from_ignore": removed}
