"""How much memory vLLM CPU may take: a NUMA node's memory as vLLM CPU counts it, and bakeoff's
``gpu_memory_utilization`` default on CPU (:func:`cpu_memory_utilization`)."""

from __future__ import annotations

from pathlib import Path

CPU_MEMORY_SHARE = 0.5  # vLLM CPU's default 0.92 of the node fails on small hosts (docs/field-notes.md)
CPU_AVAILABLE_SHARE = 0.8  # of the memory available at start, when less than half the node is


def node_memory(node: int = 0) -> tuple[int, int] | None:
    """(total, available) bytes of a NUMA node as vLLM CPU counts them (``MemFree`` plus file
    pages and reclaimable slabs, ``vllm/utils/cpu_resource_utils.py`` 0.32.0), else None."""
    try:
        info = {}
        for line in Path(f"/sys/devices/system/node/node{node}/meminfo").read_text().splitlines():
            parts = line.split()
            info[parts[2].rstrip(":")] = int(parts[3]) * 1024
        free = info["MemFree"] + info["Active(file)"] + info["Inactive(file)"] + info.get("SReclaimable", 0)
        return info["MemTotal"], free
    except (OSError, KeyError, ValueError, IndexError):
        return None


def cpu_memory_utilization() -> tuple[float, str]:
    """bakeoff's ``gpu_memory_utilization`` on vLLM CPU when the user sets none: half the NUMA
    node, or 80% of what is available at start when that is less (vLLM CPU refuses to start
    when the share it is given exceeds the node's available memory: "Available memory on node 0
    (10.07/23.54 GiB) on kv cache allocation is less than requested memory for kv", seen when
    another engine was still running). Returns the value and a note for the run's evidence."""
    mem = node_memory()
    if mem is None or mem[0] <= 0:  # a node of 0 bytes reads as unreadable
        return CPU_MEMORY_SHARE, f"{CPU_MEMORY_SHARE} (bakeoff's CPU default; node memory not readable)"
    total, available = mem
    share = min(CPU_MEMORY_SHARE, round(CPU_AVAILABLE_SHARE * available / total, 2))
    share = max(share, 0.05)
    why = ("half the node" if share == CPU_MEMORY_SHARE else
           f"{CPU_AVAILABLE_SHARE:.0%} of the {available / 2**30:.1f} GiB available at start, less than half the node")
    return share, f"{share} of node 0's {total / 2**30:.1f} GiB (bakeoff's CPU default: {why})"
