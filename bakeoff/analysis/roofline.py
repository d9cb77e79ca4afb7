"""Roofline: the best decode tokens/s a GPU can give a model, to judge a measured sweep point.

A decode step of ``B`` sequences at context ``C`` must read the weights it uses once and the
KV cache of every sequence, and must do ``2 x active parameters`` FLOPs per token (plus
attention over the context). So, per sweep point:

- memory bound: ``B / ((weight bytes read per step + B * C * KV bytes per token) / bandwidth)``;
- compute bound: ``peak FLOP/s / (2 * active params + 4 * attention layers * C * q width)``;

and the point's bound is the smaller, named ``memory`` or ``compute``. For a mixture of
experts only the routed experts count: ``active params`` holds the ``k`` experts a token uses,
and the weights read per step hold the experts a batch of ``B`` tokens is expected to touch,
``E * (1 - (1 - k/E)^B)`` of ``E`` (uniform routing). The lm_head is read every step (tied
or not); the embedding table is not (a lookup of ``B`` rows). Prefill is ignored: the bound
is for decode, so measured/bound is a lower estimate of efficiency.

Peak figures are the vendors' datasheet numbers (dense bf16 Tensor Core TFLOP/s: the
sparsity figures halved; HBM/GDDR bandwidth), each with its source URL in :data:`GPUS`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

NO_GPU = "no known GPU"
DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2, "float8_e4m3fn": 1, "int8": 1}
TENSOR_CORE_DATASHEET = "https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet"
A100_DATASHEET = ("https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
                  "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf")


class GpuSpec(BaseModel):
    """Datasheet peaks of one GPU model.

    Attributes:
        name: the product name.
        pattern: regex matched (case-insensitive) against the device name NVML/torch report.
        mem_bandwidth_gb_s: peak memory bandwidth, GB/s (10^9 bytes/s).
        bf16_dense_tflops: peak dense bf16 Tensor Core TFLOP/s (without sparsity).
        memory_gb: memory size, GB.
        source: the datasheet the figures come from.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str
    pattern: str
    mem_bandwidth_gb_s: float
    bf16_dense_tflops: float
    memory_gb: float
    source: str


GPUS: list[GpuSpec] = [  # most specific patterns first
    GpuSpec(name="H200 NVL", pattern=r"H200.*NVL", mem_bandwidth_gb_s=4800, bf16_dense_tflops=835.5, memory_gb=141,
            source="https://www.nvidia.com/en-us/data-center/h200/"),
    GpuSpec(name="H200 SXM", pattern=r"H200", mem_bandwidth_gb_s=4800, bf16_dense_tflops=989.5, memory_gb=141,
            source="https://www.nvidia.com/en-us/data-center/h200/"),
    GpuSpec(name="H100 PCIe", pattern=r"H100.*PCIe", mem_bandwidth_gb_s=2000, bf16_dense_tflops=756.5, memory_gb=80,
            source=TENSOR_CORE_DATASHEET),
    GpuSpec(name="H100 SXM", pattern=r"H100", mem_bandwidth_gb_s=3350, bf16_dense_tflops=989.5, memory_gb=80,
            source=TENSOR_CORE_DATASHEET),
    GpuSpec(name="A100 80GB PCIe", pattern=r"A100.*80GB.*PCIe|A100.*PCIe.*80GB", mem_bandwidth_gb_s=1935,
            bf16_dense_tflops=312, memory_gb=80, source=A100_DATASHEET),
    GpuSpec(name="A100 80GB SXM", pattern=r"A100.*80GB", mem_bandwidth_gb_s=2039, bf16_dense_tflops=312, memory_gb=80,
            source=A100_DATASHEET),
    GpuSpec(name="A100 40GB", pattern=r"A100", mem_bandwidth_gb_s=1555, bf16_dense_tflops=312, memory_gb=40,
            source=A100_DATASHEET),
    GpuSpec(name="L40S", pattern=r"L40S", mem_bandwidth_gb_s=864, bf16_dense_tflops=362.05, memory_gb=48,
            source="https://resources.nvidia.com/en-us-l40s/l40s-datasheet-28413"),
    GpuSpec(name="A40", pattern=r"\bA40\b", mem_bandwidth_gb_s=696, bf16_dense_tflops=149.7, memory_gb=48,
            source="https://images.nvidia.com/content/Solutions/data-center/a40/nvidia-a40-datasheet.pdf"),
]


