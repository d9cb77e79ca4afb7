"""CUDA failures recognised in engine logs and exception messages.

A GPU engine that dies says so in a handful of recognisable ways: PyTorch's
``torch.OutOfMemoryError: CUDA out of memory. Tried to allocate ...``, the runtime's
``CUDA error: an illegal memory access was encountered`` (``cudaErrorIllegalAddress``), cuBLAS
and cuDNN status codes, a device-side assert, NCCL's ``ncclUnhandledCudaError`` or watchdog
timeouts. :func:`classify` finds the most specific such line in a text and maps it to a failure
class (docs/design.md "Failure classes"): ``load-failure`` when it happened while the engine
started, ``runtime-crash`` while it served; the line itself is the evidence.

Sources of the message forms: PyTorch ``c10/cuda/CUDACachingAllocator.cpp`` (OOM text),
CUDA runtime API error strings (https://docs.nvidia.com/cuda/cuda-runtime-api/group__CUDART__TYPES.html),
NCCL ``ncclResult_t`` names (https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/api/types.html).
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict

Kind = Literal["out-of-memory", "illegal-memory-access", "device-assert", "nccl", "cuda-library", "cuda-error"]

# (kind, regex, hint), most specific first: the first kind found anywhere in the text wins.
PATTERNS: list[tuple[Kind, re.Pattern[str], str]] = [
    ("out-of-memory", re.compile(r"CUDA out of memory|OutOfMemoryError|cudaErrorMemoryAllocation|"
                                 r"CUDA_ERROR_OUT_OF_MEMORY|CUBLAS_STATUS_ALLOC_FAILED|"
                                 r"CUDA error: out of memory|out of memory on device|"
                                 # vLLM's own check before it allocates (vllm/v1/worker/utils.py)
                                 r"Free memory on device.*less than desired GPU memory utilization", re.I),
     "GPU memory exhausted: lower the batch / KV cache share / context, or use a smaller dtype"),
    ("illegal-memory-access", re.compile(r"illegal memory access|cudaErrorIllegalAddress|"
                                         r"CUDA_ERROR_ILLEGAL_ADDRESS|misaligned address|"
                                         r"unspecified launch failure", re.I),
     "a kernel read or wrote out of bounds: an engine bug (run with CUDA_LAUNCH_BLOCKING=1 to locate it)"),
    ("device-assert", re.compile(r"device-side assert", re.I),
     "a kernel assertion fired (often an out-of-range token id or index)"),
    ("nccl", re.compile(r"\bNCCL (?:error|WARN|timeout)|nccl[A-Z][A-Za-z]*Error|ncclInvalidUsage|"
                        r"ProcessGroupNCCL.*(?:timed? ?out|Watchdog|error)|NCCL communicator", re.I),
     "collective communication failed between GPUs (topology, NCCL_* settings, a peer that died)"),
    ("cuda-library", re.compile(r"CUBLAS_STATUS_\w+|CUDNN_STATUS_\w+|CUSPARSE_STATUS_\w+|cuBLAS error", re.I),
     "a CUDA math library refused the call (unsupported shape/dtype on this GPU, or earlier corruption)"),
    ("cuda-error", re.compile(r"CUDA error:|cudaError[A-Z]\w+|CUDA_ERROR_\w+|no kernel image is available|"
                              r"CUDA driver version is insufficient"),
     "the CUDA runtime reported an error (see the line; a wrong driver or architecture at start)"),
]


EXC_LINE = re.compile(r"\b[A-Za-z_.]*(?:Error|Exception)\b:")


class CudaError(BaseModel):
    """A CUDA failure found in a text.

    Attributes:
        kind: out-of-memory, illegal-memory-access, device-assert, nccl, cuda-library, cuda-error.
        failure_class: ``load-failure`` (phase ``start``) or ``runtime-crash`` (``serving``).
        line: the line that names it (at most 400 characters): the evidence.
        hint: what it usually means.
    """

    model_config = ConfigDict(extra="forbid")
    kind: Kind
    failure_class: Literal["load-failure", "runtime-crash"]
    line: str
    hint: str


def classify(text: str, phase: Literal["start", "serving"] = "serving") -> CudaError | None:
    """The CUDA failure a log tail or exception message names, if any.

    The most specific kind present wins (an OOM reported through a cuBLAS failure is an OOM);
    within a kind, the last matching line (closest to the crash). Traceback frame lines
    (``File "...", line N``) are skipped: they name code, not errors.

    Args:
        text: log tail or exception message.
        phase: ``start`` while the engine loads (-> ``load-failure``), else ``serving``
            (-> ``runtime-crash``).

    Returns:
        The classification, or None when no CUDA failure is named.
    """
    lines = [ln.strip() for ln in (text or "").splitlines()
             if ln.strip() and not ln.lstrip().startswith('File "')]
    for kind, rx, hint in PATTERNS:
        hits = [ln for ln in lines if rx.search(ln)]
        # an exception line (``torch.AcceleratorError: CUDA error: out of memory``) over advice
        # lines that name the error code (``Search for `cudaErrorMemoryAllocation' in ...``)
        hits = [ln for ln in hits if EXC_LINE.search(ln)] or hits
        if hits:
            return CudaError(kind=kind, failure_class="load-failure" if phase == "start" else "runtime-crash",
                             line=hits[-1][:400], hint=hint)
    return None


def describe(err: CudaError) -> str:
    """One line for a check summary: ``CUDA out-of-memory: <line>``."""
    return f"CUDA {err.kind}: {err.line}"
