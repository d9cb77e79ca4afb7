"""ONNX Runtime GenAI: the export adapter and the ort-genai backend, with the real engine.

The first run creates the ``ort-genai`` environment (~4 min on 2 cores) and builds the
``tiny-qwen3`` fixture (~2-3 min); both are cached. Exports are cached by checkpoint hash.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from adapters.ort_genai_export import ExportOptions, env_spec, export, inspect_graph, raise_for_problems
from bakeoff.host import envs
from bakeoff.api.errors import EngineFailure

PROMPTS_FALLBACK = ["abc ab", "count: 1 2 3", "copy: ab =>", "kv a=1 b=2"]


def _tiny_checkpoint(folder: Path, arch: str, vocab: int = 96, hidden: int = 64) -> Path:
    """A random tiny checkpoint with a character tokenizer (architectures the fixtures lack)."""
    import torch
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    chars = ["<|endoftext|>"] + list("abcdefghijklmnopqrstuvwxyz0123456789 :=>.,")
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE({c: i for i, c in enumerate(chars)}, [])),
                                  eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    torch.manual_seed(0)
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                  eos_token_id=0, pad_token_id=0, bos_token_id=0, tie_word_embeddings=False)
    if arch == "Qwen3MoeForCausalLM":
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**common, num_experts=4, num_experts_per_tok=2,
                                                   moe_intermediate_size=32))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**common))
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def ort_python() -> Path:
    return envs.ensure(env_spec(), print)


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory) -> Path:
    """The trained ``tiny-qwen3`` fixture when already built (``bakeoff fixture tiny-qwen3``),
    else a random tiny Qwen3 (seconds; training the fixture takes minutes on a busy 2-core host)."""
    try:
        from bakeoff.models.fixtures import build, is_built

        if is_built("tiny-qwen3"):
            return Path(build("tiny-qwen3"))
    except ImportError:
        pass
    return _tiny_checkpoint(tmp_path_factory.mktemp("q3") / "tiny-qwen3-random", "Qwen3ForCausalLM")


def _with_context(src: Path, dst: Path, tokens: int) -> Path:
    """A copy of a checkpoint declaring a longer context (its outputs past the trained length
    do not matter where this is used: generations long enough to cancel mid-way)."""
    import shutil

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["max_position_embeddings"] = tokens
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _prompts(model: Path) -> list[str]:
    probes = model / "probes.jsonl"
    if not probes.is_file():
        return PROMPTS_FALLBACK
    rows = [json.loads(line) for line in probes.read_text().splitlines() if line.strip()]
    by_task: dict[str, str] = {}
    for r in rows:
        by_task.setdefault(r["task"], r["prompt"])
    return list(by_task.values())[:4]


def test_int4_export_is_inspected_and_cached(tiny_qwen3, ort_python):
    res = export(tiny_qwen3, ExportOptions(precision="int4", block_size=32, accuracy_level=4), log=print)
    g = res.graph
    n_layers = json.loads((tiny_qwen3 / "config.json").read_text())["num_hidden_layers"]
    assert g.op_counts.get("com.microsoft.MatMulNBits", 0) >= 4 * n_layers  # qkv, o, gate/up, down per layer
    assert g.matmulnbits_bits.get("4") == g.op_counts["com.microsoft.MatMulNBits"]
    assert g.precision_observed == "int4" and not g.has_moe
    assert g.checker_ok and g.shape_inference_ok and g.forward_ok and g.og_load_ok and not g.problems
    assert g.logits_shape and g.logits_shape[-1] == json.loads((tiny_qwen3 / "config.json").read_text())["vocab_size"]
    assert res.output_bytes > 0 and "model.onnx" in res.files and res.duration_s > 0
    assert res.command[1:4] == ["-m", "onnxruntime_genai.models.builder", "-i"] and "int4" in res.command
    assert res.versions.get("onnxruntime-genai", res.versions.get("onnxruntime_genai")) == "0.18.0"
    again = export(tiny_qwen3, ExportOptions(precision="int4", block_size=32, accuracy_level=4), log=print)
    assert again.cached and again.cache_key == res.cache_key and again.output_dir == res.output_dir


def test_cache_hit_from_a_copy_names_the_copy_as_source(tiny_qwen3, ort_python, tmp_path):
    """The same content under the same folder name elsewhere (a copy keeps mtimes) reuses the
    export, and the result's source is the folder asked for: the worker's tokenizer fallback
    reads it, and the first folder may be gone (CI saw "No such file or directory" from an
    earlier run's tmp copy)."""
    opts = ExportOptions(precision="int4", block_size=32, accuracy_level=4)
    first = export(tiny_qwen3, opts, log=print)
    copy = tmp_path / tiny_qwen3.name
    shutil.copytree(tiny_qwen3, copy)
    again = export(copy, opts, log=print)
    assert again.cached and again.cache_key == first.cache_key and again.source == str(copy.resolve())


def test_broken_graph_is_an_export_defect_naming_the_node(tiny_qwen3, ort_python, tmp_path):
    res = export(tiny_qwen3, ExportOptions(precision="fp32"), log=print)
    broken = tmp_path / "broken"
    shutil.copytree(res.output_dir, broken)
    # Give the LM head MatMul a weight whose inner dimension disagrees with hidden_size.
    script = (
        "import onnx, numpy as np, sys\n"
        "from onnx import numpy_helper\n"
        "p = sys.argv[1] + '/model.onnx'\n"
        "m = onnx.load(p, load_external_data=False)\n"
        "n = next(n for n in m.graph.node if n.name == '/lm_head/MatMul')\n"
        "m.graph.initializer.append(numpy_helper.from_array(np.zeros((7, 5), np.float32), 'bakeoff_bad_w'))\n"
        "n.input[1] = 'bakeoff_bad_w'\n"
        "onnx.save(m, p)\n")
    subprocess.run([str(ort_python), "-c", script, str(broken)], check=True)
    report = inspect_graph(broken, ExportOptions(precision="fp32"))
    assert not report.forward_ok
    with pytest.raises(EngineFailure) as ei:
        raise_for_problems(report)
    assert ei.value.failure_class == "export-defect"
    assert "/lm_head/MatMul" in ei.value.message and "MatMul" in ei.value.message
    problems = json.loads(ei.value.evidence["graph_problems.json"])
    assert any(p["node"] == "/lm_head/MatMul" for p in problems)


def test_refused_architecture_is_unsupported(tmp_path, ort_python):
    moe = _tiny_checkpoint(tmp_path / "tiny-qwen3-moe", "Qwen3MoeForCausalLM")
    with pytest.raises(EngineFailure) as ei:
        export(moe, ExportOptions(precision="int4", moe_quant_type="int4"), log=print)
    assert ei.value.failure_class == "unsupported-architecture"
    assert "Qwen3MoeForCausalLM" in ei.value.message and "not currently supported" in ei.value.message
    assert "NotImplementedError" in ei.value.evidence["builder.log.tail"]


def test_builder_lm_head_heuristic_is_caught(tmp_path, ort_python):
    """vocab_size == hidden_size: the 0.18.0 builder takes in-layer projections for the LM head."""
    ckpt = _tiny_checkpoint(tmp_path / "vocab-eq-hidden", "Qwen3ForCausalLM", vocab=64, hidden=64)
    with pytest.raises(EngineFailure) as ei:
        export(ckpt, ExportOptions(precision="fp32"), log=print)
    assert ei.value.failure_class == "export-defect"
    problems = json.loads(ei.value.evidence["graph_problems.json"])
    assert {p["stage"] for p in problems} >= {"builder", "graph"}  # and the bypassed final norm is a dead node


def _reference_greedy(model: Path, prompts: list[str], max_new: int) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    out = []
    for p in prompts:
        enc = tok(p, return_tensors="pt")
        with torch.inference_mode():
            ids = m.generate(**enc, max_new_tokens=max_new, do_sample=False, temperature=None, top_p=None,
                             top_k=None, pad_token_id=tok.pad_token_id or tok.eos_token_id)
        new = [int(x) for x in ids[0, enc["input_ids"].shape[1]:]]
        eos = m.generation_config.eos_token_id
        eos = set(eos if isinstance(eos, list) else [eos])
        if new and new[-1] in eos:  # generate() returns the EOS id; ORT GenAI does not stream it
            new = new[:-1]
        out.append(new)
    return out


async def _collect(backend, **kw):
    from bakeoff.api.specs import GenerationRequest

    ids, text, times, finish = [], "", [], None
    async for ev in backend.stream(GenerationRequest(request_id="t", **kw)):
        if ev.token_ids:
            ids += ev.token_ids
            times.append(ev.t_ns)
        text += ev.text
        finish = ev.finish_reason or finish
    return ids, text, times, finish


@pytest.mark.parametrize("batching", ["engine", "generator", "static"])
def test_backend_streams_and_matches_reference(tiny_qwen3, ort_python, tmp_path, batching):
    from backends import resolve
    from bakeoff.api.specs import BackendConfig

    prompts = _prompts(tiny_qwen3)
    max_new = 8
    cls = resolve("ort-genai")
    b = cls(BackendConfig(backend="ort-genai", model=str(tiny_qwen3), workdir=str(tmp_path),
                          options={"precision": "fp32", "batching": batching}))
    try:
        info = b.start()
        assert info.engine == "onnxruntime-genai" and info.engine_version == "0.18.0"
        assert "MatMul" in info.notes["export_ops"] and info.notes["export_command"]
        # og.Generator steps hold the GIL: the engine process lets its command thread in every 0.5 ms
        # (docs/backends/ort-genai.md: p90 6.9-7.2 ms from the worker's write to the inbox at Python's 5 ms
        # default, 0.85-1.3 ms at 0.5 ms on the 2-core host); og.Engine releases the GIL and keeps the default
        switch = info.notes.get("gil_switch_interval_ms", "")
        assert switch.startswith("0.5 ") if batching != "engine" else switch == "", switch
        assert b.export_result is not None
        assert json.loads((tmp_path / "export.json").read_text())["cache_key"] == b.export_result.cache_key

        async def run_all():
            greedy = await asyncio.gather(*[_collect(b, prompt=p, max_tokens=max_new) for p in prompts])
            sampled = await _collect(b, prompt=prompts[0], max_tokens=max_new, temperature=0.9, top_p=0.9, seed=3)
            forced = await _collect(b, prompt=prompts[0], max_tokens=24, ignore_eos=True)
            # 16 requests, 24+ tokens each: the first runs long enough for the others to arrive and
            # wait, so they meet in a batch whatever the host's speed
            many = [(p, 24 + i) for i, p in enumerate(prompts * 4)]
            scored = [await _collect(b, prompt=p, max_tokens=n, logprobs=3, ignore_eos=True) for p, n in many]
            together = await asyncio.gather(*[_collect(b, prompt=p, max_tokens=n, logprobs=3, ignore_eos=True)
                                              for p, n in many])
            await b.aclose()
            return greedy, sampled, forced, scored, together

        greedy, sampled, forced, scored, together = asyncio.run(run_all())
        # logprobs requests in flight together run as one right-padded og.Generator batch
        # (backends/ort_genai/generator_batch.py): the same tokens as each alone, on prompts of
        # different lengths and token budgets
        assert b.metrics()["bakeoff_worker:logprobs_batch_rows_max"] >= 2
        assert [s[0] for s in scored] == [t[0] for t in together] and all(s[0] for s in scored)
        assert [s[3] for s in scored] == [t[3] for t in together]
        if batching == "static":  # greedy requests in flight together shared og.Generator batches
            assert b.metrics()["bakeoff_worker:max_running_requests"] >= 2
        ref = _reference_greedy(tiny_qwen3, prompts, max_new)
        for (ids, _text, times, _fin), want in zip(greedy, ref):
            # generator mode streams the final EOS id, engine mode does not; the reference drops it
            assert ids[:len(want)] == want and len(ids) - len(want) in (0, 1)
            assert times == sorted(times)
        assert sampled[0] and sampled[3] in ("stop", "length")
        assert len(forced[0]) == 24 and forced[3] == "length"
    finally:
        b.stop()
    assert b.proc is not None and not b.proc.group_alive()


def test_forward_step_feeds_mrope_positions_in_the_declared_rank():
    """Qwen3.5 / VL exports take position_ids as (3, batch, seq) (MRoPE); the inspection's
    forward step must not call such a graph an export defect for its own 2-D feed."""
    from types import SimpleNamespace

    import numpy as np

    from adapters.ort_genai_export._inspect_child import _feeds

    inputs = [SimpleNamespace(name="input_ids", shape=["batch_size", "sequence_length"], type="tensor(int64)"),
              SimpleNamespace(name="position_ids", shape=[3, "batch_size", "sequence_length"], type="tensor(int64)"),
              SimpleNamespace(name="past_key_values.0.key", shape=["batch_size", 2, "past_sequence_length", 16],
                              type="tensor(float)")]
    feeds = _feeds(SimpleNamespace(get_inputs=lambda: inputs), np, {}, seq=4)
    assert feeds["position_ids"].shape == (3, 1, 4) and (feeds["position_ids"][2, 0] == np.arange(4)).all()
    assert feeds["input_ids"].shape == (1, 4) and feeds["past_key_values.0.key"].shape == (1, 2, 0, 16)
    inputs[1] = SimpleNamespace(name="position_ids", shape=["batch_size", "sequence_length"], type="tensor(int64)")
    assert _feeds(SimpleNamespace(get_inputs=lambda: inputs), np, {}, seq=4)["position_ids"].shape == (1, 4)


@pytest.mark.parametrize("batching", ["generator", "engine"])
def test_worker_cancels_a_dropped_stream_counts_the_prompt_and_reports_a_killed_engine(tiny_qwen3, ort_python, tmp_path,
                                                                                       batching):
    """The engine runs in its own process: a client that goes away stops its generation, usage
    counts the prompt as the engine tokenized it, and a dead engine process is an error event
    naming it (and a 503 health), not a hang."""
    import http.client
    import os
    import signal
    import time
    import urllib.error
    import urllib.parse
    import urllib.request

    from tokenizers import Tokenizer

    from backends import resolve
    from bakeoff.api.specs import BackendConfig

    # A dropped request must end long before its generation would: 16,000 tokens take ~8 s
    # here (attention grows with the context), 1,900 took 0.16 s, a window that a loaded CI
    # host's scheduling missed (both dropped requests ran to their end).
    model = _with_context(tiny_qwen3, tmp_path / "long-context", 16384)
    b = resolve("ort-genai")(BackendConfig(backend="ort-genai", model=str(model), workdir=str(tmp_path),
                                           options={"precision": "fp32", "batching": batching}))
    try:
        info = b.start()
        assert "worker process" in info.notes["detokenizer"] or "engine process" in info.notes["detokenizer"]
        url = urllib.parse.urlparse(b.base_url)

        def post(body: dict) -> dict:
            req = urllib.request.Request(b.base_url.rstrip("/") + "/v1/completions", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=60) as r:
                return json.loads(r.read())

        prompt = _prompts(tiny_qwen3)[0]
        for bad, why in (({"prompt": prompt, "max_tokens": 0}, "max_tokens must be a positive integer"),
                         ({"prompt": [prompt, prompt]}, "only one string prompt"),
                         ({"prompt": prompt, "temperature": -1}, "temperature out of range"),
                         ([1, 2], "JSON object")):
            with pytest.raises(urllib.error.HTTPError) as err:
                post(bad)
            assert err.value.code == 400 and why in err.value.read().decode()
        out = post({"model": b.config.model, "prompt": prompt, "max_tokens": 4})
        want = len(Tokenizer.from_file(str(tiny_qwen3 / "tokenizer.json")).encode(prompt).ids)
        assert out["usage"]["prompt_tokens"] == want and out["usage"]["completion_tokens"] >= 1

        LONG = 16000
        # a stream of LONG tokens, dropped after its first event
        conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
        conn.request("POST", "/v1/completions", json.dumps({"model": b.config.model, "prompt": prompt, "max_tokens": LONG,
                                                            "ignore_eos": True, "stream": True}),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.readline().startswith(b"data: ")
        conn.close()
        time.sleep(0.5)
        # and a non-streamed request of LONG tokens whose client leaves after 0.1 s
        conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
        conn.request("POST", "/v1/completions", json.dumps({"model": b.config.model, "prompt": prompt, "max_tokens": LONG,
                                                            "ignore_eos": True}), {"Content-Type": "application/json"})
        time.sleep(0.1)
        conn.close()
        time.sleep(0.5)
        post({"model": b.config.model, "prompt": prompt, "max_tokens": 8, "ignore_eos": True})
        # engine counters (they come with each request's end): 4 + the two dropped requests' + 8
        steps = b.metrics()["bakeoff_worker:decode_steps_total"]
        assert 4 + 2 + 8 <= steps < LONG, f"a dropped request was not cancelled: {steps} decode steps"
        log = b.log_path.read_text(errors="replace")  # a client that left is no error of the worker's
        assert "Traceback" not in log and "ConnectionResetError" not in log, log[-3000:]

        os.kill(b.ready_payload["info"]["engine_process"], signal.SIGKILL)
        time.sleep(0.5)
        with pytest.raises(urllib.error.HTTPError) as err:  # seen while idle, before any request
            urllib.request.urlopen(b.base_url.rstrip("/") + "/health", timeout=10)
        assert err.value.code == 503 and "exited with code -9" in err.value.read().decode()
        with pytest.raises(EngineFailure, match="engine process exited with code -9"):
            asyncio.run(_collect(b, prompt=prompt, max_tokens=4))
        with pytest.raises(urllib.error.HTTPError) as err:
            post({"prompt": prompt, "max_tokens": 4})
        assert err.value.code == 500 and "exited with code -9" in err.value.read().decode()
    finally:
        b.stop()
    assert b.proc is not None and not b.proc.group_alive()


@pytest.mark.parametrize("batching", ["generator", "static"])
def test_a_stream_that_ends_on_eos_carries_it_and_stops(tiny_qwen3, ort_python, tmp_path, batching):
    """og leaves the EOS it ends on out of ``get_sequence``: the one-request loop (``generator``,
    and every sampled request) lost it from the stream, one token short of the static batches, and
    an EOS on the last allowed step read ``length`` or ``stop`` by which id came last (found by a
    breaker: 4 tokens and ``length`` for ``max_tokens`` 5). Both paths now stream the EOS and stop."""
    from backends import resolve
    from bakeoff.api.specs import BackendConfig

    prompts = _prompts(tiny_qwen3)
    b = resolve("ort-genai")(BackendConfig(backend="ort-genai", model=str(tiny_qwen3), workdir=str(tmp_path),
                                           options={"precision": "fp32", "batching": batching}))
    try:
        b.start()
        cfg = json.loads((Path(b.export_result.output_dir) / "genai_config.json").read_text())["model"]
        eos = set(cfg["eos_token_id"] if isinstance(cfg["eos_token_id"], list) else [cfg["eos_token_id"]])

        async def run_all():
            first = [await _collect(b, prompt=p, max_tokens=32) for p in prompts]
            ended = [(p, r[0]) for p, r in zip(prompts, first) if r[0] and r[0][-1] in eos]
            at_the_limit = [await _collect(b, prompt=p, max_tokens=len(ids)) for p, ids in ended]
            sampled = [await _collect(b, prompt=p, max_tokens=32, temperature=0.9, seed=s) for s, p in enumerate(prompts)]
            await b.aclose()
            return first, ended, at_the_limit, sampled

        first, ended, at_the_limit, sampled = asyncio.run(run_all())
        assert ended, [r[0] for r in first]  # the fixture ends some probes within 32 tokens
        for ids, _text, _times, fin in first + sampled:
            assert fin == ("stop" if len(ids) < 32 or ids[-1] in eos else "length"), (ids, fin)
            assert all(t not in eos for t in ids[:-1]), ids  # an EOS only ever last
        for (_p, ids), (again, _text, _times, fin) in zip(ended, at_the_limit):
            assert again == ids and fin == "stop"  # the EOS on the last allowed step: stop, and streamed
    finally:
        b.stop()
