"""Pre-flight from the checkpoint itself: the MTP head's stored precision against the
quantization config's exclusion list (issue 19, item 3).

Tiny synthetic checkpoints in the real Qwen3.5-MoE INT4 layout (``weight_packed`` /
``weight_scale`` targets, an ``mtp.*`` head), written with ``safetensors``; no engine runs. Then the
real fixtures (opt-in, or when built): ``tiny-qwen3.5-moe-w4a16`` (``bakeoff quantize awq`` of the
MTP fixture, the head carried in BF16 and no ignore pattern) and its patched twin.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from adapters.checkpoint_patches import apply_patches
from bakeoff.analysis.checkpoint_layout import LayoutError, mtp_requested, read_tensors
from bakeoff.api.errors import EngineFailure, UserError
from backends import preflight, raise_if_rejected
from evaluations import patching
from bakeoff.models.resolve import ResolvedModel

MTP = {"speculative_config": {"method": "mtp", "num_speculative_tokens": 1}}
AVX512 = {"avx2", "avx512f"}  # the host's kernel rule is not what these tests judge
FIX = r"quantization_config.ignore+=re:.*mtp\..*"
CT = {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
      "ignore": ["lm_head", "re:.*mlp.gate$"],
      "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None,
                                    "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                                "strategy": "group", "group_size": 32}}}}
PROJ = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"] + [
    f"mlp.experts.{e}.{p}" for e in range(2) for p in ("gate_proj", "up_proj", "down_proj")]


def _quantized(prefix: str) -> dict[str, torch.Tensor]:
    out = {}
    for p in PROJ:
        out[f"{prefix}.{p}.weight_packed"] = torch.zeros(8, 4, dtype=torch.int32)
        out[f"{prefix}.{p}.weight_scale"] = torch.ones(8, 1, dtype=torch.bfloat16)
        out[f"{prefix}.{p}.weight_shape"] = torch.tensor([8, 32], dtype=torch.int32)
    return out


def _float(prefix: str) -> dict[str, torch.Tensor]:
    return {f"{prefix}.{p}.weight": torch.zeros(8, 32, dtype=torch.bfloat16) for p in PROJ}


def _common(prefix: str) -> dict[str, torch.Tensor]:
    return {f"{prefix}.mlp.gate.weight": torch.zeros(2, 32, dtype=torch.bfloat16),  # router: never quantized
            f"{prefix}.mlp.shared_expert_gate.weight": torch.zeros(1, 32, dtype=torch.bfloat16),
            f"{prefix}.input_layernorm.weight": torch.ones(32, dtype=torch.bfloat16)}


def ckpt(root, name: str, mtp_quantized: bool, qc: dict | None = None, sharded: bool = True):
    """A checkpoint: one quantized target layer, an MTP head (BF16 or quantized), an index."""
    d = root / name
    d.mkdir()
    target = {**_quantized("model.layers.0"), **_common("model.layers.0"),
              "model.embed_tokens.weight": torch.zeros(16, 32, dtype=torch.bfloat16),
              "lm_head.weight": torch.zeros(16, 32, dtype=torch.bfloat16)}
    head = {**(_quantized("mtp.layers.0") if mtp_quantized else _float("mtp.layers.0")), **_common("mtp.layers.0"),
            "mtp.fc.weight": torch.zeros(32, 64, dtype=torch.bfloat16), "mtp.norm.weight": torch.ones(32, dtype=torch.bfloat16)}
    if mtp_quantized:  # the fc of a quantized head is quantized too
        del head["mtp.fc.weight"]
        head.update({"mtp.fc.weight_packed": torch.zeros(32, 8, dtype=torch.int32),
                     "mtp.fc.weight_scale": torch.ones(32, 2, dtype=torch.bfloat16)})
    cfg = {"architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe_text", "torch_dtype": "bfloat16",
           "num_hidden_layers": 1, "mtp_num_hidden_layers": 1, "quantization_config": qc or CT}
    (d / "config.json").write_text(json.dumps(cfg))
    if sharded:
        save_file(target, str(d / "model-00001-of-00002.safetensors"))
        save_file(head, str(d / "model-00002-of-00002.safetensors"))
        wmap = {k: "model-00001-of-00002.safetensors" for k in target} | {k: "model-00002-of-00002.safetensors" for k in head}
        (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wmap}))
    else:
        save_file({**target, **head}, str(d / "model.safetensors"))
    return d


def test_defective_checkpoint_is_refused_with_mtp_in_seconds(tmp_path):
    d = ckpt(tmp_path, "defective", mtp_quantized=False)
    t0 = time.monotonic()
    r = preflight(d, "vllm", cuda=False, flags=AVX512, options=MTP)
    assert time.monotonic() - t0 < 10
    assert r.accepted is False and r.failure_class == "config-rejected"
    f = r.findings[0]
    # 11 float layers of the head (10 projections + fc): routers and norms are not counted
    assert f["status"] == "defect" and f["uncovered_tensors"] == 11 and f["mtp_tensors"] == 15
    assert "mtp.fc.weight" in f["uncovered_examples"] or any(e.startswith("mtp.layers.0.") for e in f["uncovered_examples"])
    assert not any("mlp.gate.weight" in e or "shared_expert_gate" in e for e in f["uncovered_examples"])
    assert r.suggested_patches == [FIX] and FIX in r.reason and "11 MTP weights" in r.reason
    assert "qwen3_5_mtp.py" in r.rule_source and "should_ignore_layer" in r.rule_source
    with pytest.raises(EngineFailure) as exc:
        raise_if_rejected(d, "vllm", cuda=False, flags=AVX512, options=MTP)
    assert exc.value.failure_class == "config-rejected" and "preflight.json" in exc.value.evidence


def test_defect_is_a_warning_without_mtp_speculation(tmp_path):
    d = ckpt(tmp_path, "defective", mtp_quantized=False, sharded=False)  # the single-file layout
    for options in ({}, {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}}):
        r = preflight(d, "vllm", cuda=False, flags=AVX512, options=options)
        assert r.accepted is True and r.failure_class is None
        assert len(r.warnings) == 1 and "not blocking" in r.warnings[0] and r.suggested_patches == [FIX]


def test_patched_twin_passes_and_records_the_patch(tmp_path):
    d = ckpt(tmp_path, "defective", mtp_quantized=False)
    pc = apply_patches(d, [FIX], cache_dir=tmp_path / "cache")
    assert pc.diff[0].before == ["lm_head", "re:.*mlp.gate$"] and pc.diff[0].after[-1] == r"re:.*mtp\..*"
    r = preflight(pc.path, "vllm", cuda=False, flags=AVX512, options=MTP)
    assert r.accepted is True and r.findings[0]["status"] == "consistent" and not r.warnings
    assert r.findings[0]["uncovered_tensors"] == 0 and not r.suggested_patches


def test_quantized_and_listed_head_passes(tmp_path):
    d = ckpt(tmp_path, "quantized-head", mtp_quantized=True)
    r = preflight(d, "vllm", cuda=False, flags=AVX512, options=MTP)
    assert r.accepted is True and r.findings[0]["status"] == "consistent", r.findings


def test_quantized_head_under_an_ignore_pattern_is_the_opposite_defect(tmp_path):
    qc = {**CT, "ignore": ["lm_head", "re:.*mtp\\..*"]}
    d = ckpt(tmp_path, "over-ignored", mtp_quantized=True, qc=qc)
    r = preflight(d, "vllm", cuda=False, flags=AVX512, options=MTP)
    assert r.accepted is False and r.findings[0]["ignored_quantized_tensors"] > 0
    assert r.findings[0]["patch"] is None and "builds them unquantized" in r.reason


def test_awq_reads_modules_to_not_convert_by_substring_or_infers_it(tmp_path):
    awq = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}
    inferred = ckpt(tmp_path, "awq-empty", mtp_quantized=False, qc=awq)  # empty list: vLLM infers it from dtypes
    assert preflight(inferred, "vllm", cuda=False, flags=AVX512, options=MTP).accepted is True
    listed = ckpt(tmp_path, "awq-listed", mtp_quantized=False, qc={**awq, "modules_to_not_convert": ["lm_head"]})
    r = preflight(listed, "vllm", cuda=False, flags=AVX512, options=MTP)
    assert r.accepted is False and r.suggested_patches == ["quantization_config.modules_to_not_convert+=mtp."]
    fixed = apply_patches(listed, r.suggested_patches, cache_dir=tmp_path / "cache")
    assert preflight(fixed.path, "vllm", cuda=False, flags=AVX512, options=MTP).accepted is True


def test_engines_without_the_rule_and_checkpoints_without_mtp(tmp_path):
    d = ckpt(tmp_path, "defective", mtp_quantized=False)
    assert preflight(d, "transformers", cuda=False, options=MTP).findings == []  # no MTP speculation there
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"], "quantization_config": CT}))
    save_file(_quantized("model.layers.0"), str(plain / "model.safetensors"))
    r = preflight(plain, "vllm", cuda=False, flags=AVX512, options=MTP)
    assert r.accepted is True and r.findings[0]["status"] == "no-mtp"


def test_unreadable_safetensors_is_a_reason_not_a_raise(tmp_path):
    """A safetensors file whose header cannot be read is damaged for every engine: pre-flight refuses
    it with a reason naming the file (it raised before the truncation rule, then was recorded
    ``unreadable`` and accepted); the MTP rule is never reached."""
    d = tmp_path / "broken"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["X"], "quantization_config": CT}))
    (d / "model.safetensors").write_bytes(b"\xff" * 16)
    with pytest.raises(LayoutError):
        read_tensors(d)
    r = preflight(d, "vllm", cuda=False, flags=AVX512, options=MTP)
    assert r.accepted is False and "damaged" in r.reason and "model.safetensors" in r.reason, r.reason


def test_mtp_requested_reads_the_option_forms():
    assert mtp_requested(MTP) and mtp_requested({"speculative_config": '{"method": "qwen3_next_mtp"}'})
    assert not mtp_requested({}) and not mtp_requested({"speculative_config": {"method": "ngram"}})


def test_patch_preflight_applies_the_suggestion(tmp_path, monkeypatch):
    monkeypatch.setenv("BAKEOFF_CACHE", str(tmp_path / "cache"))
    d = ckpt(tmp_path, "defective", mtp_quantized=False)
    model = ResolvedModel(label=str(d), path=str(d), local=True)
    patched, pc = patching.apply(model, "vllm", MTP, ["preflight"])
    assert [c.patch for c in pc.diff] == [FIX] and patched.path == pc.path != str(d)
    assert preflight(patched.path, "vllm", cuda=False, flags=AVX512, options=MTP).accepted is True
    good = ckpt(tmp_path, "quantized-head", mtp_quantized=True)
    with pytest.raises(UserError, match="suggest no patch"):
        patching.apply(ResolvedModel(label="g", path=str(good), local=True), "vllm", MTP, ["preflight"])
    with pytest.raises(UserError, match="not one"):
        patching.apply(ResolvedModel(label="org/m", path="org/m", local=False), "vllm", MTP, [FIX])


def test_the_load_check_records_the_source_preflight_and_the_patch(tmp_path, monkeypatch):
    """``--patch``: the run keeps both pre-flights' verdicts and the diff (evaluations/patching.py)."""
    from bakeoff.api.verdict import Verdict
    from bakeoff.host.artifacts import RunDir
    from bakeoff.host.run import RunContext

    monkeypatch.setenv("BAKEOFF_CACHE", str(tmp_path / "cache"))
    d = ckpt(tmp_path, "defective", mtp_quantized=False)
    model = ResolvedModel(label=str(d), path=str(d), local=True)
    patched, pc = patching.apply(model, "vllm", MTP, [FIX])
    rd = RunDir.create(tmp_path / "art", "vllm", str(d))
    run = RunContext(rd, Verdict(run_id=rd.run_id, backend="vllm", model=str(d)))
    with run.check("load", "load-failure") as scope:
        patching.record(scope, model, pc, "vllm", MTP)
    check = run.get("load")
    assert check.status == "pass" and check.values["patches"] == [FIX]
    assert check.values["preflight_source"]["accepted"] is False  # the source, as the user gave it
    assert FIX in check.values["preflight_source"]["suggested_patches"]
    assert check.values["patched_checkpoint"] == patched.path != str(d)
    source = json.loads((rd.path / "evidence/load/preflight-source.json").read_text())
    diff = json.loads((rd.path / "evidence/load/checkpoint-patches.json").read_text())
    assert source["accepted"] is False and "mtp" in source["reason"].lower()
    assert [c["patch"] for c in diff["diff"]] == [FIX] and diff["path"] == patched.path
    assert diff["diff"][0]["after"][-1] == r"re:.*mtp\..*" and diff["diff"][0]["changed"] is True


