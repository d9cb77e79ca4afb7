"""The checkpoint's own tensors against its ``quantization_config``, read from safetensors headers.

A quantized checkpoint states twice which modules are quantized: in its tensors (a
``weight_packed`` / ``qweight`` int tensor, or a plain BF16 ``weight``) and in its config's
exclusion list (compressed-tensors ``ignore``, AWQ ``modules_to_not_convert``, GPTQ ``dynamic``
``-:`` rules, ModelOpt ``exclude_modules``). An engine builds each layer from the config and
then loads the tensors into it: where the two disagree, the layer does not load. The released
Qwen3.5/3.6-35B-A3B INT4 checkpoint is the case this module exists for: its 785 ``mtp.*``
tensors are BF16 while ``quantization_config.ignore`` has no pattern covering them, so vLLM
builds the MTP block with the target's W4A16 config and ``speculative_config={"method":"mtp"}``
fails to load it (public reports of the same class: a randomly initialised MTP head, 0%
acceptance, no crash). ``ignore += "re:.*mtp\\..*"`` fixes it.

What is read: ``model.safetensors.index.json`` (``weight_map``) and each shard's header (the
8-byte length and the JSON that follows it; tensor names, dtypes, shapes). No weight is read,
so a 35B checkpoint is checked in well under a second. How an engine decides that a module is
excluded is the engine's knowledge and lives in its folder (``backends/vllm/preflight.py``
``checkpoint_rule``); this module only applies the engine's matcher to the tensors.

This module imports no engine.

Example:
    >>> tensors = read_tensors("/models/qwen3.5-35b-a3b-int4")
    >>> f = check_mtp_exclusion(tensors, excluded=lambda m: False, patch="quantization_config.ignore+=re:.*mtp\\\\..*",
    ...                         source="...", how="compressed-tensors ignore")
    >>> f.status, f.uncovered_tensors, f.patch
    ('defect', 785, 'quantization_config.ignore+=re:.*mtp\\\\..*')
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any, Callable, Literal

from pydantic import Field

from bakeoff.api.specs import Spec

INDEX = "model.safetensors.index.json"
FLOAT_DTYPES = {"BF16", "F16", "F32", "F64"}  # stored unquantized (F8_* is a quantized format)
# Tensor-name suffixes that only a quantized layer stores (compressed-tensors pack-quantized,
# AutoAWQ/GPTQ, FP8/NVFP4 scales).
QUANT_SUFFIXES = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx",
                  "weight_global_scale", "weight_scale_inv", "qweight", "qzeros", "scales", "g_idx")
MTP_PREFIXES = ("mtp.", "model.mtp.")  # Qwen3.5 / Qwen3-Next MTP heads (vllm/model_executor/models/qwen3_5_mtp.py)
HEADER_MAX_BYTES = 100 * 2**20  # a safetensors header is JSON; beyond this the file is not one
EXAMPLES = 5


class TensorInfo(Spec):
    """One tensor as a safetensors header states it (``dtype`` None when only the index names it)."""

    name: str
    dtype: str | None = None
    shape: list[int] = Field(default_factory=list)


class LayoutError(Exception):
    """A safetensors file or index that cannot be read as one (the finding says so; no crash)."""


def _header(path: Path) -> dict[str, Any]:
    with path.open("rb") as fh:
        raw = fh.read(8)
        if len(raw) != 8:
            raise LayoutError(f"{path.name}: shorter than a safetensors header")
        (n,) = struct.unpack("<Q", raw)
        if n > HEADER_MAX_BYTES:
            raise LayoutError(f"{path.name}: header length {n} bytes: not a safetensors file")
        try:
            head = json.loads(fh.read(n))
        except ValueError as exc:
            raise LayoutError(f"{path.name}: unreadable safetensors header ({exc.__class__.__name__})") from None
    if not isinstance(head, dict):
        raise LayoutError(f"{path.name}: safetensors header is not a JSON object")
    return head


def read_tensors(model_path: str | Path) -> list[TensorInfo]:
    """Every tensor of a local checkpoint, from headers only.

    Reads ``model.safetensors.index.json`` when present (shards it names but that are absent
    give names without dtypes), else every ``*.safetensors`` file of the folder.

    Raises:
        LayoutError: no safetensors file, or one that is not safetensors.
    """
    root = Path(model_path)
    names: dict[str, TensorInfo] = {}
    shards: list[Path]
    if (root / INDEX).is_file():
        try:
            wmap = json.loads((root / INDEX).read_text()).get("weight_map") or {}
        except (OSError, ValueError, AttributeError) as exc:
            raise LayoutError(f"{INDEX}: unreadable ({exc.__class__.__name__})") from None
        names = {k: TensorInfo(name=k) for k in wmap}
        shards = [root / s for s in sorted(set(wmap.values())) if (root / s).is_file()]
    else:
        shards = sorted(root.glob("*.safetensors"))
    if not shards and not names:
        raise LayoutError(f"no safetensors files in {root}")
    for shard in shards:
        for name, meta in _header(shard).items():
            if name != "__metadata__" and isinstance(meta, dict):
                names[name] = TensorInfo(name=name, dtype=meta.get("dtype"), shape=list(meta.get("shape") or []))
    return sorted(names.values(), key=lambda t: t.name)


def truncated_files(model_path: str | Path) -> list[str]:
    """The checkpoint's safetensors files that are shorter than their own headers say (a copy cut
    off, a download stopped), each as one line naming the file and both sizes; [] when every file
    is whole or the folder holds none (headers only: no weight is read).

    A file whose header cannot be read is named too (it is not a whole safetensors file)."""
    root = Path(model_path)
    out = []
    for shard in sorted(root.glob("*.safetensors")):
        try:
            size = shard.stat().st_size
            with shard.open("rb") as fh:
                raw = fh.read(8)
            head = _header(shard)
        except (OSError, LayoutError) as exc:
            out.append(f"{shard.name}: {exc}")
            continue
        n = struct.unpack("<Q", raw)[0]
        ends = [m["data_offsets"][1] for k, m in head.items() if k != "__metadata__" and isinstance(m, dict)
                and isinstance(m.get("data_offsets"), list) and len(m["data_offsets"]) == 2
                and isinstance(m["data_offsets"][1], int)]
        want = 8 + n + max(ends, default=0)
        if size < want:
            out.append(f"{shard.name} is truncated: its header describes {want:,} bytes, the file holds {size:,}")
    return out


def module_of(tensor: str) -> str:
    """``mtp.layers.0.mlp.experts.3.gate_proj.weight_packed`` -> ``mtp.layers.0.mlp.experts.3.gate_proj``."""
    return tensor.rsplit(".", 1)[0]


def is_quantized_tensor(t: TensorInfo) -> bool:
    """A tensor only a quantized layer stores (packed weights, scales, zero points), or a
    weight stored in a non-float dtype."""
    leaf = t.name.rsplit(".", 1)[-1]
    return leaf in QUANT_SUFFIXES or (leaf == "weight" and t.dtype is not None and t.dtype not in FLOAT_DTYPES)


def is_float_linear_weight(t: TensorInfo) -> bool:
    """A ``.weight`` of two or more dimensions in a float dtype: a layer stored unquantized
    (norms are 1-D and never quantized; embeddings are not Linear layers)."""
    return (t.name.endswith(".weight") and t.dtype in FLOAT_DTYPES and len(t.shape) >= 2
            and "embed" not in t.name and "norm" not in t.name)


class MtpFinding(Spec):
    """What the checkpoint's MTP head and its exclusion list say to one engine.

    Attributes:
        status: ``defect`` (float MTP layers the exclusion list does not cover, or quantized
            ones it does), ``consistent``, ``no-mtp`` (no MTP tensors), ``unreadable``.
        how: the exclusion list the engine reads, e.g. ``compressed-tensors ignore``.
        mtp_tensors: tensors under an MTP prefix.
        uncovered_tensors: float MTP weights whose layer the engine would build quantized.
        uncovered_examples: the first few of them.
        ignored_quantized_tensors: quantized MTP tensors whose layer the engine would build
            unquantized (the opposite mismatch).
        ignored_quantized_examples: the first few of them.
        patch: the checkpoint patch that fixes it (``adapters/checkpoint_patches.py`` syntax),
            None when none is known.
        reason: one line.
        source: the engine source file whose matching rule was applied.
    """

    status: Literal["defect", "consistent", "no-mtp", "unreadable"]
    how: str = ""
    mtp_tensors: int = 0
    uncovered_tensors: int = 0
    uncovered_examples: list[str] = Field(default_factory=list)
    ignored_quantized_tensors: int = 0
    ignored_quantized_examples: list[str] = Field(default_factory=list)
    patch: str | None = None
    reason: str
    source: str = ""


def check_mtp_exclusion(tensors: list[TensorInfo], excluded: Callable[[str], bool], patch: str | None,
                        source: str, how: str) -> MtpFinding:
    """Compare the MTP head's stored precision with what the engine's exclusion rule builds.

    Args:
        tensors: :func:`read_tensors` of the checkpoint.
        excluded: the engine's rule: True when it builds the layer (module name, as in the
            checkpoint) unquantized.
        patch: the fix to name when float layers are not excluded.
        source: the engine file whose rule ``excluded`` implements.
        how: the config key the engine reads (for the message).
    """
    mtp = [t for t in tensors if t.name.startswith(MTP_PREFIXES)]
    base = {"how": how, "mtp_tensors": len(mtp), "source": source}
    if not mtp:
        return MtpFinding(status="no-mtp", reason="the checkpoint has no MTP tensors", **base)
    quantized_modules = {module_of(t.name) for t in mtp if is_quantized_tensor(t)}
    uncovered = [t.name for t in mtp if is_float_linear_weight(t) and module_of(t.name) not in quantized_modules
                 and not excluded(module_of(t.name))]
    wrongly = [t.name for t in mtp if is_quantized_tensor(t) and excluded(module_of(t.name))]
    base.update(uncovered_tensors=len(uncovered), uncovered_examples=uncovered[:EXAMPLES],
                ignored_quantized_tensors=len(wrongly), ignored_quantized_examples=wrongly[:EXAMPLES])
    if not uncovered and not wrongly:
        return MtpFinding(status="consistent", reason=(
            f"the {len(mtp)} MTP tensors agree with {how}: float layers are excluded, quantized ones are not"), **base)
    parts = []
    if uncovered:
        parts.append(f"{len(uncovered)} MTP weights are stored unquantized ({mtp_dtype(mtp, uncovered)}) but {how} "
                     f"has no pattern covering them (e.g. {', '.join(uncovered[:3])}): the engine builds the MTP "
                     "block with the target's quantization config and cannot load them (or, as public reports "
                     "show, runs a randomly initialised MTP head with 0% acceptance)")
    if wrongly:
        parts.append(f"{len(wrongly)} MTP tensors are quantized but {how} excludes their layers "
                     f"(e.g. {', '.join(wrongly[:3])}): the engine builds them unquantized and cannot load them")
    fix = f"; fix: --patch '{patch}'" if patch and uncovered else ""
    return MtpFinding(status="defect", patch=patch if uncovered else None, reason="; ".join(parts) + fix, **base)


def mtp_dtype(mtp: list[TensorInfo], names: list[str]) -> str:
    """The dtypes of the named tensors, e.g. ``BF16``."""
    wanted = set(names)
    return "/".join(sorted({t.dtype or "?" for t in mtp if t.name in wanted}))


def mtp_requested(options: dict[str, Any]) -> bool:
    """Whether the run's options ask for MTP speculative decoding (``speculative_config``
    whose ``method`` names MTP: ``mtp``, or the older ``qwen3_next_mtp``, ``deepseek_mtp``...)."""
    spec = options.get("speculative_config")
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except ValueError:
            return "mtp" in spec.lower()
    return isinstance(spec, dict) and "mtp" in str(spec.get("method") or "").lower()


def unreadable(exc: LayoutError, how: str, source: str) -> MtpFinding:
    """The finding for a checkpoint whose safetensors cannot be read (the engine decides)."""
    return MtpFinding(status="unreadable", how=how, source=source, reason=f"MTP layout not checked: {exc}")


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5")
# Slack of the config-against-weights bound: the config's parameters, counted low (below) and stored at
# 4 bits, may exceed the weight files this many times (plus FIXED_SLACK_BYTES) before the config is called
# inconsistent: a real checkpoint of any layout stays far inside it.
CONFIG_WEIGHTS_SLACK = 8
FIXED_SLACK_BYTES = 256 * 2**20


def _positive(c: dict, *keys: str) -> int | None:
    for k in keys:
        v = c.get(k)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def config_beyond_weights(model_path: str | Path, config: dict) -> str | None:
    """A ``config.json`` that describes far more model than the folder's weight files hold
    (``num_hidden_layers: 10**9`` on a small checkpoint: the engine allocated for minutes before its
    start timeout, issue 36), as one line; None when consistent or not checkable (no weight files).

    The bound, in closed form (no loop over layers): at least ``hidden_size^2`` parameters per layer
    (every decoder layer has an output projection at least that large) plus one ``vocab x hidden``
    embedding, at 4 bits each, against :data:`CONFIG_WEIGHTS_SLACK` times the weight files' bytes
    plus :data:`FIXED_SLACK_BYTES`."""
    c = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    h, layers, vocab = _positive(c, "hidden_size", "d_model"), _positive(c, "num_hidden_layers", "n_layer"), \
        _positive(c, "vocab_size")
    if h is None or layers is None:
        return None
    try:
        stored = sum(p.stat().st_size for p in Path(model_path).iterdir() if p.name.endswith(WEIGHT_SUFFIXES))
    except OSError:
        return None
    if not stored:
        return None
    least_bytes = (layers * h * h + (vocab or 0) * h) / 2
    if least_bytes <= CONFIG_WEIGHTS_SLACK * stored + FIXED_SLACK_BYTES:
        return None
    return (f"config.json describes at least {least_bytes * 2:,.0f} parameters (num_hidden_layers={layers:,}, "
            f"hidden_size={h:,}), {least_bytes / 2**30:,.1f} GiB even at 4 bits, but the weight files hold "
            f"{stored / 2**30:,.3f} GiB: the config does not describe these weights")
