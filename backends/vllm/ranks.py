"""vLLM's ranks: what their processes are called, and where vLLM CPU binds them.

vLLM (0.26 CUDA, 0.32 CPU) starts one worker process per rank under its engine core and titles
it ``VLLM::Worker_TP1`` (``VLLM::Worker_PP0_TP1`` with pipeline stages, ``VLLM::Worker`` alone;
``vllm/v1/executor/multiproc_executor.py`` via ``setproctitle``): :data:`RANK_TITLE` reads the
stage and the tensor-parallel rank from it (:mod:`backends._ranks`).

On CPU each rank's OpenMP threads are bound by ``VLLM_CPU_OMP_THREADS_BIND``. Its default,
``auto``, puts rank N on the N-th NUMA node the process may use and refuses otherwise
(``vllm/utils/ompmultiprocessing.py``): on a host of one NUMA node, two ranks end the start with
``AssertionError: Not enough allowed NUMA nodes to bind threads of 2 local CPUWorkers. Allowed NUMA
nodes are [0]. Please try to bind threads manually or decrease DP/TP/PP.`` (vllm-cpu 0.32.0 on this
project's 2-core host, 2026-12-06). Binding by hand is the documented way out (vLLM's CPU
installation page: ``VLLM_CPU_OMP_THREADS_BIND=0-31|32-63`` for two ranks), so bakeoff's default,
when the user did not set the variable, splits the CPUs this process may use into one contiguous
list per rank (:func:`cpu_bind`), leaving the last CPU to the API server and engine core when
there are more CPUs than ranks, and says so in the run's notes. A user's own value (``--backend-opt
env.VLLM_CPU_OMP_THREADS_BIND=auto``, or bakeoff's environment) is passed as it is, and vLLM's
refusal is then the verdict's evidence (``config-rejected``).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

RANK_TITLE = re.compile(r"VLLM::Worker(?:_DP\d+)?(?:_PP(?P<pp>\d+))?(?:_TP(?P<tp>\d+))?\b")
NUMA_REFUSAL = "Not enough allowed NUMA nodes to bind threads"
# vllm/utils/ompmultiprocessing.py, a hand binding of another number of lists than ranks:
# "AssertionError: Given number of CPU id list ['abc'] doesn't match local world size 2."
BIND_MISMATCH = "doesn't match local world size"
# vllm/v1/executor/multiproc_executor.py, a worker lost while the executor waits for it
RANK_DIED = re.compile(r"Worker proc \S+ died unexpectedly[^\n]*")
BIND_VAR = "VLLM_CPU_OMP_THREADS_BIND"


def numa_nodes(allowed: set[int], root: Path = Path("/sys/devices/system/node")) -> int:
    """How many NUMA nodes hold a CPU of ``allowed`` (1 where sysfs says nothing)."""
    nodes = 0
    for node in sorted(root.glob("node[0-9]*")):
        try:
            cpus = _parse_list((node / "cpulist").read_text())
        except OSError:
            continue
        nodes += bool(cpus & allowed)
    return max(nodes, 1)


def _parse_list(text: str) -> set[int]:
    out: set[int] = set()
    for part in text.strip().split(","):
        if "-" in part:
            a, b = part.split("-", 1)
            out.update(range(int(a), int(b) + 1))
        elif part:
            out.add(int(part))
    return out


def _outside(value: str, allowed: set[int]) -> str:
    """Words for a hand binding that names CPUs this process may not use (none: '')."""
    try:
        named = set().union(*(_parse_list(part) for part in value.split("|")))
    except ValueError:
        return ""  # not CPU lists (auto, nobind, or what vLLM refuses in its own words)
    out = sorted(named - allowed)
    return (f"; it names CPUs {','.join(map(str, out))} that this host does not give the engine "
            f"(it may use {_ranges(sorted(allowed))}): those ranks' threads are not bound as asked") if out else ""


def _ranges(cpus: list[int]) -> str:
    return f"{cpus[0]}-{cpus[-1]}" if len(cpus) > 1 and cpus[-1] - cpus[0] == len(cpus) - 1 else ",".join(map(str, cpus))


def cpu_bind(world: int, allowed: set[int], nodes: int) -> tuple[str | None, str]:
    """bakeoff's ``VLLM_CPU_OMP_THREADS_BIND`` for ``world`` ranks on CPU, and why (None: vLLM's own).

    Args:
        world: tensor x pipeline parallel ranks.
        allowed: the CPUs this process may use (``os.sched_getaffinity``).
        nodes: NUMA nodes among them.
    """
    if world <= 1 or nodes >= world:
        return None, "vLLM's own (auto: one NUMA node per rank)"
    cpus = sorted(allowed)
    if len(cpus) < world:
        return None, (f"vLLM's own: {len(cpus)} CPUs for {world} ranks, too few to give each rank one; vLLM says "
                      "what it does")
    if len(cpus) > world:
        cpus = cpus[:-1]  # the last CPU for the API server and the engine core, as vLLM's auto reserve does
    per = len(cpus) // world
    lists = [cpus[i * per:(i + 1) * per] for i in range(world)]
    value = "|".join(_ranges(c) for c in lists)
    spare = sorted(allowed)[len(lists) * per:]
    left = (f"CPUs {_ranges(spare)} left to the API server and engine core" if spare
            else "no CPU left over: the API server and engine core share the ranks' CPUs")
    return value, (f"{BIND_VAR}={value} (bakeoff's CPU default for {world} ranks on {nodes} NUMA node"
                   f"{'s' if nodes > 1 else ''}: vLLM's auto binding wants a node per rank and refuses the start; "
                   f"{left}; backends/vllm/ranks.py; --backend-opt env.{BIND_VAR}=... to choose)")


def default_bind(tp: int | None, pp: int | None, user_env: dict[str, str]) -> tuple[dict[str, str], str | None]:
    """The variable to add for a CPU start (none when the user or bakeoff's environment set it), and the note."""
    world = (tp or 1) * (pp or 1)
    if world <= 1:
        return {}, None
    if BIND_VAR in user_env or BIND_VAR in os.environ:
        value = user_env.get(BIND_VAR, os.environ.get(BIND_VAR))
        return {}, f"{BIND_VAR}={value} (set by the user{_outside(value, os.sched_getaffinity(0))})"
    allowed = os.sched_getaffinity(0)
    value, why = cpu_bind(world, allowed, numa_nodes(allowed))
    return ({BIND_VAR: value} if value else {}), why


def classify_start(exc, log: str, bind_note: str | None):
    """A start failure in vLLM's words about its ranks: a binding the ranks cannot take
    (``config-rejected``, with what bakeoff did about ``VLLM_CPU_OMP_THREADS_BIND``), or a rank
    process lost during start (``runtime-crash``, vLLM's line first). Returns ``exc``, changed in place."""
    text = log + "\n" + exc.message
    if NUMA_REFUSAL in text or BIND_MISMATCH in text:
        exc.failure_class = "config-rejected"
        exc.message += f"; {BIND_VAR}: {bind_note or 'not set: vLLM binds each rank to its own NUMA node'}"
    died = RANK_DIED.search(log)
    if died and died.group(0) not in exc.message:
        exc.failure_class = "runtime-crash"
        exc.message = f"{died.group(0).strip()[:200]}; {exc.message}"
    return exc