def test_qualify_refuses_a_malformed_patch_in_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "cli.main", "qualify", "--backends", "vllm",
                           "--model", str(tmp_path), "--patch", "ignore"], capture_output=True, text=True, timeout=60,
                          env={"BAKEOFF_CACHE": str(tmp_path / "c"), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "malformed patch 'ignore'" in proc.stderr


# ---- the real fixtures: tiny-qwen3.5-moe quantized by `bakeoff quantize awq` (issue 19) ----

def _fixtures_ready(*names: str):
    from bakeoff.models import fixtures

    ready = os.environ.get("BAKEOFF_MOE_FIXTURES") == "1" or all(fixtures.is_built(n) for n in names)
    return pytest.mark.skipif(not ready, reason=f"builds {', '.join(names)} (training and llm-compressor: minutes "
                                                "on 2 cores); set BAKEOFF_MOE_FIXTURES=1 to run, or build them first")


W4A16 = ("tiny-qwen3.5-moe-w4a16", "tiny-qwen3.5-moe-w4a16-patched")


@pytest.mark.slow
@_fixtures_ready(*W4A16)
def test_real_w4a16_fixture_is_flagged_in_seconds_and_its_patched_twin_passes():
    from bakeoff.models import fixtures
    from bakeoff.models.resolve import resolve

    bad = resolve("fixture:tiny-qwen3.5-moe-w4a16").path
    good = resolve("fixture:tiny-qwen3.5-moe-w4a16-patched").path
    cfg = json.loads(Path(bad, "config.json").read_text())
    assert not any("mtp" in p for p in cfg["quantization_config"]["ignore"])  # the released defect
    dtypes = {t.name: t.dtype for t in read_tensors(bad)}
    head = {n: d for n, d in dtypes.items() if n.startswith("mtp.")}
    assert len(head) == 41 and set(head.values()) == {"BF16"}
    assert any(n.endswith(".weight_packed") for n in dtypes)  # the target is W4A16
    t0 = time.monotonic()
    r = preflight(bad, "vllm", cuda=False, flags=AVX512, options=MTP)
    seconds = time.monotonic() - t0
    assert seconds < 10, seconds
    assert r.accepted is False and r.failure_class == "config-rejected"
    f = r.findings[0]
    # fc, q/k/v/o, 8 x 3 routed experts, 3 shared-expert projections (routers and norms are never quantized)
    assert f["status"] == "defect" and f["mtp_tensors"] == 41 and f["uncovered_tensors"] == 32, f
    assert r.suggested_patches == [FIX]
    ok = preflight(good, "vllm", cuda=False, flags=AVX512, options=MTP)
    assert ok.accepted is True and ok.findings[0]["status"] == "consistent" and not ok.warnings
    meta = json.loads(Path(good, "fixture.json").read_text())
    assert [p["patch"] for p in meta["patches"]] == [FIX] and meta["sibling"]["name"] == "tiny-qwen3.5-moe-w4a16"
    assert fixtures.is_built("tiny-qwen3.5-moe-w4a16")
    print(f"\npre-flight on tiny-qwen3.5-moe-w4a16: {seconds * 1000:.0f} ms: {r.reason[:200]}")