def find_gpu(device_name: str | None) -> GpuSpec | None:
    """The table entry for a device name (``NVIDIA H200``, ``NVIDIA A100-SXM4-80GB``), else None."""
    if not device_name:
        return None
    for g in GPUS:
        if re.search(g.pattern, device_name, re.IGNORECASE):
            return g
    return None


class ModelShape(BaseModel):
    """What the roofline needs of a model, in parameters and bytes.

    Attributes:
        dense_params: parameters read every decode step whatever the batch (attention, dense
            MLPs, shared experts, routers, norms, lm_head); embeddings excluded.
        expert_params: parameters of one routed expert summed over the MoE layers (0 if dense).
        num_experts: routed experts per MoE layer (0 if dense).
        experts_per_token: routed experts each token uses (k).
        total_params: every parameter, embeddings included.
        active_params_per_token: parameters one token's forward pass multiplies (no embeddings).
        kv_bytes_per_token: KV cache bytes one token of context holds (all attention layers).
        attn_layers: layers with a KV cache (full attention).
        q_width: attention heads x head dim.
        dtype_bytes: bytes per weight.
    """

    model_config = ConfigDict(extra="forbid")
    dense_params: int
    expert_params: int = 0
    num_experts: int = 0
    experts_per_token: int = 0
    total_params: int
    active_params_per_token: int
    kv_bytes_per_token: int
    attn_layers: int
    q_width: int
    dtype_bytes: int

    def weight_bytes_per_step(self, batch: int) -> float:
        """Bytes of weights one decode step of ``batch`` sequences reads (expected distinct experts)."""
        if not self.num_experts:
            return self.dense_params * self.dtype_bytes
        k, e = self.experts_per_token, self.num_experts
        touched = e * (1 - (1 - k / e) ** batch)
        return (self.dense_params + self.expert_params * touched) * self.dtype_bytes


MAX_LAYERS = 100_000  # no decoder has more; a config that says so is not one this counts


def shape_from_config(config: dict[str, Any], dtype: str | None = None) -> ModelShape:
    """Count a decoder's parameters and KV bytes from its Hugging Face ``config.json``.

    Covers Llama/Qwen/Mistral-style dense models and Qwen-MoE/Mixtral-style MoE (keys
    ``num_experts``/``num_local_experts``, ``num_experts_per_tok``, ``moe_intermediate_size``,
    ``shared_expert_intermediate_size``, ``decoder_sparse_step``, ``mlp_only_layers``); hybrid
    models' ``layer_types`` decide which layers hold a KV cache (linear-attention layers are
    counted like attention for weights). Multi-modal configs use their ``text_config``.

    Args:
        config: the parsed config.
        dtype: weights dtype actually served (``bfloat16``...); default: the config's.

    Raises:
        KeyError: a required key (``hidden_size``, ``num_hidden_layers``...) is missing.
        ValueError: ``num_hidden_layers`` is not a count from 1 to :data:`MAX_LAYERS`.
    """
    c = config.get("text_config") or config
    h, n_layers, vocab = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"]
    if not isinstance(n_layers, int) or not 0 < n_layers <= MAX_LAYERS:  # the loop below is one pass per layer
        raise ValueError(f"num_hidden_layers {n_layers!r} is not a layer count from 1 to {MAX_LAYERS:,}")
    heads = c["num_attention_heads"]
    kv_heads = c.get("num_key_value_heads") or heads
    hd = c.get("head_dim") or h // heads
    nbytes = _dtype_bytes(config, c, dtype)
    attn = h * heads * hd * 2 + h * kv_heads * hd * 2  # q, o + k, v
    dense, expert, n_exp, k = _layer_params(c, h, n_layers, attn)
    lm_head = vocab * h
    dense += lm_head + h
    embed = 0 if c.get("tie_word_embeddings", config.get("tie_word_embeddings")) else vocab * h
    attn_layers = _kv_cache_layers(c, n_layers)
    return ModelShape(dense_params=dense, expert_params=expert, num_experts=n_exp if expert else 0,
                      experts_per_token=k if expert else 0, total_params=dense + expert * (n_exp if expert else 0) + embed,
                      active_params_per_token=dense + expert * (k if expert else 0),
                      kv_bytes_per_token=2 * attn_layers * kv_heads * hd * nbytes, attn_layers=attn_layers,
                      q_width=heads * hd, dtype_bytes=nbytes)


