"""GPU telemetry (bakeoff/host/telemetry.py).

No GPU runs here, so the sampler is driven by ``FakeNvml``, a fake of the few NVML calls it
makes (named as such); the real path is the GPU test at the end, which skips on CPU hosts
with the reason, and ran on the H200 (examples/h200/).
"""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest

from bakeoff.host.telemetry import GpuSampler, joules_per_token, load_nvml, static_info, summarize


class FakeNvml:
    """A fake NVML (not the library): 300 W constant, 50% SM, an energy counter in mJ."""

    NVML_CLOCK_SM, NVML_CLOCK_MEM, NVML_TEMPERATURE_GPU = 0, 2, 0

    def __init__(self, energy_counter: bool = True):
        self.t0 = time.monotonic()
        self.energy_counter = energy_counter

    def nvmlDeviceGetCount(self):
        return 1

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetUtilizationRates(self, h):
        return SimpleNamespace(gpu=50, memory=20)

    def nvmlDeviceGetMemoryInfo(self, h):
        return SimpleNamespace(used=10 * 2**30, total=141 * 10**9)

    def nvmlDeviceGetPowerUsage(self, h):
        return 300_000  # mW

    def nvmlDeviceGetClockInfo(self, h, kind):
        return 1980 if kind == self.NVML_CLOCK_SM else 3201

    def nvmlDeviceGetTemperature(self, h, kind):
        return 40

    def nvmlDeviceGetTotalEnergyConsumption(self, h):
        if not self.energy_counter:
            raise RuntimeError("NVMLError_NotSupported")
        return int((time.monotonic() - self.t0) * 300_000)  # 300 W in mJ

    def nvmlSystemGetDriverVersion(self):
        return "580.159.04"

    def nvmlSystemGetCudaDriverVersion_v2(self):
        return 13000

    def nvmlSystemGetNVMLVersion(self):
        return "13.580.159.04"

    def nvmlDeviceGetName(self, h):
        return b"NVIDIA H200"

    def __getattr__(self, name):  # every other NVML call: not supported on this fake GPU
        def unsupported(*a):
            raise RuntimeError("NVMLError_NotSupported")
        return unsupported


def _samples(power_w: list[float], dt_s: float = 0.2, energy: bool = True) -> list[dict]:
    out, e = [], 0.0
    for i, p in enumerate(power_w):
        if i:
            e += (power_w[i - 1] + p) / 2 * dt_s * 1000
        out.append({"t_ns": int(i * dt_s * 1e9), "sm_util_pct": 80, "power_w": p, "mem_used_mib": 1000.0 + i,
                    "sm_clock_mhz": 1980, "energy_mj": e if energy else None})
    return out


def test_summary_energy_from_counter_and_from_power():
    s = _samples([100, 200, 300, 200, 100])
    a = summarize(s)
    assert a["energy_source"] == "nvml-energy-counter" and a["energy_j"] == pytest.approx(160.0)
    b = summarize(_samples([100, 200, 300, 200, 100], energy=False))
    assert b["energy_source"] == "power-integral" and b["energy_j"] == pytest.approx(160.0)
    assert a["power_mean_w"] == 180 and a["power_max_w"] == 300 and a["mem_used_max_mib"] == 1004.0
    # a window wider than its samples' span: mean power x window length
    w = summarize(s, (0, int(1.0e9)))
    assert w["window_s"] == 1.0 and w["energy_j"] == pytest.approx(200.0)
    assert summarize(s, (10**12, 2 * 10**12)) == {"samples": 0}
    assert joules_per_token(a, 160) == 1.0 and joules_per_token(a, 0) is None and joules_per_token({}, 5) is None


def test_sampler_writes_jsonl_and_summarises(tmp_path):
    path = tmp_path / "telemetry" / "gpu.jsonl"
    sampler = GpuSampler(path, interval_s=0.02, nvml=FakeNvml()).start()
    time.sleep(0.3)
    edge = sampler.sample_now()
    sampler.stop()
    sampler.stop()  # twice is safe
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) >= 5 and rows[0]["power_w"] == 300.0 and rows[0]["sm_clock_mhz"] == 1980
    assert rows[0]["temp_c"] == 40 and rows[0]["mem_used_mib"] == 10240.0
    s = sampler.summary((rows[0]["t_ns"], edge["t_ns"]))
    assert s["power_mean_w"] == 300.0 and s["sm_util_mean_pct"] == 50
    assert s["energy_j"] == pytest.approx(300.0 * s["window_s"], rel=0.05)


