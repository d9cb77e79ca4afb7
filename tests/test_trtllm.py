"""TensorRT-LLM backend.

TensorRT-LLM cannot run here (no NVIDIA GPU), so:
- the availability probe is tested for real (no fake): it must end ``unavailable`` with the
  nvidia-smi output / the import error as evidence;
- everything up to the engine call is tested with the FAKE ``tensorrt_llm`` of
  ``tests/fakes/`` on the worker child's PYTHONPATH: construction arguments, sampling
  arguments, and the handling of cumulative streaming outputs (``text_diff``).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import pytest

from backends import resolve
from backends.trtllm.backend import TrtllmBackend
from bakeoff.host import envs
from bakeoff.api.errors import EngineFailure, UserError
from bakeoff.api.specs import BackendConfig, GenerationRequest

FAKES = Path(__file__).parent / "fakes"
W4A16 = {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
         "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None,
                                       "weights": {"num_bits": 4, "type": "int", "strategy": "group",
                                                   "group_size": 128, "symmetric": False}}}}


def _model(tmp_path, qc=None) -> str:
    d = tmp_path / "model"
    d.mkdir(exist_ok=True)
    cfg = {"architectures": ["Qwen3ForCausalLM"], "torch_dtype": "bfloat16"}
    if qc:
        cfg["quantization_config"] = qc
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


def _backend(tmp_path, qc=None, **options) -> TrtllmBackend:
    cfg = BackendConfig(backend="trtllm", model=_model(tmp_path, qc), workdir=str(tmp_path / "work"),
                        options=options, start_timeout_s=120)
    return TrtllmBackend(cfg)


@pytest.fixture()
def fake_trtllm(monkeypatch, tmp_path):
    """The FAKE tensorrt_llm on PYTHONPATH, a GPU pretended: returns the record file."""
    record = tmp_path / "fake-record.jsonl"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(FAKES), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("FAKE_TRTLLM_RECORD", str(record))
    monkeypatch.setattr(envs, "has_cuda", lambda: True)
    return record


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


async def _collect(backend, *requests):
    out = [[ev async for ev in backend.stream(r)] for r in requests]
    await backend.aclose()
    return out


def test_registry_resolves():
    assert resolve("trtllm") is TrtllmBackend


def test_unavailable_on_this_host_real_probe(tmp_path):
    if envs.has_cuda():
        pytest.skip("this host has an NVIDIA GPU")
    b = _backend(tmp_path)
    with pytest.raises(EngineFailure) as ei:
        b.start()
    exc = ei.value
    assert exc.failure_class == "unavailable"
    assert "NVIDIA GPU" in exc.message
    probe = exc.evidence["probe.txt"]
    assert "nvidia-smi" in probe and "tensorrt_llm" in probe
    assert "No module named 'tensorrt_llm'" in probe  # bakeoff's python has no TensorRT-LLM
    b.stop()


def test_unavailable_when_not_importable(tmp_path, monkeypatch):
    monkeypatch.setattr(envs, "has_cuda", lambda: True)  # a GPU, but no tensorrt_llm (real import)
    b = _backend(tmp_path, python=sys.executable)
    with pytest.raises(EngineFailure) as ei:
        b.start()
    assert ei.value.failure_class == "unavailable"
    assert "not importable" in ei.value.message and "tensorrt_llm" in ei.value.message
    assert "ModuleNotFoundError" in ei.value.evidence["probe.txt"]
    assert b.proc is None  # nothing launched


def test_worker_with_fake_engine(tmp_path, fake_trtllm):
    b = _backend(tmp_path, python=sys.executable, max_batch_size=8, max_num_tokens=512, max_seq_len=1024,
                 kv_cache_free_gpu_memory_fraction=0.7, enable_block_reuse=False, tp_size=1)
    try:
        info = b.start()
        assert info.engine == "tensorrt-llm" and info.engine_version == "0.0.0+fake"
        assert info.kv_cache_tokens == 4096  # parsed from the engine's log line
        assert info.launch_command[1:3] == ["-m", "backends.trtllm.worker"]
        greedy = GenerationRequest(request_id="r1", prompt="Say hello", max_tokens=7)
        sampled = GenerationRequest(request_id="r2", prompt="x", max_tokens=3, temperature=0.8, seed=5,
                                    top_p=0.9, ignore_eos=True)
        events, events2 = asyncio.run(_collect(b, greedy, sampled))
    finally:
        b.stop()
    # cumulative outputs became deltas: no repeated text, token ids once each, 1-2 tokens per event
    text = "".join(e.text for e in events)
    assert text == "Hello, world ét"
    ids = [t for e in events for t in (e.token_ids or [])]
    assert ids == list(range(100, 107))
    assert max(len(e.token_ids or []) for e in events) == 2
    assert [e.finish_reason for e in events if e.finish_reason] == ["length"]
    assert "".join(e.text for e in events2) == "Hello,"

    recs = _records(fake_trtllm)
    llm = next(r for r in recs if r["kind"] == "LLM")
    assert llm["model"] == b.config.model
    assert llm["kwargs"] == {"tensor_parallel_size": 1, "backend": "pytorch", "max_batch_size": 8,
                             "max_num_tokens": 512, "max_seq_len": 1024, "trust_remote_code": False}
    assert llm["kv_cache_config"] == {"free_gpu_memory_fraction": 0.7, "enable_block_reuse": False}
    gens = [r for r in recs if r["kind"] == "generate_async"]
    assert gens[0]["streaming"] is True and gens[0]["prompt"] == "Say hello"
    assert gens[0]["sampling_params"] == {"max_tokens": 7, "ignore_eos": False, "temperature": 0.0, "top_k": 1}
    assert gens[1]["sampling_params"] == {"max_tokens": 3, "ignore_eos": True, "temperature": 0.8,
                                          "top_p": 0.9, "seed": 5}


def test_preflight_refuses_w4a16_before_launch(tmp_path, fake_trtllm):
    b = _backend(tmp_path, W4A16, python=sys.executable)
    with pytest.raises(EngineFailure) as ei:
        b.start()
    assert ei.value.failure_class == "config-rejected"
    assert "FP8 and NVFP4 only" in ei.value.message and "preflight.json" in ei.value.evidence
    assert b.proc is None and not any(r["kind"] == "LLM" for r in _records(fake_trtllm))


def test_server_command_line(tmp_path):
    b = _backend(tmp_path, mode="server", max_batch_size=16, max_num_tokens=2048,
                 kv_cache_free_gpu_memory_fraction=0.8, tp_size=2, enable_block_reuse=False)
    b.python = "/envs/trtllm/bin/python"
    cmd, env = b.command(8123)
    assert cmd[:2] == ["/envs/trtllm/bin/trtllm-serve", b.config.model]
    pairs = dict(zip(cmd[2::2], cmd[3::2]))
    assert pairs == {"--host": "127.0.0.1", "--port": "8123", "--backend": "pytorch", "--tp_size": "2",
                     "--kv_cache_free_gpu_memory_fraction": "0.8", "--max_batch_size": "16",
                     "--max_num_tokens": "2048", "--extra_llm_api_options": pairs["--extra_llm_api_options"]}
    assert json.loads(Path(pairs["--extra_llm_api_options"]).read_text()) == {
        "kv_cache_config": {"enable_block_reuse": False}}
    assert b.ready_mode == "health"
    assert str(envs.REPO_ROOT) in env["PYTHONPATH"]


def test_bad_options_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="unknown option"):
        _backend(tmp_path, max_batch=3)
    with pytest.raises(UserError, match="kv_cache_free_gpu_memory_fraction"):
        _backend(tmp_path, kv_cache_free_gpu_memory_fraction=1.5)


def test_modelopt_quantize_unavailable_on_this_host(tmp_path):
    from adapters.trtllm_build import modelopt_quantize

    if envs.has_cuda():
        pytest.skip("this host has an NVIDIA GPU")
    src = _model(tmp_path)
    with pytest.raises(EngineFailure) as ei:
        modelopt_quantize(src, tmp_path / "out", qformat="int4_awq", log=lambda s: None)
    assert ei.value.failure_class == "unavailable" and "NVIDIA GPU" in ei.value.message
    assert "nvidia-smi" in ei.value.evidence["probe.txt"]
    with pytest.raises(UserError, match="qformat"):
        modelopt_quantize(src, tmp_path / "out", qformat="int3")  # type: ignore[arg-type]