def _dtype_bytes(config: dict[str, Any], c: dict[str, Any], dtype: str | None) -> int:
    """Bytes a weight: of the dtype served, else the (text) config's, else bfloat16's; 2 for one unknown."""
    dt = dtype if dtype and dtype != "auto" else (c.get("torch_dtype") or c.get("dtype") or config.get("torch_dtype")
                                                  or config.get("dtype") or "bfloat16")
    return DTYPE_BYTES.get(str(dt).replace("torch.", ""), 2)


def _moe_keys(c: dict[str, Any]) -> tuple:
    """``(routed experts, experts a token, expert FFN width, MoE layer step, MLP-only layers, leading dense
    layers, shared expert FFN width)`` of a config, read in that order (0 or None where it has none)."""
    n_exp = c.get("num_experts") or c.get("num_local_experts") or c.get("n_routed_experts") or 0
    k = c.get("num_experts_per_tok") or 0
    moe_ff = c.get("moe_intermediate_size") or c.get("intermediate_size")
    step = c.get("decoder_sparse_step") or 1
    mlp_only = set(c.get("mlp_only_layers") or [])
    first_dense = c.get("first_k_dense_replace") or 0
    shared = c.get("shared_expert_intermediate_size") or (c.get("n_shared_experts") or 0) * (moe_ff or 0)
    return n_exp, k, moe_ff, step, mlp_only, first_dense, shared


def _layer_params(c: dict[str, Any], h: int, n_layers: int, attn: int) -> tuple[int, int, int, int]:
    """``(dense params, one routed expert's params summed over the MoE layers, routed experts, experts a
    token)`` of the decoder layers: attention and norms in each, a router, shared expert and routed
    experts in a MoE layer, a dense MLP in the others."""
    n_exp, k, moe_ff, step, mlp_only, first_dense, shared = _moe_keys(c)
    dense = expert = 0
    for i in range(n_layers):
        dense += attn + 2 * h  # + two norms
        is_moe = n_exp and i not in mlp_only and i >= first_dense and (i + 1) % step == 0
        if is_moe:
            dense += h * n_exp + 3 * h * shared + (h if shared else 0)  # router (+ shared expert and its gate)
            expert += 3 * h * moe_ff
        else:
            dense += 3 * h * c["intermediate_size"]
    return dense, expert, n_exp, k


def _kv_cache_layers(c: dict[str, Any], n_layers: int) -> int:
    """Layers with a KV cache: the full-attention ones of ``layer_types``, else all."""
    types = c.get("layer_types")
    return sum(1 for t in types if "full" in t or t == "attention") if types else n_layers


def load_shape(model_path: str | Path, dtype: str | None = None) -> ModelShape | None:
    """:func:`shape_from_config` of a local checkpoint folder; None when it has no usable config."""
    p = Path(model_path) / "config.json"
    try:
        return shape_from_config(json.loads(p.read_text()), dtype)
    except (OSError, ValueError, KeyError, TypeError):
        return None


