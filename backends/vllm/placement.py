"""Where vLLM CPU's processes run when its worker decodes on a single core (a 2-core host).

vLLM CPU (0.32.0) starts three processes: the API server (HTTP, detokenization, streaming),
the engine core (scheduler) and the worker (the model). It binds the worker's OpenMP threads
to the NUMA node's cores less ``reserve_cpu_num`` (``vllm/utils/ompmultiprocessing.py``: one
core on x86, "for scheduler proc"), states it in its log (``local_rank=0, core ids=[0]``,
``reserved_cpus=[1]``) and pins nothing else. The engine core and the worker wait for each
other through a shared-memory queue whose reader spins (``sched_yield``) for a second after each
read (``vllm/distributed/device_communicators/shm_broadcast.py`` ``SpinCondition``), so during
decoding the engine core keeps a core busy while the worker computes.

On a 2-core host that left the engine core spinning beside the API server and bakeoff's client:
streams arrived in bursts, whole streams at once (TPOT p50 0.01 ms, ``throughput.transport``
DISTORTED). Measured on this project's 2-core host (2026-12-03, AVX-512; one vLLM server re-pinned
live between placements, five runs of 3-4 rounds of bakeoff's sweep at 1 and 8 sessions, 64 tokens x
4 requests per session, other agents' work sharing the cores at load averages 4-15; issue 28's
report): vLLM's own placement gave bursty streams in 19 of 38 sweeps (median events per arrival
cluster up to 48, the first token held with up to 50 more, TTFT p50 100-223 ms in the quietest run);
the engine core on the worker's core and the API server on the other in 5 of 38 (4 of them in the
run at load average 15, where every placement was bursty; otherwise 1.07-1.3 events per cluster, the
first token alone, TTFT p50 16-46 ms in the quietest run), aggregate tokens/s at 8 sessions 14-85%
higher in each run (at 1 session -15% to +56%), and the engine core's CPU per run about 4x lower
(its spin yields to the worker, which is what it waits for). The engine core beside the API server
(what ``reserve_cpu_num`` suggests) was the worst. With its own core the frontend sends paced events
of 1.0-1.1 tokens each on the quietest run, 1.4-2 under load (its output collector merges the steps
it has not sent yet); bakeoff's sweep reads token ids, so its counts stay exact. Pinning bakeoff's
client to the frontend's core as well changed nothing worth moving the caller's process for, so the
client stays where it is.

:func:`place` applies that placement when the worker decodes on exactly one core and vLLM
reserved others; elsewhere (a worker on several cores, where the engine core would take a core
from a parallel region, or a log without the binding lines) it changes nothing and says why.
"""

from __future__ import annotations

import os
import re

BIND_LINE = re.compile(r"local_rank=0, core ids=\[([\d, ]*)\]")
RESERVED_LINE = re.compile(r"reserved_cpus=\[([\d, ]*)\]")
ENGINE_CORE, WORKER = "VLLM::EngineCor", "VLLM::Worker"  # /proc/PID/comm (15 characters)


def _ids(text: str) -> set[int]:
    return {int(x) for x in text.replace(" ", "").split(",") if x}


def plan(log: str) -> tuple[set[int], set[int]] | str:
    """``(decode cores, frontend cores)`` from vLLM's binding lines (the last start wins), or why
    no placement applies."""
    binds, reserved = BIND_LINE.findall(log), RESERVED_LINE.findall(log)
    if not binds or not reserved:
        return "vLLM stated no OpenMP binding (no 'core ids=[...]' / 'reserved_cpus=[...]' line)"
    decode, front = _ids(binds[-1]), _ids(reserved[-1])
    start = log[log.rfind("OpenMP thread binding info"):]  # the last start's lines
    ranks = len(re.findall(r"local_rank=\d+, core ids=", start))
    if ranks > 1:
        return (f"{ranks} ranks, each bound to its CPUs (see cpu_omp_threads_bind): vLLM's own placement kept (the "
                "engine core beside one rank would slow the step every rank waits for)")
    if len(decode) != 1 or not front:
        return (f"the worker decodes on {len(decode)} cores {sorted(decode)} with {sorted(front)} reserved: "
                "vLLM's own placement kept (the engine core would take a core from a parallel region)")
    return decode, front


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as fh:
            return fh.read().strip()
    except OSError:
        return ""


def _pin(pid: int, cores: set[int]) -> int:
    """Every thread of ``pid`` onto ``cores`` (``sched_setaffinity`` of a pid moves one thread)."""
    n = 0
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return 0
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cores)
            n += 1
        except OSError:  # a thread that ended meanwhile
            continue
    return n


def place(members: list[int], api_pid: int, log: str) -> str:
    """Pin the engine core with the worker and the API server on the reserved cores (module docstring).

    Args:
        members: PIDs of the engine's process group.
        api_pid: the API server's PID (the group leader).
        log: the engine log so far (its binding lines).

    Returns:
        The placement in words, for the run's notes.
    """
    p = plan(log)
    if isinstance(p, str):
        return f"vLLM's own ({p})"
    decode, front = p
    roles = {pid: _comm(pid) for pid in members}
    if not any(c == ENGINE_CORE for c in roles.values()):
        return "vLLM's own (no engine core process found)"
    for pid, comm in roles.items():
        if comm in (ENGINE_CORE, WORKER):
            _pin(pid, decode)
        elif pid == api_pid:
            _pin(pid, front)
    return (f"engine core with the worker on core {sorted(decode)[0]} (the worker's OpenMP binding), API server on "
            f"{sorted(front)} (vLLM's reserved cores): on one decode core the engine core's spin-wait otherwise "
            "starves the frontend (backends/vllm/placement.py)")
