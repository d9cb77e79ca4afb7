"""Capacity explained (issue 19, item 4): which layers hold a KV cache, bytes per token per layer
kind, and the KV ratio a dtype should give, judged against the ratio matrix twins measured."""

from __future__ import annotations

import pytest

from bakeoff.analysis.kv_layout import RATIO_TOLERANCE, judge_ratio, kv_layout, layer_kinds, predicted_ratio
from bakeoff.analysis.matrix import kv_capacity_ratio

# The shape of Qwen3.5-35B-A3B's text model: 40 layers, full attention every 4th, 2 KV heads of 256.
HYBRID = {"num_hidden_layers": 40, "full_attention_interval": 4, "hidden_size": 2048, "num_attention_heads": 16,
          "num_key_value_heads": 2, "head_dim": 256, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
          "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
          "torch_dtype": "bfloat16"}
# Qwen3-8B: 36 layers, all full attention, 8 KV heads of 128.
QWEN3 = {"num_hidden_layers": 36, "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
         "head_dim": 128, "torch_dtype": "bfloat16"}


def test_hybrid_holds_kv_in_every_fourth_layer():
    lay = kv_layout(HYBRID)
    assert lay["kv_layers"] == [3, 7, 11, 15, 19, 23, 27, 31, 35, 39] and lay["kv_layer_count"] == 10
    assert lay["layer_kinds"] == {"linear_attention": 30, "full_attention": 10} and lay["hybrid"]
    assert lay["bytes_per_token_per_layer"] == {"linear_attention": 0, "full_attention": 2 * 2 * 256 * 2}
    assert lay["kv_bytes_per_token"] == 10 * 2048  # a quarter of 40 attention layers' 81,920
    # conv window 3 x (2 x 16 x 128 + 32 x 128) + recurrent 32 x 128 x 128, in bf16
    assert lay["linear_state_bytes_per_sequence_per_layer"] == (3 * 8192 + 32 * 128 * 128) * 2
    assert "10 of 40 layers hold a KV cache" in lay["text"] and "20,480 bytes per token" in lay["text"]
    fp8 = kv_layout(HYBRID, "fp8")
    assert fp8["kv_bytes_per_token"] == 10 * 1024 and fp8["linear_state_bytes_per_sequence_per_layer"] == \
        lay["linear_state_bytes_per_sequence_per_layer"]  # kv_cache_dtype leaves the linear state alone
    assert predicted_ratio(HYBRID, "fp8") == 2.0 and predicted_ratio(HYBRID, "nvfp4") == 4.0


def test_layer_types_and_nested_text_config_agree_with_the_interval():
    listed = {**HYBRID, "full_attention_interval": None,
              "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 10}
    nested = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "text_config": HYBRID}
    assert layer_kinds(listed) == layer_kinds(HYBRID) == layer_kinds(nested)
    assert kv_layout(nested)["kv_bytes_per_token"] == kv_layout(listed)["kv_bytes_per_token"] == 20480


def test_plain_qwen3_holds_kv_in_every_layer():
    lay = kv_layout(QWEN3)
    assert lay["kv_layer_count"] == 36 and not lay["hybrid"] and lay["layer_kinds"] == {"full_attention": 36}
    assert lay["kv_bytes_per_token"] == 36 * 2 * 8 * 128 * 2 == 147_456  # 144 KiB per token
    assert lay["linear_state_bytes_per_sequence_per_layer"] is None
    assert predicted_ratio(QWEN3, "fp8") == 2.0 and predicted_ratio(QWEN3, "auto") == 1.0
    assert kv_layout({**QWEN3, "torch_dtype": None})["kv_bytes_per_token"] is None  # unknown element size


def test_judgement_of_measured_against_predicted():
    assert RATIO_TOLERANCE == 0.25
    assert judge_ratio(2.0, 2.0, True) == "as-predicted" and judge_ratio(1.55, 2.0, True) == "as-predicted"
    assert judge_ratio(1.3, 2.0, True) == "ineffective" and judge_ratio(1.0, 2.0, True) == "ineffective"
    assert judge_ratio(4.33, 2.0, True) == "above-prediction"  # the seed's hybrid on two A40s
    assert judge_ratio(1.0, 2.0, False) == "not-judged" and judge_ratio(1.0, None, True) == "not-judged"


def _info(tokens, gib, dtype="torch.bfloat16"):
    return {"backend": "vllm", "kv_cache_tokens": tokens, "kv_cache_memory_gib": gib, "notes": {"dtype": dtype}}


def _base(tokens, gib):
    return {"run_id": "run-auto", "path": "/x", "backend": "vllm", "options": {}, "backend_info": _info(tokens, gib)}


