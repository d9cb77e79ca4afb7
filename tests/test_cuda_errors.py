"""CUDA failure classification on real log snippets (bakeoff/analysis/cuda_errors.py, backends/_server.py)."""

from __future__ import annotations

import json

import pytest

from backends._server import cuda_evidence, last_error_line
from bakeoff.analysis.cuda_errors import classify
from bakeoff.api.errors import EngineFailure

TORCH_OOM = """Traceback (most recent call last):
  File "/app/backends/transformers/worker.py", line 140, in _run
    self.model.generate(**enc, streamer=streamer, **kwargs)
  File "/opt/torch/.venv/lib/python3.12/site-packages/torch/nn/modules/linear.py", line 134, in forward
    return F.linear(input, self.weight, self.bias)
torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 594.00 MiB. GPU 0 has a total capacity of 139.81 GiB of which 1.94 MiB is free. Process 812 has 139.80 GiB memory in use.
"""
ILLEGAL = """(EngineCore_DP0 pid=1201) ERROR 11-30 06:01:02 [core.py:710] RuntimeError: CUDA error: an illegal memory access was encountered
(EngineCore_DP0 pid=1201) ERROR 11-30 06:01:02 [core.py:710] CUDA kernel errors might be asynchronously reported at some other API call
RuntimeError: Worker failed with error 'CUDA error: an illegal memory access was encountered', please check the stack trace above for the root cause
vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. See stack trace (above) for the root cause.
"""
NCCL = """[rank1]:[E1130 06:00:01 ProcessGroupNCCL.cpp:616] [Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=5, OpType=ALLREDUCE) ran for 600000 milliseconds before timing out.
torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/NCCLUtils.hpp:275, unhandled cuda error (run with NCCL_DEBUG=INFO for details), NCCL version 2.27.3
ncclUnhandledCudaError: Call to CUDA function failed.
"""
ARCH = "RuntimeError: CUDA error: no kernel image is available for execution on the device\n"
CPU_WARNING = ("UserWarning: CUDA initialization: Found no NVIDIA driver on your system.\n"
               "ValueError: unsupported quantization method awq\n")
ACCEL_OOM = """server error event: AcceleratorError: CUDA error: out of memory
Search for `cudaErrorMemoryAllocation' in https://docs.nvidia.com/cuda/cuda-runtime-api/group__CUDART__TYPES.html for more information.
CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace below might be incorrect.
For debugging consider passing CUDA_LAUNCH_BLOCKING=1
"""  # torch 2.11 on the H200 (examples/h200/), the worker holding all memory (gpu_headroom_gib=0)
HOST_OOM = "Out of memory: Killed process 1234 (python) total-vm:1234kB\n"


def test_torch_oom_is_runtime_crash_while_serving_and_load_failure_at_start():
    err = classify(TORCH_OOM)
    assert err.kind == "out-of-memory" and err.failure_class == "runtime-crash"
    assert err.line.startswith("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 594.00 MiB")
    assert classify(TORCH_OOM, phase="start").failure_class == "load-failure"


def test_exception_line_preferred_over_advice_lines():
    err = classify(ACCEL_OOM)
    assert err.kind == "out-of-memory"
    assert err.line == "server error event: AcceleratorError: CUDA error: out of memory"


def test_illegal_access_found_behind_engine_wrappers():
    err = classify(ILLEGAL)
    assert err.kind == "illegal-memory-access"
    assert "illegal memory access" in last_error_line(ILLEGAL)


def test_nccl_and_arch_errors():
    assert classify(NCCL).kind == "nccl"
    err = classify(ARCH, phase="start")
    assert err.kind == "cuda-error" and err.failure_class == "load-failure"


def test_non_cuda_logs_are_not_classified():
    assert classify(CPU_WARNING) is None  # torch's CPU-host warning is no CUDA failure
    assert classify(HOST_OOM) is None  # the kernel's OOM killer is a host matter
    assert classify("") is None
    assert last_error_line(CPU_WARNING) == "ValueError: unsupported quantization method awq"


def test_frame_lines_are_not_evidence():
    text = '  File "/x/cuda_oom_handler.py", line 3, in out_of_memory_retry\n'
    assert classify(text) is None


def test_cuda_evidence_on_engine_failure():
    exc = cuda_evidence(EngineFailure("runtime-crash", "server error event: engine_error"), TORCH_OOM, "serving")
    assert exc.failure_class == "runtime-crash"
    assert "CUDA out-of-memory" in exc.message
    assert json.loads(exc.evidence["cuda_error.json"])["kind"] == "out-of-memory"
    start = cuda_evidence(EngineFailure("load-failure", "transformers exited with 1 during start: x"), TORCH_OOM, "start")
    assert start.failure_class == "load-failure" and "cuda_error.json" in start.evidence
    hang = cuda_evidence(EngineFailure("hang", "no byte for 120 s"), NCCL, "serving")
    assert hang.failure_class == "hang"  # a hang stays a hang; the NCCL line is its evidence
    plain = cuda_evidence(EngineFailure("runtime-crash", "boom"), "ValueError: boom", "serving")
    assert "cuda_error.json" not in plain.evidence


VLLM_FREE_MEMORY = """(EngineCore pid=812) ERROR 12-02 01:50:11 [core.py:1012] ValueError: Free memory on device cuda:0 (139.81/140.39 GiB) on startup is less than desired GPU memory utilization (0.999, 140.25 GiB). Decrease GPU memory utilization or reduce GPU memory used by other processes.
RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}
"""  # vLLM's check before it allocates its KV cache, a too-high gpu_memory_utilization


def test_vllm_free_memory_check_is_an_out_of_memory_at_start():
    err = classify(VLLM_FREE_MEMORY, phase="start")
    assert err is not None and err.kind == "out-of-memory" and err.failure_class == "load-failure"
    assert "less than desired GPU memory utilization (0.999" in err.line


VLLM_ATTN_REFUSED = """(EngineCore pid=5513) ERROR 12-02 01:45:02 [core.py:1012] EngineCore failed to start.
(EngineCore pid=5513) ValueError: Selected backend AttentionBackendEnum.FLASHINFER is not valid for this configuration. Reason: ['head_size not supported']
"""  # vLLM 0.26.0 on the H200, --backend-opt attention_backend=FLASHINFER (examples/h200/)


@pytest.mark.parametrize("log, expected", [
    (VLLM_ATTN_REFUSED, "incompatible-features"),
    ("ValueError: No valid attention backend found for cpu", "incompatible-features"),
    ("ValueError: max_model_len 99999 exceeds the model's 2048", "load-failure"),
])
def test_vllm_start_failure_classes(tmp_path, log, expected):
    from backends import resolve
    from bakeoff.api.errors import EngineFailure
    from bakeoff.api.specs import BackendConfig

    backend = resolve("vllm")(BackendConfig(backend="vllm", model=str(tmp_path), workdir=str(tmp_path / "v")))
    exc = backend.classify_start_failure(EngineFailure("load-failure", "vllm exited", {"engine.log.tail": log}))
    assert exc.failure_class == expected
