"""OpenVINO: the optimum-intel export adapter and the openvino backend, with the real engine.

The first run creates the ``openvino`` environment (~1-2 min on 2 cores); exports are cached by
checkpoint hash, options and pins (the int8 export of the fixture takes ~30 s the first time).
One export and one started backend serve the whole module.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from adapters.openvino_export import OpenVinoExportOptions, env_spec, export
from bakeoff.api.errors import EngineFailure
from bakeoff.host import envs
from tests.test_hugepages import assert_engine_heap_on_huge_pages
from tests.test_ort_genai import _collect, _prompts, _reference_greedy, tiny_qwen3  # noqa: F401 - tiny_qwen3 is a fixture

INT8 = OpenVinoExportOptions(weight_format="int8")


@pytest.fixture(scope="module")
def ov_python() -> Path:
    return envs.ensure(env_spec(), print)


@pytest.fixture(scope="module")
def ov_export(tiny_qwen3, ov_python):
    return export(tiny_qwen3, INT8, log=print)


@pytest.fixture(scope="module")
def ov_backend(tiny_qwen3, ov_export, tmp_path_factory):
    from backends import resolve
    from bakeoff.api.specs import BackendConfig

    b = resolve("openvino")(BackendConfig(
        backend="openvino", model=str(tiny_qwen3), workdir=str(tmp_path_factory.mktemp("ov")),
        options={"weight_format": "int8", "inference_precision": "f32", "max_num_seqs": 8}))
    try:
        b.start()
        yield b
    finally:
        b.stop()
    assert b.proc is not None and not b.proc.group_alive()


def qwen3_5_moe_checkpoint(folder: Path) -> Path:
    """A random tiny Qwen3.5-MoE (``model_type`` ``qwen3_5_moe_text``), built by bakeoff's own
    transformers in a child process (seconds)."""
    code = (
        "import sys, torch\n"
        "from pathlib import Path\n"
        "from tests.test_ort_genai import _tiny_checkpoint\n"
        "from bakeoff.models.fixtures.recipes import QWEN3_5_MOE\n"
        "from transformers import Qwen3_5MoeForCausalLM\n"
        "from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig\n"
        "out = Path(sys.argv[1])\n"
        "_tiny_checkpoint(out, 'Qwen3ForCausalLM')\n"
        "[f.unlink() for f in out.glob('*.safetensors')]\n"
        "cfg = Qwen3_5MoeTextConfig(**{**QWEN3_5_MOE, 'vocab_size': 96, 'hidden_size': 64, 'num_experts': 4,\n"
        "                              'moe_intermediate_size': 32, 'shared_expert_intermediate_size': 32})\n"
        "torch.manual_seed(0)\n"
        "Qwen3_5MoeForCausalLM(cfg).save_pretrained(out)\n")
    subprocess.run([sys.executable, "-c", code, str(folder)], check=True, env=envs.child_env(), capture_output=True)
    return folder


def test_int8_export_records_command_versions_compression_and_is_cached(tiny_qwen3, ov_export):
    res = ov_export
    assert res.command[1:5] == ["-m", "optimum.commands.optimum_cli", "export", "openvino"]
    assert res.command[res.command.index("--weight-format") + 1] == "int8"
    assert res.versions["openvino"].startswith("2026.4.1") and res.versions["optimum-intel"] == "2.2.0"
    assert res.versions["transformers"].startswith("5.5.") and "nncf" in res.versions
    # NNCF's own table, and the IR holds 8-bit weights behind its MatMuls
    assert "Statistics of the bitwidth distribution" in res.compression["report"]
    assert any(mode.startswith("int8") and "100%" in share for mode, share in res.compression["modes"].items())
    assert res.compression["ir_weight_types"].get("u8", 0) >= 1 and res.ir_ops.get("MatMul", 0) >= 1
    assert res.ir_ops.get("ReadValue", 0) >= 2  # stateful KV cache (text-generation-with-past)
    assert res.output_bytes > 0 and "openvino_model.bin" in res.files and "openvino_tokenizer.xml" in res.files
    assert res.model_type == json.loads((tiny_qwen3 / "config.json").read_text())["model_type"]
    again = export(tiny_qwen3, INT8, log=print)
    assert again.cached and again.cache_key == res.cache_key and again.duration_s == res.duration_s


def test_refused_architecture_names_the_model_type(tmp_path, ov_python):
    """optimum-intel 2.2.0's Qwen3.5-MoE export config caps transformers at 5.2 while it
    requires <5.6 itself: the version skew users meet, as the exporter words it."""
    ckpt = qwen3_5_moe_checkpoint(tmp_path / "tiny-qwen3.5-moe-random")
    with pytest.raises(EngineFailure) as ei:
        export(ckpt, OpenVinoExportOptions(weight_format="fp16"), log=print)
    assert ei.value.failure_class == "unsupported-architecture"
    assert "'qwen3_5_moe_text'" in ei.value.message
    assert "does not allow for the export of the model" in ei.value.message  # the exporter's own words
    assert "optimum_cli export openvino" in ei.value.evidence["command.txt"]


def test_backend_streams_concurrent_sessions_like_the_reference(tiny_qwen3, ov_backend):
    b = ov_backend
    info = b.info
    assert info.engine == "openvino-genai" and info.engine_version.startswith("2026.4.1")
    assert info.notes["batching"] == "continuous" and "int8" in info.notes["export_compression_report"]
    assert info.kv_cache_memory_gib == 1.0 and info.concurrent_requests == 8
    # the plugin's KV element type by name (u8 on this CPU's plugin), which capacity.kv_cache converts to bytes
    assert info.notes["kv_cache_precision"] in ("u8", "i8", "f16", "bf16", "f32", "u4", "i4"), info.notes
    assert float(info.notes["kv_cache_element_bytes"]) in (0.5, 1, 2, 4), info.notes
    assert_engine_heap_on_huge_pages(info.notes)
    prompts = _prompts(tiny_qwen3)
    max_new = 8

    async def run_all():
        greedy = await asyncio.gather(*[_collect(b, prompt=p, max_tokens=max_new) for p in prompts])
        forced = await _collect(b, prompt=prompts[0], max_tokens=24, ignore_eos=True)
        sampled = await _collect(b, prompt=prompts[0], max_tokens=max_new, temperature=0.9, top_p=0.9, seed=3)
        await b.aclose()
        return greedy, forced, sampled

    greedy, forced, sampled = asyncio.run(run_all())
    ref = _reference_greedy(tiny_qwen3, prompts, max_new)
    # int8 weights: a near-tied answer may flip; all but one prompt must match the fp32 reference exactly
    same = sum(ids[:len(want)] == want for (ids, *_), want in zip(greedy, ref))
    assert same >= len(prompts) - 1, (greedy, ref)
    for ids, _text, times, finish in greedy:
        assert times == sorted(times) and finish in ("stop", "length")
    assert len(forced[0]) == 24 and forced[3] == "length"
    assert sampled[0] and sampled[3] in ("stop", "length")
    m = b.metrics()
    assert m.get("bakeoff_worker:max_running_requests", 0) >= 2  # concurrent sessions shared the pipeline's steps
    assert m.get("bakeoff_worker:kv_cache_size_bytes", 0) > 0
    toks = b.tokenize([prompts[0]])
    assert toks and toks[0] and all(isinstance(t, int) for t in toks[0]), b.tokenize_note


def test_the_pipeline_steps_in_its_own_process_and_streams_arrive_paced(tiny_qwen3, ov_backend):
    """ContinuousBatchingPipeline.step() holds the GIL for the whole step: beside the HTTP loop in one
    process it delivered whole streams in one burst (issue 28). The pipeline runs in a child process
    of the worker, with bakeoff's thread default, and a long stream reaches the client over many
    events from its first token on."""
    from backends._hosting.threads import default_threads
    from bakeoff.api.specs import GenerationRequest
    from bakeoff.loadgen.distortion import judge
    from bakeoff.loadgen.sweep import run_request

    b = ov_backend
    payload = b.ready_payload
    engine_pid = payload["info"]["engine_process"]
    assert engine_pid != payload["pid"]
    with open(f"/proc/{engine_pid}/stat") as fh:
        assert int(fh.read().rsplit(")", 1)[1].split()[1]) == payload["pid"]  # the worker's child
    assert b.info.notes["inference_num_threads"].startswith(f"{default_threads()[0]} (bakeoff's CPU default")

    async def three():
        recs = [await run_request(b, GenerationRequest(request_id=f"paced-{i}", prompt=_prompts(tiny_qwen3)[0],
                                                       max_tokens=256, ignore_eos=True, temperature=0.0))
                for i in range(3)]
        await b.aclose()
        return recs

    recs = asyncio.run(three())
    assert all(r.status == "ok" and r.output_tokens == 256 for r in recs), recs
    # a burst delivers the first token with the last (well under a millisecond apart). The fixture decodes
    # 256 tokens in tens of milliseconds, so a client the host delays that long at the start (CI: the first
    # token 144 ms after the send, the other 255 within 0.6 ms after it) sees a burst too. The GIL fault of
    # issue 28 bursts every stream; a host hiccup does not repeat three times in a row: the best of three
    # requests is judged, by its decode span and its number of content events
    best = max(recs, key=lambda r: r.end_ns - r.first_token_ns)
    spans_ms = [round((r.end_ns - r.first_token_ns) / 1e6, 2) for r in recs]
    assert best.end_ns - best.first_token_ns > 5e6, f"every stream came in one burst: decode spans {spans_ms} ms"
    assert best.content_events >= 16, best.content_events  # frames of at most one stream interval's tokens
    assert not judge([best], {})["distorted"]


def test_a_task_the_architecture_has_no_export_config_for_is_unsupported_architecture(tmp_path):
    """optimum-intel 2.2.0 on the Qwen3.5-MoE conditional-generation layout (seen 2026-12-02): the
    exporter knows the model type for image-text-to-text only; that is a refusal, not a broken export."""
    from adapters._optimum import classify_failure

    log = tmp_path / "export.log"
    log.write_text("Traceback (most recent call last):\n  ...\nValueError: Asked to export a qwen3_5_moe model for the "
                   "task text-generation-with-past, but the Optimum OpenVINO exporter only supports the tasks "
                   "image-text-to-text for qwen3_5_moe. Please use a supported task.\n")
    f = classify_failure("optimum-cli export openvino", 1, log, ["optimum-cli"], 60, "Qwen3_5MoeForConditionalGeneration",
                         "qwen3_5_moe")
    assert f.failure_class == "unsupported-architecture"
    assert "only supports the tasks image-text-to-text" in f.message and "'qwen3_5_moe'" in f.message


FAKE_ENGINE = """
import json, os, signal, sys
sys.path.insert(0, {root!r})
from backends._hosting.worker_pipe import start_child
# a fake engine process (named so): like openvino 2026.4.1's ContinuousBatchingPipeline on an AMX
# host with the 42 M-parameter qwen3-small IR, it dies of SIGFPE at load under one thread
def make(model, options):
    if options.get("inference_num_threads") == 1:
        os.kill(os.getpid(), signal.SIGFPE)
    return {{"threads": options.get("inference_num_threads")}}
