"""ONNX Runtime GenAI with PagedAttention (issue 28), on a host without CUDA.

A paged export (builder ``use_paged_attention=true``) is what makes ``og.Engine`` batch
continuously; the 0.18.0 builder builds it for CUDA (and WebGPU) only, also on a host without a
GPU, so its inspection is checked here up to where CUDA is needed: op counts, the layout against
``genai_config.json``, checker, shape inference and the forward step's feeds. The CUDA-only
parts (the forward step, og.Engine's token, the logprobs session on PagedAttention) run on the
H200 (``examples/h200/runs-20261203b.sh``); the logprobs loop itself is checked here on a
standard export, where og.Generator gives the same tokens to compare with.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from adapters.ort_genai_export import ExportOptions, env_spec, export, inspect_graph, raise_for_problems
from adapters.ort_genai_export import _graph_io
from bakeoff.api.errors import EngineFailure
from bakeoff.host import envs
from tests.test_ort_genai import _tiny_checkpoint

REPO = Path(__file__).resolve().parent.parent
PAGED = ExportOptions(precision="fp16", execution_provider="cuda", paged_attention=True)


@pytest.fixture(scope="module")
def ort_python() -> Path:
    return envs.ensure(env_spec(), print)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """A random tiny Qwen3 (the builder's graph does not depend on trained weights)."""
    return _tiny_checkpoint(tmp_path_factory.mktemp("paged") / "tiny-qwen3-random", "Qwen3ForCausalLM")


@pytest.fixture(scope="module")
def paged(tiny, ort_python):
    return export(tiny, PAGED, log=print)


def test_options_choose_paged_attention_where_the_builder_builds_it():
    """Unset, ``paged_attention`` is true on CUDA (fp16/bf16/int4/int8 keep fp16 activations),
    false on CPU with the builder's refusal as the reason, false with batching=generator; it is
    in the export's options (so in its cache key and builder command), and --matrix can vary it.
    ``cuda_graph`` follows a paged CUDA export."""
    from adapters.ort_genai_export.cache import cache_key
    from adapters.ort_genai_export.export import builder_command
    from backends.ort_genai.backend import PAGED_REFUSAL_CPU, OrtGenaiOptions, paged_default
    from bakeoff.analysis.matrix import cells_for, parse_matrix

    cpu = OrtGenaiOptions()
    assert cpu.export_options().paged_attention is False
    assert PAGED_REFUSAL_CPU in paged_default(cpu)[1]
    for precision in ("fp16", "bf16", "int4", "int8"):
        assert OrtGenaiOptions(execution_provider="cuda", precision=precision).export_options().paged_attention
    assert not OrtGenaiOptions(execution_provider="cuda", precision="fp32").export_options().paged_attention
    assert not OrtGenaiOptions(execution_provider="cuda", precision="fp16", batching="generator").export_options().paged_attention
    assert not OrtGenaiOptions(execution_provider="cuda", precision="fp16", paged_attention=False).export_options().paged_attention
    with pytest.raises(ValueError, match="batching=generator cannot serve a paged_attention export"):
        OrtGenaiOptions(paged_attention=True, batching="generator")
    on, off = (OrtGenaiOptions(execution_provider="cuda", precision="fp16", paged_attention=v).export_options()
               for v in (True, False))
    assert on.paged_attention and not off.paged_attention
    assert cache_key("h", on, "0.18.0") != cache_key("h", off, "0.18.0")
    cmd = builder_command("python", Path("/m"), Path("/o/model"), on)
    assert cmd[cmd.index("--extra_options") + 1:] == ["use_paged_attention=true", "enable_cuda_graph=true"]
    assert "--extra_options" not in builder_command("python", Path("/m"), Path("/o/model"), off)
    cells, dropped = cells_for(parse_matrix(["paged_attention=true,false"]), OrtGenaiOptions.model_fields.__contains__)
    assert not dropped and [c.options for c in cells] == [{"paged_attention": True}, {"paged_attention": False}]
    # CUDA graphs come with a paged CUDA export (og.Engine replays decode steps), off elsewhere
    assert on.cuda_graph and not off.cuda_graph and not cpu.export_options().cuda_graph
    assert not OrtGenaiOptions(execution_provider="cuda", precision="fp16", cuda_graph=False).export_options().cuda_graph
    assert "enable_cuda_graph=true" in cmd and cache_key("h", on, "0.18.0") != cache_key(
        "h", on.model_copy(update={"cuda_graph": False}), "0.18.0")


def test_builder_refuses_paged_attention_on_cpu(tiny, ort_python):
    """The evidence behind bakeoff's CPU default: asked for anyway, the builder's refusal is a
    ``config-rejected`` verdict in its own words (the note quotes the same words)."""
    from backends.ort_genai.backend import PAGED_REFUSAL_CPU

    with pytest.raises(EngineFailure) as ei:
        export(tiny, ExportOptions(precision="fp32", paged_attention=True), log=print)
    assert ei.value.failure_class == "config-rejected"
    assert PAGED_REFUSAL_CPU in ei.value.message
    assert "use_paged_attention=true" in ei.value.evidence["command.txt"]


def test_paged_cuda_export_is_inspected_on_a_cpu_host(paged, tiny):
    """A paged CUDA export built on any host passes what can run there, and is recognised as paged."""
    g = paged.graph
    n_layers = json.loads((tiny / "config.json").read_text())["num_hidden_layers"]
    assert g.op_counts.get("com.microsoft.PagedAttention") == n_layers and "com.microsoft.GroupQueryAttention" not in g.op_counts
    assert g.paged_attention and g.dynamic_batching and g.dynamic_batching["block_size"] >= 16
    assert g.input_shapes["input_ids"] == ["num_tokens"] and "attention_mask" not in g.input_shapes
    assert g.checker_ok and g.shape_inference_ok and not g.problems
    if not envs.has_cuda():  # not run, and said so (on CUDA: test_cuda_paged_export_runs_forward_and_og_engine)
        assert g.forward_ok is None and g.og_load_ok is None
        assert any("forward step not run" in w for w in g.warnings) and any("og stage not run" in w for w in g.warnings)
    assert "-paged-" in Path(paged.output_dir).parent.name
    assert paged.notes()["export_paged_attention"].startswith("true: PagedAttention graph")


def test_forward_feeds_follow_a_paged_graphs_declaration(paged):
    """What the CUDA forward step (and the logprobs session) would feed this graph: 1-D packed
    ids, one sequence in whole blocks, int32 metadata; each feed in the rank the graph declares."""
    import numpy as np

    g = paged.graph
    types = {"input_ids": "tensor(int64)", "block_table": "tensor(int32)", "cumulative_sequence_lengths": "tensor(int32)",
             "past_sequence_lengths": "tensor(int32)", "attention_metadata": "tensor(int32)"}
    inputs = [SimpleNamespace(name=k, shape=v, type=types.get(k, "tensor(float16)")) for k, v in g.input_shapes.items()]
    lay = _graph_io.layout(json.loads((Path(paged.output_dir) / "genai_config.json").read_text()))
    block = lay["block_size"]
    named = _graph_io.paged_named(lay, block + 3)  # a sequence that needs two blocks
    prefill = _graph_io.step_feeds(inputs, np, [5, 6, 7], 0, named)
    for name, shape in g.input_shapes.items():
        assert prefill[name].ndim == len(shape), name
    assert prefill["input_ids"].tolist() == [5, 6, 7]
    assert prefill["block_table"].tolist() == [[0, 1]] and prefill["cumulative_sequence_lengths"].tolist() == [0, 3]
    assert prefill["past_sequence_lengths"].tolist() == [0] and prefill["attention_metadata"].tolist() == [3, 3, 3]
    kv = next(k for k in g.input_shapes if k.startswith("past_key_values"))
    assert prefill[kv].shape == (2, block, *g.input_shapes[kv][2:]) and prefill[kv].dtype == np.float16
    decode = _graph_io.step_feeds(inputs, np, [9], 3, named, {kv: prefill[kv]})
    assert decode["past_sequence_lengths"].tolist() == [3] and decode["attention_metadata"].tolist() == [1, 4, 4]
    assert decode[kv] is prefill[kv]


def test_paged_layout_disagreements_are_export_defects(paged, tiny, ort_python, tmp_path):
    """The inspection still catches broken exports on the paged path: a PagedAttention graph
    whose genai_config.json lost engine.dynamic_batching (og.Engine would batch it statically),
    and a standard graph whose config claims dynamic batching (2-D ids, no PagedAttention)."""
    no_section = tmp_path / "no-section"
    shutil.copytree(paged.output_dir, no_section)
    cfg = json.loads((no_section / "genai_config.json").read_text())
    del cfg["engine"]
    (no_section / "genai_config.json").write_text(json.dumps(cfg))
    with pytest.raises(EngineFailure) as ei:
        raise_for_problems(inspect_graph(no_section, PAGED))
    assert ei.value.failure_class == "export-defect" and "PagedAttention" in ei.value.message
    assert "no engine.dynamic_batching" in ei.value.message

    std = export(tiny, ExportOptions(precision="fp32"), log=print)
    claims = tmp_path / "claims-paged"
    shutil.copytree(std.output_dir, claims)
    cfg = json.loads((claims / "genai_config.json").read_text())
    cfg["engine"] = {"dynamic_batching": {"block_size": 256, "max_batch_size": 8}}
    (claims / "genai_config.json").write_text(json.dumps(cfg))
    report = inspect_graph(claims, ExportOptions(precision="fp32"))
    messages = [p.message for p in report.problems if p.stage == "paged"]
    assert any("no PagedAttention node" in m for m in messages) and any("rank 2" in m for m in messages)
    with pytest.raises(EngineFailure) as ei:
        raise_for_problems(report)
    assert ei.value.failure_class == "export-defect"


def test_graph_session_logprobs_match_og_generator(tiny, ort_python):
    """The logprobs path of paged exports (the export's graph stepped in an ORT session, KV fed
    back step to step) gives og.Generator's tokens and logprobs on a standard export: greedy,
    under ignore_eos (EOS masked as og's min_length does) and stopping at EOS."""
    std = export(tiny, ExportOptions(precision="fp32"), log=print)
    script = r"""
import json, sys
import numpy as np
import onnxruntime_genai as og
from backends.ort_genai.generator_batch import run_with_logprobs
from backends.ort_genai.paged_logits import run_paged_with_logprobs
d = sys.argv[1]
class Out:
    def __init__(s): s.frames, s.decoder, s.last_id = [], None, None
    def start(s, n): pass
    def send_ids(s, raw, now, urgent, lps=None):
        s.frames.append((np.frombuffer(raw, dtype=np.int32).tolist()[0], lps[0])); s.last_id = s.frames[-1][0]
    def finish(s, reason, stats): s.reason = reason
class Engine:  # the attributes both paths read of an OrtGenaiEngine
    def __init__(s):
        c = og.Config(d); c.clear_providers(); s.model = og.Model(c)
        s.og, s.np, s.tokenizer_json, s.cancelled, s.decode_steps = og, np, "x", set(), 0
        s.eos_ids, s.paged_logits, s.model_dir, s.ep, s.options = {0}, None, d, "cpu", {}
        s.logprobs_rows_max = s.max_running = s.own_s = s.og_s = 0
    def encode(s, p): return [b % 90 + 1 for b in p.encode()]
    def stats(s): return {}
    def search_options(s, body, n):
        o = {"max_length": n + body["max_tokens"], "do_sample": False}
        if body.get("ignore_eos"): o["min_length"] = o["max_length"]
        return o
e, res = Engine(), []
for body in json.loads(sys.argv[2]):
    a, b = Out(), Out()
    run_with_logprobs(e, 1, dict(body), a)
    run_paged_with_logprobs(e, 2, dict(body), b)
    res.append({"og": [t for t, _ in a.frames], "graph": [t for t, _ in b.frames], "reasons": [a.reason, b.reason],
                "dlogp": max(abs(x[1][0] - y[1][0]) for x, y in zip(a.frames, b.frames)),
                "top_same": all([i for i, _ in x[1][1]] == [i for i, _ in y[1][1]] for x, y in zip(a.frames, b.frames))})
print(json.dumps(res))
"""
    bodies = [{"prompt": "count: 1 2 3", "max_tokens": 12, "logprobs": 3, "ignore_eos": True},
              {"prompt": "abc ab", "max_tokens": 40, "logprobs": 2}]
    out = subprocess.run([str(ort_python), "-c", script, std.output_dir, json.dumps(bodies)], capture_output=True,
                         text=True, timeout=300, cwd=REPO, env=envs.child_env())
    assert out.returncode == 0, out.stderr[-3000:]
    for r in json.loads(out.stdout.splitlines()[-1]):
        assert r["og"] == r["graph"] and r["og"], r
        assert r["reasons"][0] == r["reasons"][1] and r["dlogp"] < 1e-4 and r["top_same"], r
    forced = json.loads(out.stdout.splitlines()[-1])[0]
    assert len(forced["graph"]) == 12 and 0 not in forced["graph"]


needs_cuda = pytest.mark.skipif(not envs.has_cuda(), reason="PagedAttention runs on CUDA only (onnxruntime's op schema)")


@needs_cuda
def test_cuda_paged_export_runs_forward_and_og_engine(paged, tiny):
    """On CUDA the inspection runs the paged graph: the forward step fed as it declares (1-D
    ids, logits per packed token) and og's token through og.Engine (og.Generator cannot)."""
    g = paged.graph
    vocab = json.loads((tiny / "config.json").read_text())["vocab_size"]
    assert g.forward_ok and g.og_load_ok and not g.problems, g.problems
    assert g.logits_shape == [4, vocab]
    assert g.og_engine_capabilities["configured_max_batch_size"] == g.dynamic_batching["max_batch_size"]


@needs_cuda
def test_cuda_backend_defaults_to_paged_continuous_batching(tiny, ort_python, tmp_path):
    """Unset options on CUDA give a paged export with CUDA graphs served by og.Engine's continuous
    path, said in the notes; concurrent greedy streams; a logprobs request answers through the graph session,
    its tokens agreeing with og.Engine's greedy ones (tie-aware: a differing token must be in the
    other's top-k there, then the comparison stops)."""
    import asyncio

    from backends import resolve
    from bakeoff.api.specs import BackendConfig, GenerationRequest

    b = resolve("ort-genai")(BackendConfig(backend="ort-genai", model=str(tiny), workdir=str(tmp_path),
                                           options={"execution_provider": "cuda", "precision": "fp16"}))

    async def collect(**kw):
        ids, lps = [], []
        async for ev in b.stream(GenerationRequest(request_id=str(kw), **kw)):
            ids += ev.token_ids or []
            lps += ev.logprobs or []
        return ids, lps

    try:
        info = b.start()
        assert info.notes["paged_attention"].startswith("true") and info.notes["export_paged_attention"].startswith("true")
        assert info.notes["og_engine"].startswith("continuous batching") and info.concurrent_requests == 100
        assert info.notes["cuda_graph"].startswith("true")

        async def run():
            prompts = ["abc ab", "count: 1 2 3", "copy: ab =>", "kv a=1 b=2"]
            greedy = await asyncio.gather(*[collect(prompt=p, max_tokens=12, ignore_eos=True) for p in prompts])
            scored = await collect(prompt=prompts[0], max_tokens=12, ignore_eos=True, logprobs=5)
            await b.aclose()
            return greedy, scored

        greedy, (ids, lps) = asyncio.run(run())
        assert all(len(g[0]) == 12 for g in greedy) and len(ids) == 12 and len(lps) == 12
        for i, (a, c) in enumerate(zip(greedy[0][0], ids)):
            if a != c:
                assert a in lps[i][2], f"position {i}: og.Engine {a}, graph session {c}, top-5 {lps[i][2]}"
                break
    finally:
        b.stop()


class _FakeOg:
    """A fake of the ``onnxruntime_genai`` Engine API (named so: og.Engine on a paged graph runs on
    CUDA only), behaving as og 0.18.0 did on the H200 with ``fixture:tiny-qwen3``: a greedy turn
    whose first token is the model's EOS ends with ``finish_reason`` EOS and no token event unless
    the turn asks for a minimum number of tokens; afterwards ``run`` returns no events."""

    class EngineEventFlags:
        TOKEN, FAILED = SimpleNamespace(value=1), SimpleNamespace(value=4)

    class FinishReason:
        NONE, EOS, MAX_GENERATED_TOKENS = "NONE", "EOS", "MAX_GENERATED_TOKENS"

    def __init__(self, honour_min: bool = True):
        self.honour_min, self.runs, self.turn = honour_min, 0, None
        og = self

        class TurnOptions:
            def __init__(self, req):
                self.min_tokens = 0
                og.turn = self

            def set_do_sample(self, v): pass
            def set_max_generated_tokens(self, n): pass

            def set_min_generated_tokens(self, n):
                self.min_tokens = n

        class Engine:
            def __init__(self, model):
                self.done = False

            def get_capabilities(self):
                return SimpleNamespace(configured_max_batch_size=8, max_request_length=512, max_scheduled_tokens=2048)

            def create_event_buffer(self, n): return None

            def create_request(self):
                return SimpleNamespace(begin_turn=lambda ids, opts: None, close=lambda: None)

            def run(self, buf):
                og.runs += 1
                if self.done:
                    return []
                self.done = True
                if og.turn.min_tokens >= 1 and og.honour_min:
                    return [SimpleNamespace(flags=SimpleNamespace(value=1), token=7, error_code=0,
                                            finish_reason=og.FinishReason.MAX_GENERATED_TOKENS)]
                return [SimpleNamespace(flags=SimpleNamespace(value=0), token=0, error_code=0, finish_reason=og.FinishReason.EOS)]

        self.TurnOptions, self.Engine = TurnOptions, Engine


def test_og_engine_inspection_asks_for_a_token_and_ends_with_the_turn():
    """The paged inspection's og.Engine token (``_inspect_child._og_engine_token``): a model whose
    greedy answer to the probe prompt is EOS still yields one token (the turn asks for at least
    one), and a turn that ends without a token is reported with its finish reason at once instead
    of 1000 empty Engine steps (on the H200, 2026-12-04, the trained fixture's paged export was
    disqualified as ``og.Engine gave no token in 1000 steps``)."""
    from adapters.ort_genai_export import _inspect_child

    og = _FakeOg()
    caps = _inspect_child._og_engine_token(og, og_model=None)
    assert caps["configured_max_batch_size"] == 8 and og.runs == 1
    stubborn = _FakeOg(honour_min=False)
    with pytest.raises(RuntimeError, match="finished the turn without a token .finish reason EOS"):
        _inspect_child._og_engine_token(stubborn, og_model=None)
    assert stubborn.runs == 1
