"""The run's GPU telemetry: the session's sampler (started with the run) and the ``telemetry.gpu``
check recorded at its end (a skip on hosts without an NVIDIA GPU)."""

from __future__ import annotations

import pytest

from bakeoff.api.verdict import Check
from bakeoff.host.artifacts import RunDir
from bakeoff.host.run import RunContext
from bakeoff.host.telemetry import GpuSampler, load_nvml
from evaluations.session import KEY_TELEMETRY


def start_telemetry(rundir: RunDir):
    """GPU sampler (200 ms) writing ``evidence/telemetry/gpu.jsonl`` on CUDA hosts, else the reason."""

    nvml, reason = load_nvml()
    if nvml is None:
        return reason
    return GpuSampler(rundir.path / "evidence" / "telemetry" / "gpu.jsonl", nvml=nvml).start()


def gpu_sampler(config: pytest.Config):
    """The session's GPU sampler (:class:`bakeoff.host.telemetry.GpuSampler`), None on hosts without one."""
    sampler = config.stash.get(KEY_TELEMETRY, None)
    return None if sampler is None or isinstance(sampler, str) else sampler


def record_telemetry(config: pytest.Config, run: RunContext) -> None:
    """The ``telemetry.gpu`` check: the session's GPU summary and the sweep's (skip on CPU hosts)."""

    sampler = config.stash.get(KEY_TELEMETRY, None)
    if sampler is None or isinstance(sampler, str):
        run.record(Check(name="telemetry.gpu", status="skip", summary=sampler or "no NVIDIA GPU"))
        return
    sampler.stop()
    values = {"session": sampler.summary(), "interval_s": sampler.interval_s}
    sweep = run.get("throughput.sweep")
    win = (sweep.values.get("gpu") or {}) if sweep else {}
    values.update({k: win.get(k) for k in ("energy_j", "joules_per_output_token", "power_mean_w", "sm_util_mean_pct")
                   if win.get(k) is not None})
    s = values["session"]
    run.record(Check(name="telemetry.gpu", status="pass", values=values, evidence=["evidence/telemetry/gpu.jsonl"],
                     summary=f"{s.get('samples')} samples: SM {s.get('sm_util_mean_pct')}% mean, power "
                             f"{s.get('power_mean_w')} W mean / {s.get('power_max_w')} W max, memory "
                             f"{s.get('mem_used_max_mib')} MiB max"
                             + (f"; {win['joules_per_output_token']} J/token over the sweep"
                                if win.get("joules_per_output_token") else "")))
