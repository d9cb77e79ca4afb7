"""CPU per output token of each side of a sweep point, and whether bakeoff's own serving path bounds it.

bakeoff serves a token through processes an engine's own benchmark loop does not have: its client
(this process) and, for the engines it hosts (ORT GenAI, OpenVINO, optimum-ort, transformers), its HTTP
worker in front of the engine process. Where these share the engine's cores (an engine computing on
the CPU), their CPU is taken from the engine's, and an engine fast enough per token is under-reported:
bakeoff's figure is then its serving path's, not the engine's (``docs/benchmarks/fidelity.md``, "Where
bakeoff's figure stops being the engine's").

The rule (:func:`serving_bound`), from the fixture's fidelity table on the 2-core AMD host (2026-12-06:
bakeoff's tokens/s over the engine's own loop, with the CPU microseconds per output token of bakeoff's
client + HTTP worker, and of the engine's processes):

==========================  ===================  ==============  ======
engine, sessions            client + worker us   engine us       ratio
==========================  ===================  ==============  ======
vLLM, 8 (its own server)    55 (client only)     643             1.02
optimum-ort, 1              84                   677             0.99
transformers, 1             226                  2,162           0.97
optimum-ort, 8              51                   156             0.94
transformers, 8             115                  473             0.85
OpenVINO, 1                 56                   365             0.80
OpenVINO, 8                 31                   99              0.76
ORT GenAI, 1 / 8            31 / 21              104 / 44        0.73 / 0.72
==========================  ===================  ==============  ======

A point is **serving-bound** when the engine computes on the CPU, its processes spend less than
:data:`ENGINE_US_BOUND` (600) us of CPU per output token, and bakeoff's serving path spends at least
:data:`SHARE_BOUND` (10%) of that: every row above under 0.95 is caught, none at 0.95 or over. On a GPU
the engine's work is not on these cores (H100, ORT GenAI at 32 sessions: 141 us of the engine
process's CPU per token, ratio 0.95), so no GPU point is marked. The mark is information for the
reader of the figure, never a verdict: the engine's figure is what bakeoff measured, and the mark
says it may be the serving path's.
"""

from __future__ import annotations

import time
from typing import Any

ENGINE_US_BOUND = 600.0  # the engine's own CPU per output token below which bakeoff's path can bound it
SHARE_BOUND = 0.10  # bakeoff's serving path's CPU per token over the engine's, at or above which it does


def cpu_reading(backend, client_last: bool = False) -> dict[str, float]:
    """CPU seconds so far of the client (this process) and of the backend's process group, split into
    bakeoff's HTTP worker (the group's leader, where the backend hosts the engine behind one,
    ``Backend.bakeoff_worker``) and the engine's processes; only the client without a process group.

    Reading the group scans every process of the host (36 ms of this process's CPU at 1,500
    processes): that is bakeoff measuring, not serving, so a point's first reading stamps the client
    after its scan (``client_last``) and its last reading before, leaving both scans outside the point."""
    out = {"client": time.process_time()}
    proc = getattr(backend, "proc", None)  # loadgen drives any object with stream(); Backend declares proc
    try:
        by_pid = proc.cpu_seconds_by_pid() if proc is not None else {}
    except Exception:  # noqa: BLE001 - a reading is evidence, never a reason to crash a sweep
        by_pid = {}
    if client_last:
        out["client"] = time.process_time()
    if not by_pid:
        return out
    if getattr(backend, "bakeoff_worker", False):  # an engine's own server (vLLM's) is the engine's side
        out["bakeoff_worker"] = by_pid.pop(proc.pid, 0.0)
    out["engine"] = sum(by_pid.values())
    return out


def us_per_token(before: dict[str, float], after: dict[str, float], tokens: int) -> dict[str, float] | None:
    """CPU microseconds per output token of each side between two readings (a side whose processes
    changed meanwhile, e.g. an engine process that died, reads 0 at least); None without tokens."""
    if not tokens:
        return None
    return {k: round(max(0.0, after[k] - before.get(k, after[k])) / tokens * 1e6, 1) for k in after}


def serving_bound(cpu_us: dict[str, float] | None, device: str | None) -> bool:
    """Whether bakeoff's serving path bounds a point's figure (module docstring's rule)."""
    if not cpu_us or "engine" not in cpu_us or (device or "cpu").lower() != "cpu":  # OpenVINO says "CPU"
        return False
    engine_us = cpu_us["engine"]
    serving_us = cpu_us["client"] + cpu_us.get("bakeoff_worker", 0.0)
    return 0 < engine_us < ENGINE_US_BOUND and serving_us >= SHARE_BOUND * engine_us


def serving_bound_note(points: list[dict[str, Any]]) -> str | None:
    """One short sentence naming the serving-bound points (it ends a check's summary, which keeps 500
    characters), or None when there are none."""
    marked = [p for p in points if p.get("serving_bound") is True and _readable(p.get("cpu_us_per_output_token"))]
    if not marked:
        return None
    cpu = [p["cpu_us_per_output_token"] for p in marked]
    figures = ", ".join(f"{c['engine']:.0f}/{c['client'] + c.get('bakeoff_worker', 0.0):.0f}" for c in cpu)
    sessions = ", ".join(str(p["sessions"]) for p in marked)
    return (f"serving-bound at {sessions} session{'s' * (len(marked) > 1 or marked[0]['sessions'] != 1)} "
            f"(CPU us per output token, engine/bakeoff's client+worker: {figures}): bakeoff's tok/s there may "
            "understate the engine (docs/benchmarks/fidelity.md)")


def _readable(cpu: Any) -> bool:
    """A point's CPU sides as a sweep writes them (a run directory read back may hold anything)."""
    return (isinstance(cpu, dict) and all(isinstance(cpu.get(k, 0.0), (int, float)) for k in ("client", "bakeoff_worker"))
            and isinstance(cpu.get("engine"), (int, float)) and isinstance(cpu.get("client"), (int, float)))