def test_static_info_with_fake_nvml():
    info = static_info(FakeNvml())
    assert info["driver"] == "580.159.04" and info["cuda_version"] == "13.0"
    assert info["gpus"][0]["name"] == "NVIDIA H200" and info["gpus"][0]["nvlinks_active"] == 0


def test_cpu_host_reports_no_gpu():
    nvml, reason = load_nvml()
    if nvml is not None:
        pytest.skip("this host has an NVIDIA GPU")
    assert reason.startswith("no NVIDIA GPU")
    assert static_info()["unavailable"].startswith("no NVIDIA GPU")
    with pytest.raises(RuntimeError, match="no NVIDIA GPU"):
        GpuSampler()


def test_real_gpu_sampler(tmp_path):
    nvml, reason = load_nvml()
    if nvml is None:
        pytest.skip(reason)
    sampler = GpuSampler(tmp_path / "gpu.jsonl", interval_s=0.05).start()
    time.sleep(0.5)
    sampler.stop()
    s = sampler.summary()
    assert s["samples"] >= 5 and s["power_mean_w"] > 0 and s["mem_used_max_mib"] is not None
    assert static_info()["gpus"][0]["name"]


class TwoGpuFakeNvml(FakeNvml):
    """A fake NVML (not the library) of two GPUs: GPU 0 at 300 W and 50% SM, GPU 1 at 100 W and 10% SM,
    10 and 4 GiB used (a tensor-parallel engine's two ranks)."""

    def nvmlDeviceGetCount(self):
        return 2

    def nvmlDeviceGetUtilizationRates(self, h):
        return SimpleNamespace(gpu=(50, 10)[h], memory=20)

    def nvmlDeviceGetMemoryInfo(self, h):
        return SimpleNamespace(used=(10, 4)[h] * 2**30, total=141 * 10**9)

    def nvmlDeviceGetPowerUsage(self, h):
        return (300_000, 100_000)[h]

    def nvmlDeviceGetTotalEnergyConsumption(self, h):
        return int((time.monotonic() - self.t0) * (300_000, 100_000)[h])


def test_two_gpus_are_sampled_each_and_counted_once(tmp_path):
    """Each GPU a rank holds is sampled and summarised on its own; the node's energy and power are their
    sum (J/token over both), memory used their sum, SM utilisation their mean: nothing counted twice."""
    sampler = GpuSampler(tmp_path / "gpu.jsonl", interval_s=0.02, nvml=TwoGpuFakeNvml()).start()
    t0 = sampler.sample_now()["t_ns"]
    time.sleep(0.3)
    t1 = sampler.sample_now()["t_ns"]
    sampler.stop()
    rows = [json.loads(line) for line in (tmp_path / "gpu.jsonl").read_text().splitlines()]
    assert {r["gpu"] for r in rows} == {0, 1} and sampler.indices == [0, 1]
    s = sampler.summary((t0, t1))
    per = {g["gpu"]: g for g in s["gpus"]}
    assert per[0]["power_mean_w"] == 300.0 and per[1]["power_mean_w"] == 100.0
    assert s["power_mean_w"] == 400.0 and s["sm_util_mean_pct"] == 30 and s["mem_used_max_mib"] == 14336.0
    assert s["energy_j"] == pytest.approx(400.0 * s["window_s"], rel=0.05)
    assert s["energy_j"] == pytest.approx(per[0]["energy_j"] + per[1]["energy_j"])
    assert s["samples"] == per[0]["samples"] + per[1]["samples"]
    assert joules_per_token(s, 100) == pytest.approx(s["energy_j"] / 100)


def test_visible_gpus_follow_cuda_visible_devices():
    from bakeoff.host.telemetry import visible_gpus

    nvml = TwoGpuFakeNvml()
    assert visible_gpus(nvml, {}) == [0, 1]
    assert visible_gpus(nvml, {"CUDA_VISIBLE_DEVICES": "1"}) == [1]
    assert visible_gpus(nvml, {"CUDA_VISIBLE_DEVICES": "0, 1, 5"}) == [0, 1]  # an index NVML lacks is left out
    assert visible_gpus(nvml, {"CUDA_VISIBLE_DEVICES": "GPU-8c1f"}) == [0, 1]  # UUIDs: every GPU
