"""optimum's ONNX route: the ``optimum-onnx`` export adapter and the ``optimum-ort`` backend, real.

The first run creates the ``optimum-onnx`` environment (~1.5 min on 2 cores); the fp32 export
of the fixture takes ~10 s and is cached. One export and one started backend serve the module.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from adapters.optimum_onnx_export import OptimumOnnxOptions, env_spec, export
from adapters.optimum_onnx_export.build import inspect
from adapters.ort_genai_export import raise_for_problems
from bakeoff.api.errors import EngineFailure
from bakeoff.host import envs
from tests.test_hugepages import assert_engine_heap_on_huge_pages
from tests.test_openvino import qwen3_5_moe_checkpoint
from backends._hosting.threads import default_threads
from tests.test_ort_genai import _collect, _prompts, _reference_greedy, tiny_qwen3  # noqa: F401 - tiny_qwen3 is a fixture

FP32 = OptimumOnnxOptions(precision="fp32")


@pytest.fixture(scope="module")
def onnx_python() -> Path:
    return envs.ensure(env_spec(), print)


@pytest.fixture(scope="module")
def onnx_export(tiny_qwen3, onnx_python):
    return export(tiny_qwen3, FP32, log=print)


def test_fp32_export_is_inspected_and_cached(tiny_qwen3, onnx_export):
    res, g = onnx_export, onnx_export.graph
    assert res.command[1:5] == ["-m", "optimum.commands.optimum_cli", "export", "onnx"]
    assert "text-generation-with-past" in res.command
    assert res.versions["optimum-onnx"] == "0.1.0" and res.versions["transformers"].startswith("4.57.")
    assert g.op_counts.get("MatMul", 0) >= 7 * json.loads((tiny_qwen3 / "config.json").read_text())["num_hidden_layers"]
    assert g.checker_ok and g.shape_inference_ok and g.forward_ok and not g.problems
    assert g.og_load_ok is None  # not an ORT GenAI export: that stage is not run
    assert g.logits_shape and g.logits_shape[-1] == json.loads((tiny_qwen3 / "config.json").read_text())["vocab_size"]
    assert res.output_bytes > 0 and "model.onnx" in res.files and res.duration_s > 0
    again = export(tiny_qwen3, FP32, log=print)
    assert again.cached and again.cache_key == res.cache_key


def test_broken_graph_is_an_export_defect_naming_the_node(onnx_export, onnx_python, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(onnx_export.output_dir, broken)
    script = (
        "import onnx, numpy as np, sys\n"
        "from onnx import numpy_helper\n"
        "p = sys.argv[1] + '/model.onnx'\n"
        "m = onnx.load(p)\n"
        "n = next(n for n in m.graph.node if n.name == '/lm_head/MatMul')\n"
        "m.graph.initializer.append(numpy_helper.from_array(np.zeros((7, 5), np.float32), 'bakeoff_bad_w'))\n"
        "n.input[1] = 'bakeoff_bad_w'\n"
        "onnx.save(m, p)\n")
    subprocess.run([str(onnx_python), "-c", script, str(broken)], check=True)
    report = inspect(broken, FP32, onnx_python)
    assert report.forward_ok is False or report.shape_inference_ok is False
    with pytest.raises(EngineFailure) as ei:
        raise_for_problems(report)
    assert ei.value.failure_class == "export-defect"
    assert "/lm_head/MatMul" in ei.value.message and "MatMul" in ei.value.message


def test_refused_architecture_names_the_model_type(tmp_path, onnx_python):
    """optimum-onnx 0.1.0 pins transformers < 4.58, which predates Qwen3.5-MoE."""
    ckpt = qwen3_5_moe_checkpoint(tmp_path / "tiny-qwen3.5-moe-random")
    with pytest.raises(EngineFailure) as ei:
        export(ckpt, FP32, log=print)
    assert ei.value.failure_class == "unsupported-architecture", ei.value
    assert "'qwen3_5_moe_text'" in ei.value.message
    assert "optimum_cli export onnx" in ei.value.evidence["command.txt"]


def test_backend_streams_and_matches_reference(tiny_qwen3, onnx_export, tmp_path):
    from backends import resolve
    from bakeoff.api.specs import BackendConfig

    b = resolve("optimum-ort")(BackendConfig(backend="optimum-ort", model=str(tiny_qwen3), workdir=str(tmp_path)))
    prompts = _prompts(tiny_qwen3)
    try:
        info = b.start()
        assert info.engine == "optimum-onnx" and info.engine_version == "0.1.0"
        assert info.notes["providers_active"].startswith("['CPUExecutionProvider'")
        assert "nodes:" in info.notes["export_ops"] and "export onnx" in info.notes["export_command"]
        # bakeoff's thread default, as ONNX Runtime's session and torch (generate's own tensor work) report it
        n = default_threads()[0]
        assert info.notes["intra_op_num_threads"].startswith(f"{n} (bakeoff's CPU default"), info.notes
        assert f"torch's threads in generate: {n})" in info.notes["intra_op_num_threads"]
        assert_engine_heap_on_huge_pages(info.notes)
        assert b.ready_payload["info"]["engine_process"] != b.ready_payload["pid"]  # generate beside no HTTP loop

        async def run_all():
            greedy = await asyncio.gather(*[_collect(b, prompt=p, max_tokens=8) for p in prompts])
            forced = await _collect(b, prompt=prompts[0], max_tokens=16, ignore_eos=True)
            await b.aclose()
            return greedy, forced

        greedy, forced = asyncio.run(run_all())
        for (ids, _text, times, _fin), want in zip(greedy, _reference_greedy(tiny_qwen3, prompts, 8)):
            assert ids[:len(want)] == want and len(ids) - len(want) in (0, 1)  # fp32: the reference's tokens
            assert times == sorted(times)
        assert len(forced[0]) == 16 and forced[3] == "length"
    finally:
        b.stop()
    assert b.proc is not None and not b.proc.group_alive()


# ---- pre-flight: optimum-onnx's own rule (no environment needed) --------------------------------

@pytest.mark.parametrize("qc, accepted, said", [
    (None, True, "float checkpoint: optimum-onnx's exporter"),
    ({"quant_method": "mxfp4"}, True, "dequantizes it to bf16"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True}, None, "pre-quantized (awq)"),
])
def test_preflight_cites_optimum_onnx_not_openvino(tmp_path, qc, accepted, said):
    """optimum-ort exports with optimum-onnx: its pre-flight evidence cites optimum-onnx's
    exporter (main_export), never optimum-intel's OpenVINO export configs."""
    from backends import preflight

    d = tmp_path / "m"
    d.mkdir()
    cfg = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "torch_dtype": "bfloat16"}
    if qc is not None:
        cfg["quantization_config"] = qc
    (d / "config.json").write_text(json.dumps(cfg))
    r = preflight(d, "optimum-ort", cuda=False)
    assert r.accepted is accepted and said in r.reason, r.reason
    assert "optimum-onnx" in r.rule_source and "main_export" in r.rule_source, r.rule_source
    assert "intel" not in (r.rule_source + r.reason).lower() and "openvino" not in (r.rule_source + r.reason).lower()