class Bound(BaseModel):
    """The roofline of one sweep point.

    Attributes:
        bound_tokens_per_s: best possible aggregate decode tokens/s.
        bound_kind: ``memory`` or ``compute``, whichever limits.
        memory_bound_tokens_per_s / compute_bound_tokens_per_s: both ceilings.
        batch: concurrent sequences; context_tokens: mean context length during decode.
    """

    model_config = ConfigDict(extra="forbid")
    bound_tokens_per_s: float
    bound_kind: Literal["memory", "compute"]
    memory_bound_tokens_per_s: float
    compute_bound_tokens_per_s: float
    batch: int
    context_tokens: float


def decode_bound(shape: ModelShape, gpu: GpuSpec, batch: int, context_tokens: float) -> Bound:
    """The best decode tokens/s of ``batch`` sequences at ``context_tokens`` on ``gpu``."""
    bytes_step = shape.weight_bytes_per_step(batch) + batch * context_tokens * shape.kv_bytes_per_token
    mem = batch / (bytes_step / (gpu.mem_bandwidth_gb_s * 1e9))
    flops_tok = 2 * shape.active_params_per_token + 4 * shape.attn_layers * context_tokens * shape.q_width
    comp = gpu.bf16_dense_tflops * 1e12 / flops_tok
    kind: Literal["memory", "compute"] = "memory" if mem <= comp else "compute"
    return Bound(bound_tokens_per_s=round(min(mem, comp), 1), bound_kind=kind,
                 memory_bound_tokens_per_s=round(mem, 1), compute_bound_tokens_per_s=round(comp, 1),
                 batch=batch, context_tokens=round(context_tokens, 1))


def sweep_roofline(points: list[dict[str, Any]], shape: ModelShape | None, device_name: str | None,
                   max_tokens: int) -> dict[str, Any]:
    """Roofline values of a throughput sweep's points.

    Args:
        points: sweep points (``sessions``, ``ok``, ``input_tokens``, ``output_tokens``,
            ``output_tokens_per_s``).
        shape: the model's shape (None: unknown config).
        device_name: the device the engine ran on (``NVIDIA H200``, ``cpu``).
        max_tokens: output tokens asked per request (context fallback).

    Returns:
        ``{"available": False, "reason": ...}`` without a known GPU or model shape, else
        ``{"available": True, "gpu", "source", "model": {...}, "points": [{sessions,
        bound_tokens_per_s, pct_of_bound, bound_kind, ...}]}``.
    """
    gpu = find_gpu(device_name)
    if gpu is None:
        return {"available": False, "reason": f"{NO_GPU} (device: {device_name or 'unknown'})"}
    if shape is None:
        return {"available": False, "reason": "model config not readable (not a local checkpoint with config.json)"}
    out = []
    for p in points:
        ok = p.get("ok") or 0
        inp = (p.get("input_tokens") or 0) / ok if ok else 0.0
        outp = (p.get("output_tokens") or 0) / ok if ok else float(max_tokens)
        b = decode_bound(shape, gpu, int(p["sessions"]), inp + outp / 2)
        measured = p.get("output_tokens_per_s")
        out.append({"sessions": p["sessions"], **b.model_dump(exclude={"batch"}),
                    "pct_of_bound": round(100 * measured / b.bound_tokens_per_s, 4) if measured else None})
    return {"available": True, "gpu": gpu.name, "source": gpu.source,
            "mem_bandwidth_gb_s": gpu.mem_bandwidth_gb_s, "bf16_dense_tflops": gpu.bf16_dense_tflops,
            "model": {"total_params": shape.total_params, "active_params_per_token": shape.active_params_per_token,
                      "kv_bytes_per_token": shape.kv_bytes_per_token, "dtype_bytes": shape.dtype_bytes},
            "points": out}