pipe, info = start_child(sys.argv[1:], make)
pipe.send(("ready", {{"engine": "fake", **info}}))
pipe.wait()
"""


@pytest.mark.parametrize("is_default", [True, False])
def test_a_load_death_under_bakeoffs_thread_default_falls_back_to_the_plugins(tmp_path, monkeypatch, is_default):
    """The OpenVINO worker: an engine process that dies of a signal at load with bakeoff's
    default ``INFERENCE_NUM_THREADS`` starts once more with the plugin's default and says so in
    ``inference_num_threads_fallback`` (bakeoff's choice must not be what fails the engine); a
    thread count the user set is kept and the failure stands."""
    from backends._hosting.engine_process import EngineExited
    from backends.openvino import worker

    script = tmp_path / "fake_engine.py"
    script.write_text(FAKE_ENGINE.format(root=str(Path(__file__).resolve().parent.parent)))
    monkeypatch.setattr(worker.OpenVinoProxy, "_argv",
                        staticmethod(lambda model, options: [sys.executable, str(script), "--model", model,
                                                             "--options", json.dumps(options)]))
    options = {"inference_num_threads": 1, "inference_num_threads_is_default": is_default, "stream_interval_ms": 2}
    if not is_default:
        with pytest.raises(EngineExited) as err:
            worker.OpenVinoProxy("ir", options)
        assert err.value.returncode < 0
        return
    proxy = worker.OpenVinoProxy("ir", options)
    try:
        info = proxy.info()
        assert info["threads"] is None
        assert "died of SIGFPE at load with INFERENCE_NUM_THREADS=1" in info["inference_num_threads_fallback"]
    finally:
        proxy.proc.proc.kill()
