"""Roofline bounds (bakeoff/analysis/roofline.py) on real architectures' configs."""

from __future__ import annotations

import pytest

from bakeoff.analysis.roofline import GPUS, decode_bound, find_gpu, shape_from_config, sweep_roofline

# Qwen3-1.7B's config.json (hub: Qwen/Qwen3-1.7B): 1.72 B parameters with tied embeddings.
QWEN3_1_7B = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 2048, "intermediate_size": 6144,
              "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
              "vocab_size": 151936, "tie_word_embeddings": True, "torch_dtype": "bfloat16"}
# Qwen3-30B-A3B's config.json: 30.5 B total, 3.3 B active.
QWEN3_30B_A3B = {"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 2048, "intermediate_size": 6144,
                 "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32,
                 "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936, "num_experts": 128,
                 "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [],
                 "tie_word_embeddings": False, "torch_dtype": "bfloat16"}


def test_gpu_names_match_the_table():
    assert find_gpu("NVIDIA H200").name == "H200 SXM"
    assert find_gpu("NVIDIA H200 NVL").name == "H200 NVL"
    assert find_gpu("NVIDIA H100 80GB HBM3").name == "H100 SXM"
    assert find_gpu("NVIDIA H100 PCIe").name == "H100 PCIe"
    assert find_gpu("NVIDIA A100-SXM4-80GB").name == "A100 80GB SXM"
    assert find_gpu("NVIDIA A100 80GB PCIe").name == "A100 80GB PCIe"
    assert find_gpu("NVIDIA A100-SXM4-40GB").name == "A100 40GB"
    assert find_gpu("NVIDIA L40S").name == "L40S"
    assert find_gpu("NVIDIA A40").name == "A40"
    assert find_gpu("cpu") is None and find_gpu(None) is None
    assert all(g.source.startswith("https://") for g in GPUS)


def test_dense_shape_counts_parameters_and_kv():
    s = shape_from_config(QWEN3_1_7B)
    assert s.total_params == pytest.approx(1.72e9, rel=0.02)
    assert s.kv_bytes_per_token == 2 * 28 * 8 * 128 * 2  # K and V, 28 layers, 8 KV heads, bf16
    assert s.num_experts == 0 and s.active_params_per_token == s.dense_params
    assert shape_from_config(QWEN3_1_7B, dtype="float32").dtype_bytes == 4


def test_moe_counts_only_active_experts():
    s = shape_from_config(QWEN3_30B_A3B)
    assert s.total_params == pytest.approx(30.5e9, rel=0.03)
    embed = 151936 * 2048  # Qwen's "3.3B active" counts the (untied) input embeddings, which a token does not multiply
    assert s.active_params_per_token + embed == pytest.approx(3.3e9, rel=0.03)
    # one token reads its 8 experts; a large batch touches (almost) all 128
    assert s.weight_bytes_per_step(1) < s.weight_bytes_per_step(64) <= s.total_params * 2


def test_bound_memory_at_small_batch_compute_at_large():
    s, h200 = shape_from_config(QWEN3_1_7B), find_gpu("NVIDIA H200")
    b1 = decode_bound(s, h200, 1, 256)
    assert b1.bound_kind == "memory"
    # 4.8 TB/s over ~3.4 GB of bf16 weights (lm_head included, embeddings not): ~1.4k tok/s
    assert 1200 < b1.bound_tokens_per_s < 1600
    big = decode_bound(s, h200, 4096, 16)
    assert big.bound_kind == "compute"
    assert big.bound_tokens_per_s == pytest.approx(989.5e12 / (2 * s.active_params_per_token + 4 * 28 * 16 * 2048),
                                                   rel=1e-3)


def test_sweep_roofline_on_gpu_and_cpu():
    pts = [{"sessions": 1, "ok": 2, "input_tokens": 200, "output_tokens": 64, "output_tokens_per_s": 15.0},
           {"sessions": 8, "ok": 16, "input_tokens": 1600, "output_tokens": 512, "output_tokens_per_s": 120.0}]
    s = shape_from_config(QWEN3_1_7B)
    r = sweep_roofline(pts, s, "NVIDIA H200", 32)
    assert r["available"] and r["gpu"] == "H200 SXM" and r["source"].startswith("https://")
    p1 = r["points"][0]
    assert p1["bound_kind"] == "memory" and p1["context_tokens"] == 116.0  # 100 prompt + 32/2 decoded
    assert p1["pct_of_bound"] == pytest.approx(100 * 15.0 / p1["bound_tokens_per_s"], rel=1e-2)
    cpu = sweep_roofline(pts, s, "cpu", 32)
    assert cpu == {"available": False, "reason": "no known GPU (device: cpu)"}
    assert "config" in sweep_roofline(pts, None, "NVIDIA H200", 32)["reason"]
