"""GPU telemetry through NVML: a background sampler, window summaries, energy per token.

On a CUDA host every run samples each GPU it may use (``CUDA_VISIBLE_DEVICES`` where it lists
NVML indices, else every GPU NVML sees: a tensor-parallel engine's ranks each hold one) at a fixed
interval (default 200 ms) into ``evidence/telemetry/gpu.jsonl``, each sample tagged with its
``gpu`` index: SM and memory utilisation (%), memory used (MiB), power
(W), SM and memory clocks (MHz), temperature (C) and NVML's energy counter (mJ, Volta and
later). :meth:`GpuSampler.summary` reduces the samples of a time window (``time.monotonic_ns``)
to means, maxima and energy; energy comes from the energy counter's difference when the GPU
has one, else from the power samples integrated over time (trapezoids).

``pynvml`` (package ``nvidia-ml-py``) is imported lazily: hosts without an NVIDIA driver
never load it. Sources: NVML API reference, https://docs.nvidia.com/deploy/nvml-api/
(``nvmlDeviceGetUtilizationRates``, ``nvmlDeviceGetPowerUsage`` in mW,
``nvmlDeviceGetTotalEnergyConsumption`` in mJ, ``nvmlDeviceGetClockInfo`` in MHz).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Callable

NO_GPU = "no NVIDIA GPU"


def load_nvml() -> tuple[Any | None, str]:
    """Import and initialise NVML.

    Returns:
        ``(pynvml module, "")`` on a host with an NVIDIA driver and at least one GPU, else
        ``(None, reason)`` where reason starts with ``no NVIDIA GPU``.
    """
    try:
        import pynvml
    except ImportError:
        return None, f"{NO_GPU} (nvidia-ml-py not installed)"
    try:
        pynvml.nvmlInit()
        if pynvml.nvmlDeviceGetCount() < 1:
            return None, f"{NO_GPU} (NVML sees 0 devices)"
    except Exception as exc:  # NVMLError_LibraryNotFound / DriverNotLoaded on CPU hosts
        return None, f"{NO_GPU} ({type(exc).__name__})"
    return pynvml, ""


def _safe(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception:  # a counter this GPU or driver lacks is left out, never fatal
        return None


def _text(v: Any) -> Any:
    return v.decode() if isinstance(v, bytes) else v


def read_sample(nvml: Any, handle: Any) -> dict[str, Any]:
    """One telemetry sample of ``handle`` (fields the GPU does not report are None).

    Returns:
        ``t_ns`` (``time.monotonic_ns``), ``sm_util_pct``, ``mem_util_pct``, ``mem_used_mib``,
        ``power_w``, ``sm_clock_mhz``, ``mem_clock_mhz``, ``temp_c``, ``energy_mj``.
    """
    util = _safe(lambda: nvml.nvmlDeviceGetUtilizationRates(handle))
    mem = _safe(lambda: nvml.nvmlDeviceGetMemoryInfo(handle))
    power_mw = _safe(lambda: nvml.nvmlDeviceGetPowerUsage(handle))
    return {
        "t_ns": time.monotonic_ns(),
        "sm_util_pct": getattr(util, "gpu", None),
        "mem_util_pct": getattr(util, "memory", None),
        "mem_used_mib": round(mem.used / 2**20, 1) if mem is not None else None,
        "power_w": power_mw / 1000.0 if power_mw is not None else None,
        "sm_clock_mhz": _safe(lambda: nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM)),
        "mem_clock_mhz": _safe(lambda: nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_MEM)),
        "temp_c": _safe(lambda: nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU)),
        "energy_mj": _safe(lambda: nvml.nvmlDeviceGetTotalEnergyConsumption(handle)),
    }


def _mean(xs: list[float]) -> float | None:
    return round(sum(xs) / len(xs), 2) if xs else None


def summarize(samples: list[dict[str, Any]], window: tuple[int, int] | None = None) -> dict[str, Any]:
    """Reduce samples (optionally those inside ``window = (t0_ns, t1_ns)``) to summary values; samples
    of several GPUs (their ``gpu`` index) are summarised per GPU (:func:`combine`).

    Returns:
        ``samples``, ``duration_s`` (first to last sample), ``window_s``; mean and max of SM
        utilisation (%), power (W), SM clock (MHz); max memory used (MiB); ``energy_j`` (mean
        power over the samples x ``window_s``) and its ``energy_source``
        (``nvml-energy-counter``, else ``power-integral`` of the power samples); no figures
        when no sample fell in the window.
    """
    gpus = sorted({x.get("gpu", 0) for x in samples})
    if len(gpus) > 1:
        return combine([dict(summarize([x for x in samples if x.get("gpu", 0) == g], window), gpu=g) for g in gpus])
    s = [x for x in samples if window is None or window[0] <= x["t_ns"] <= window[1]]
    out: dict[str, Any] = {"samples": len(s)}
    if not s:
        return out
    col = lambda k: [x[k] for x in s if x.get(k) is not None]  # noqa: E731
    out["duration_s"] = round((s[-1]["t_ns"] - s[0]["t_ns"]) / 1e9, 3)
    for key, name in (("sm_util_pct", "sm_util"), ("power_w", "power"), ("sm_clock_mhz", "sm_clock")):
        unit = key.rsplit("_", 1)[1]
        vals = col(key)
        out[f"{name}_mean_{unit}"] = _mean(vals)
        out[f"{name}_max_{unit}"] = max(vals) if vals else None
    out["mem_util_mean_pct"] = _mean(col("mem_util_pct"))
    out["mem_used_max_mib"] = max(col("mem_used_mib"), default=None)
    out["mem_clock_mean_mhz"] = _mean(col("mem_clock_mhz"))
    # energy = mean power over the samples' span x the window's length (samples are 200 ms
    # apart, so the span falls short of a window by up to one interval at each edge)
    span_s = window_s = (s[-1]["t_ns"] - s[0]["t_ns"]) / 1e9
    if window is not None:
        window_s = (window[1] - window[0]) / 1e9
    out["window_s"] = round(window_s, 3)
    mean_w, source = _mean_power(s, span_s)
    if mean_w is not None:
        out["energy_source"] = source
        out["energy_j"] = round(mean_w * window_s, 3)
    return out


def _mean_power(s: list[dict[str, Any]], span_s: float) -> tuple[float | None, str]:
    """Mean power (W) over one GPU's samples: from its energy counter, else the power samples' integral."""
    energy = [x for x in s if x.get("energy_mj") is not None]
    p = [x for x in s if x.get("power_w") is not None]
    if len(energy) >= 2 and energy[-1]["energy_mj"] > energy[0]["energy_mj"] and span_s > 0:
        return (energy[-1]["energy_mj"] - energy[0]["energy_mj"]) / 1000.0 / span_s, "nvml-energy-counter"
    if len(p) >= 2 and span_s > 0:
        return (sum((b["t_ns"] - a["t_ns"]) / 1e9 * (a["power_w"] + b["power_w"]) / 2 for a, b in zip(p, p[1:]))
                / span_s, "power-integral")
    if len(p) == 1:
        return p[0]["power_w"], "one power sample"
    return None, ""


def combine(per_gpu: list[dict[str, Any]]) -> dict[str, Any]:
    """One node's figures from each GPU's summary, every GPU counted once: energy and power summed
    (joules per token are the node's), memory used summed (each rank holds its own share), SM
    utilisation and clocks averaged over the GPUs, maxima the largest; ``gpus`` keeps each GPU's."""
    have = [g for g in per_gpu if g.get("samples")]
    out: dict[str, Any] = {"samples": sum(g["samples"] for g in per_gpu), "gpus": per_gpu}
    if not have:
        return out

    def total(key):
        vals = [g[key] for g in have if g.get(key) is not None]
        return round(sum(vals), 3) if vals else None

    def mean(key):
        vals = [g[key] for g in have if g.get(key) is not None]
        return _mean(vals)

    out.update({"duration_s": max(g["duration_s"] for g in have), "window_s": max(g["window_s"] for g in have),
                "power_mean_w": total("power_mean_w"), "power_max_w": total("power_max_w"),
                "sm_util_mean_pct": mean("sm_util_mean_pct"),
                "sm_util_max_pct": max((g["sm_util_max_pct"] for g in have if g.get("sm_util_max_pct") is not None),
                                       default=None),
                "sm_clock_mean_mhz": mean("sm_clock_mean_mhz"), "mem_util_mean_pct": mean("mem_util_mean_pct"),
                "mem_used_max_mib": total("mem_used_max_mib"), "mem_clock_mean_mhz": mean("mem_clock_mean_mhz")})
    if all(g.get("energy_j") is not None for g in have):
        out["energy_j"] = total("energy_j")
        out["energy_source"] = " + ".join(sorted({g["energy_source"] for g in have}))
    return out


def visible_gpus(nvml: Any, env: dict[str, str] | None = None) -> list[int]:
    """The NVML indices to sample: ``CUDA_VISIBLE_DEVICES`` where it is a list of indices (UUIDs and
    the like: every GPU), else every GPU NVML sees."""
    count = nvml.nvmlDeviceGetCount()
    raw = (env if env is not None else os.environ).get("CUDA_VISIBLE_DEVICES")
    if raw is not None and re.fullmatch(r"\s*\d+(\s*,\s*\d+)*\s*", raw):
        return [i for i in (int(x) for x in raw.split(",")) if i < count]
    return list(range(count))


def joules_per_token(summary: dict[str, Any], output_tokens: int | None) -> float | None:
    """Energy per output token (J/token) of a window summary; None without energy or tokens."""
    e = summary.get("energy_j")
    return round(e / output_tokens, 5) if e is not None and output_tokens else None


class GpuSampler:
    """Samples GPUs in a background thread; each sample is kept and appended to ``path``.

    Args:
        path: JSON-lines file the samples are appended to (None: memory only).
        interval_s: sampling interval in seconds (default 0.2).
        index: one NVML device index; None: :func:`visible_gpus` (every GPU the run may use).
        nvml: an initialised NVML module (default: :func:`load_nvml`); tests pass a fake.

    Raises:
        RuntimeError: when NVML cannot be loaded (the message says why).
    """

    def __init__(self, path: Path | None = None, interval_s: float = 0.2, index: int | None = None, nvml: Any = None):
        if nvml is None:
            nvml, reason = load_nvml()
            if nvml is None:
                raise RuntimeError(reason)
        self.nvml = nvml
        self.indices = [index] if index is not None else visible_gpus(nvml)
        self.handles = [(i, nvml.nvmlDeviceGetHandleByIndex(i)) for i in self.indices]
        self.path = Path(path) if path else None
        self.interval_s = interval_s
        self.samples: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> "GpuSampler":
        """Start sampling (idempotent); returns self."""
        if self._thread is None:
            if self.path:
                self.path.parent.mkdir(parents=True, exist_ok=True)
            self._thread = threading.Thread(target=self._loop, name="bakeoff-gpu-telemetry", daemon=True)
            self._thread.start()
        return self

    def _loop(self) -> None:
        fh = open(self.path, "a") if self.path else None
        try:
            nxt = time.monotonic()
            while not self._stop.is_set():
                samples = self._read()
                with self._lock:
                    self.samples.extend(samples)
                if fh:
                    fh.write("".join(json.dumps(x) + "\n" for x in samples))
                    fh.flush()
                nxt += self.interval_s
                self._stop.wait(max(0.0, nxt - time.monotonic()))
        finally:
            if fh:
                fh.close()

    def _read(self) -> list[dict[str, Any]]:
        """One sample of each GPU, stamped with one time (a window edge holds every GPU's or none)."""
        t_ns = time.monotonic_ns()
        return [dict(read_sample(self.nvml, h), gpu=i, t_ns=t_ns) for i, h in self.handles]

    def sample_now(self) -> dict[str, Any]:
        """Take one sample of each GPU at once (marks a window edge precisely), keep them; returns the first."""
        got = self._read()
        with self._lock:
            self.samples.extend(got)
            self.samples.sort(key=lambda x: x["t_ns"])
        return got[0]

    def stop(self) -> None:
        """Stop sampling (safe to call twice)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def summary(self, window: tuple[int, int] | None = None) -> dict[str, Any]:
        """:func:`summarize` over the samples so far (``window`` in ``time.monotonic_ns``)."""
        with self._lock:
            samples = list(self.samples)
        return summarize(samples, window)


def static_info(nvml: Any = None) -> dict[str, Any]:
    """GPU name, driver, CUDA version, memory, power limit and links of every GPU (NVML).

    Returns:
        ``{"driver", "cuda_version", "nvml_version", "gpus": [...]}``, or
        ``{"unavailable": reason}`` on hosts without an NVIDIA GPU.
    """
    if nvml is None:
        nvml, reason = load_nvml()
        if nvml is None:
            return {"unavailable": reason}
    cuda = _safe(nvml.nvmlSystemGetCudaDriverVersion_v2) or _safe(nvml.nvmlSystemGetCudaDriverVersion)
    out: dict[str, Any] = {"driver": _text(_safe(nvml.nvmlSystemGetDriverVersion)),
                           "cuda_version": f"{cuda // 1000}.{cuda % 1000 // 10}" if cuda else None,
                           "nvml_version": _text(_safe(nvml.nvmlSystemGetNVMLVersion)), "gpus": []}
    for i in range(nvml.nvmlDeviceGetCount()):
        h = nvml.nvmlDeviceGetHandleByIndex(i)
        mem = _safe(lambda: nvml.nvmlDeviceGetMemoryInfo(h))
        limit = _safe(lambda: nvml.nvmlDeviceGetPowerManagementLimit(h))
        nvlinks = 0
        for link in range(18):  # NVML_NVLINK_MAX_LINKS
            if _safe(lambda: nvml.nvmlDeviceGetNvLinkState(h, link)) == 1:
                nvlinks += 1
        out["gpus"].append({
            "index": i, "name": _text(_safe(lambda: nvml.nvmlDeviceGetName(h))),
            "memory_total_mib": round(mem.total / 2**20) if mem is not None else None,
            "power_limit_w": limit / 1000.0 if limit else None,
            "sm_clock_max_mhz": _safe(lambda: nvml.nvmlDeviceGetMaxClockInfo(h, nvml.NVML_CLOCK_SM)),
            "mem_clock_max_mhz": _safe(lambda: nvml.nvmlDeviceGetMaxClockInfo(h, nvml.NVML_CLOCK_MEM)),
            "pcie_gen": _safe(lambda: nvml.nvmlDeviceGetCurrPcieLinkGeneration(h)),
            "pcie_width": _safe(lambda: nvml.nvmlDeviceGetCurrPcieLinkWidth(h)),
            "nvlinks_active": nvlinks,
            "compute_capability": ".".join(map(str, _safe(lambda: nvml.nvmlDeviceGetCudaComputeCapability(h)) or ())) or None,
        })
    return out


def topology() -> str | None:
    """``nvidia-smi topo -m`` output (the interconnect matrix), None without nvidia-smi."""
    if not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def device_name(device: str | None, nvml: Any = None) -> str | None:
    """The GPU's own name for an engine that states only ``cuda`` / ``cuda:N`` (vLLM, ORT
    GenAI): the roofline's datasheet table is keyed by names (``NVIDIA H200``). Any other
    value, and ``cuda`` on a host NVML cannot read, is returned as given."""
    m = re.fullmatch(r"(?:cuda|gpu)(?::(\d+))?", (device or "").strip().lower())
    if not m:
        return device
    gpus = static_info(nvml).get("gpus") or []
    index = int(m.group(1) or 0)
    return (gpus[index].get("name") if index < len(gpus) else None) or device