def test_matrix_twins_judged_with_the_hybrid_layout():
    ok = kv_capacity_ratio({"kv_cache_dtype": "fp8"}, _info(200_000, 2.0), "run-fp8", _base(100_000, 2.0), HYBRID)
    assert ok["predicted_ratio"] == 2.0 and ok["judgement"] == "as-predicted" and not ok["ineffective"]
    assert ok["kv_layout"]["kv_layer_count"] == 10 and ok["baseline_kv_bytes_per_token"] == 20480
    assert "10 of 40 layers hold a KV cache" in ok["text"] and "within 25%" in ok["text"]
    # a hybrid below its bytes' prediction is recorded (the state pages share the pool; blocks round) ...
    part = kv_capacity_ratio({"kv_cache_dtype": "fp8"}, _info(144_000, 2.0), "run-fp8", _base(100_000, 2.0), HYBRID)
    assert not part["ineffective"] and part["judgement"] == "below-prediction-hybrid"
    assert "recorded, not failed" in part["text"] and "no gain at all would fail" in part["text"]
    # ... but no gain at all fails, for a hybrid too; a dense model below the band fails
    none = kv_capacity_ratio({"kv_cache_dtype": "fp8"}, _info(100_500, 2.0), "run-fp8", _base(100_000, 2.0), HYBRID)
    assert none["ineffective"] and none["judgement"] == "ineffective"
    dense = kv_capacity_ratio({"kv_cache_dtype": "fp8"}, _info(130_000, 2.0), "run-fp8", _base(100_000, 2.0), QWEN3)
    assert dense["ineffective"] and dense["judgement"] == "ineffective" and "below it by more than 25%" in dense["text"]
    more = kv_capacity_ratio({"kv_cache_dtype": "fp8"}, _info(433_000, 2.0), "run-fp8", _base(100_000, 2.0), HYBRID)
    assert not more["ineffective"] and more["judgement"] == "above-prediction" and "recorded, not failed" in more["text"]
    base = kv_capacity_ratio({}, _info(100_000, 2.0), "run-auto", None, HYBRID)
    assert base["role"] == "baseline" and base["kv_layout"]["kv_bytes_per_token"] == 20480


@pytest.mark.parametrize("cfg", [HYBRID, QWEN3])
def test_stated_memory_predicts_tokens(cfg):
    lay = kv_layout(cfg)
    tokens_per_gib = 2**30 / lay["kv_bytes_per_token"]
    assert tokens_per_gib == pytest.approx(52_428.8 if cfg is HYBRID else 7_281.78, rel=1e-4)


def test_memory_only_statement_is_info_with_tokens_at_the_stated_precision(tmp_path):
    """OpenVINO GenAI states its KV cache in bytes: the check records the memory and the tokens it
    holds at the plugin's element type, and ends ``info`` (a computation), never ``pass``."""
    import json
    from types import SimpleNamespace

    from bakeoff.api.specs import BackendInfo
    from bakeoff.api.verdict import Verdict
    from bakeoff.host.artifacts import RunDir
    from bakeoff.host.run import RunContext
    from backends.openvino.backend import KV_ELEMENT_BYTES
    from evaluations.test_capacity import _memory_only

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"model_type": "qwen3", "num_hidden_layers": 3, "hidden_size": 128,
                                                  "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
                                                  "torch_dtype": "bfloat16"}))
    settings = SimpleNamespace(model=SimpleNamespace(path=str(ckpt), local=True))
    results = {}
    for precision in ("u8", "f16", "mystery"):
        rd = RunDir.create(tmp_path / precision, "openvino", "m")
        run = RunContext(rd, Verdict(run_id=rd.run_id, backend="openvino", model="m"))
        info = BackendInfo(backend="openvino", engine="openvino-genai", kv_cache_memory_gib=1.0,
                           notes={"kv_cache_precision": precision,
                                  **({"kv_cache_element_bytes": str(KV_ELEMENT_BYTES[precision])}
                                     if precision in KV_ELEMENT_BYTES else {})})
        with run.check("capacity.kv_cache", "ineffective-option") as c:
            _memory_only(c, info, settings)
        results[precision] = run.get("capacity.kv_cache")
    u8, f16, unknown = results["u8"], results["f16"], results["mystery"]
    assert u8.status == f16.status == unknown.status == "info"
    # 3 layers x K and V x 2 KV heads x 32 dims: 384 elements per token
    assert u8.values["kv_bytes_per_token"] == 384 and f16.values["kv_bytes_per_token"] == 768
    assert u8.values["derived_kv_cache_tokens"] == 2**30 // 384 == 2 * f16.values["derived_kv_cache_tokens"]
    assert unknown.values["derived_kv_cache_tokens"] is None and "not derived" in unknown.summary
    assert u8.values["kv_cache_tokens"] is None  # nothing claims the engine stated tokens
