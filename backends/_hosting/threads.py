"""How many threads a CPU engine's parallel regions get by default in a bakeoff worker.

A worker serves the engine behind an HTTP frontend (:mod:`backends._hosting.worker_server`), and
bakeoff's client runs on the same host: both need a core while the engine decodes. ONNX Runtime,
OpenVINO and torch default to one thread per core, so on a small host the engine's threads and the
frontend take turns on the same cores: ONNX Runtime's and OpenMP's spinning workers lose a whole
parallel region whenever one of their threads is descheduled. vLLM CPU reserves a core for its
frontend the same way (``VLLM_CPU_NUM_OF_RESERVED_CPU``; ``vllm/utils/ompmultiprocessing.py``
"for scheduler proc"; ``backends/vllm/placement.py``).

Measured on this project's 2-core host (2026-12-03, shared with other agents' tests, load average
2-3; ``fixture:tiny-qwen3``, 64 tokens x 4 requests per session; paired alternation of two workers
of the same export, 5 pairs): the ORT GenAI worker with 1 intra-op thread against ORT's default
of 2 gave 1.19x (1.04-2.21) output tokens/s at 1 session and 1.40x (1.25-2.24) at 8, half the CPU
per token; a bare ``og.Generator`` / ``og.Engine`` loop alone on the host 2-3x (1 thread: 9,800
tok/s at 1 session, 19,000-21,000 at 8; 2 threads: 3,500-4,400 and 5,100-7,100).

Standard library only: both bakeoff (to state the default) and the engine environments import it.
"""

from __future__ import annotations

import os

# One core is left to the worker's HTTP side and bakeoff's client.
FRONTEND_CPUS = 1


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask; ``os.cpu_count()`` where there is none)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def default_threads(cpus: int | None = None) -> tuple[int, str]:
    """bakeoff's default thread count for a CPU engine in a worker, and why (for the run's notes).

    Args:
        cpus: usable CPUs (default: :func:`usable_cpus`).

    Returns:
        ``(threads, reason)``: ``cpus - 1``, at least 1.
    """
    n = usable_cpus() if cpus is None else cpus
    threads = max(1, n - FRONTEND_CPUS)
    return threads, (f"bakeoff's CPU default: {n} usable CPUs less {FRONTEND_CPUS} for the worker's HTTP side and "
                     "the client (vLLM CPU reserves a core for its frontend the same way; "
                     "backends/_hosting/threads.py)")


def option_or_default(value: int | None, option: str) -> tuple[int, str]:
    """An engine's CPU thread count and why: the user's ``option`` where set, else
    :func:`default_threads`."""
    return (value, f"{option} option") if value is not None else default_threads()
