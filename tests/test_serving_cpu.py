"""CPU per output token of each side of a sweep point, and the serving-bound mark
(bakeoff/loadgen/serving_cpu.py): the rule against the fidelity table it was drawn from, and the
reading on a real engine that bakeoff hosts behind its HTTP worker."""

from __future__ import annotations

import pytest

from bakeoff.loadgen.serving_cpu import serving_bound, serving_bound_note

# (engine, sessions, client + worker us, engine us, bakeoff / the engine's own loop), docs/benchmarks/fidelity.md
FIDELITY_ROWS = [
    ("vllm", 8, 55.0, 643.0, 1.02), ("optimum-ort", 1, 84.0, 677.0, 0.99), ("transformers", 1, 226.0, 2162.0, 0.97),
    ("optimum-ort", 8, 51.0, 156.0, 0.94), ("transformers", 8, 115.0, 473.0, 0.85), ("openvino", 1, 56.0, 365.0, 0.80),
    ("openvino", 8, 31.0, 99.0, 0.76), ("ort-genai", 1, 31.0, 104.0, 0.73), ("ort-genai", 8, 21.0, 44.0, 0.72),
]


@pytest.mark.parametrize("row", FIDELITY_ROWS, ids=[f"{r[0]}-{r[1]}" for r in FIDELITY_ROWS])
def test_the_rule_marks_every_row_under_095_and_none_above(row):
    _, _, serving_us, engine_us, ratio = row
    cpu = {"client": serving_us * 0.4, "bakeoff_worker": serving_us * 0.6, "engine": engine_us}
    assert serving_bound(cpu, "cpu") is serving_bound(cpu, "CPU") is (ratio < 0.95)


def test_no_mark_on_a_gpu_or_without_the_engine_side():
    fast = {"client": 20.0, "bakeoff_worker": 30.0, "engine": 141.0}  # ORT GenAI on an H100 at 32 sessions: 0.95
    assert serving_bound(fast, "NVIDIA H100 80GB HBM3") is False
    assert serving_bound({"client": 50.0}, "cpu") is False  # an attached server: its processes are not readable
    assert serving_bound(None, "cpu") is False
    assert serving_bound({**fast, "engine": 0.0}, "cpu") is False


def test_the_note_names_each_marked_point():
    pts = [{"sessions": 1, "serving_bound": False, "cpu_us_per_output_token": {"client": 1, "engine": 900}},
           {"sessions": 8, "serving_bound": True,
            "cpu_us_per_output_token": {"client": 9.0, "bakeoff_worker": 12.0, "engine": 44.0}}]
    note = serving_bound_note(pts)
    assert note.startswith("serving-bound at 8 sessions (CPU us per output token, engine/bakeoff's client+worker: 44/21)")
    assert serving_bound_note(pts[:1]) is None
    # four marked points still leave room in a check's 500-character summary for its figures before the note
    many = [{"sessions": n, "serving_bound": True,
             "cpu_us_per_output_token": {"client": 49.3, "bakeoff_worker": 112.5, "engine": 156.3}} for n in (1, 2, 4, 8)]
    assert len(serving_bound_note(many)) < 220 and "at 1, 2, 4, 8 sessions" in serving_bound_note(many)


@pytest.mark.slow
@pytest.mark.engine("transformers")
def test_a_sweep_reads_each_side_of_a_hosted_engine(tmp_path):
    """A real sweep on the transformers worker: each point's CPU per token splits into the client, bakeoff's
    HTTP worker and the engine process, each spent, and the mark follows the rule on what was read."""
    from backends import resolve
    from bakeoff.api.specs import BackendConfig, GenerationRequest
    from bakeoff.loadgen.throughput import SweepPlan, ThroughputSweep
    from bakeoff.models.resolve import resolve as resolve_model

    model = resolve_model("fixture:tiny-qwen3").path
    b = resolve("transformers")(BackendConfig(backend="transformers", model=model, workdir=str(tmp_path)))
    assert b.bakeoff_worker
    b.start()
    try:
        make = lambda s, t: GenerationRequest(request_id=f"s{s}-t{t}", prompt=f"count: {s} {t} =>",  # noqa: E731
                                              max_tokens=24, temperature=0.0, ignore_eos=True)
        res = ThroughputSweep(b, make, SweepPlan(sessions=[1, 4], requests_per_session=2, warmup=1,
                                                 max_tokens=24)).run()
    finally:
        b.stop()
    for p in res.points:
        cpu = p["cpu_us_per_output_token"]
        assert set(cpu) == {"client", "bakeoff_worker", "engine"}, cpu
        assert all(v > 0 for v in cpu.values()), cpu
        assert p["serving_bound"] is serving_bound(cpu, "cpu")
    assert ("serving-bound" in res.summary()) is any(p["serving_bound"] for p in res.points)


def test_thread_cpu_is_read_in_nanoseconds_and_agrees_with_the_kernels_ticks():
    """``thread_cpu_ns`` (schedstat, every thread) against psutil's 10 ms ticks of the same process."""
    import subprocess
    import sys

    import psutil

    from bakeoff.host.procs import thread_cpu_ns

    child = subprocess.Popen([sys.executable, "-c", "import time\nt = time.process_time()\n"
                              "while time.process_time() - t < 0.3: pass\nimport sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)
    try:
        p = psutil.Process(child.pid)
        while sum(p.cpu_times()[:2]) < 0.3:
            pass
        ns, ticks = thread_cpu_ns(child.pid), sum(p.cpu_times()[:2])
        assert ns is not None and ns % 10_000_000 != 0  # finer than a tick
        assert abs(ns / 1e9 - ticks) < 0.05, (ns, ticks)
    finally:
        child.kill()
        child.wait()
    assert thread_cpu_ns(child.pid) is None


def test_a_reading_that_fails_leaves_the_client_side_and_never_raises():
    """A process group whose reading raises (a damaged /proc, a fake) costs the point its engine side only."""
    from types import SimpleNamespace

    from bakeoff.loadgen.serving_cpu import cpu_reading, us_per_token

    class Broken:
        pid = 1

        def cpu_seconds_by_pid(self):
            raise OSError("no /proc here")

    got = cpu_reading(SimpleNamespace(proc=Broken(), bakeoff_worker=True))
    assert set(got) == {"client"}
    assert cpu_reading(object()).keys() == {"client"}  # loadgen drives anything with stream()
    # an engine side that went away between the readings reads 0, never negative
    assert us_per_token({"client": 1.0, "engine": 5.0}, {"client": 1.5, "engine": 2.0}, 1000)["engine"] == 0.0


def test_the_readings_own_cost_is_not_the_clients():
    """Reading the process group scans every process of the host (tens of ms at a few thousand processes):
    that CPU is bakeoff measuring, not bakeoff serving, and must not land on the client side of the point
    it measures (a 64-token point at 1,500 processes read ~560 us per token of 'client' from the scan)."""
    import asyncio
    import time as _time

    from bakeoff.api.specs import GenerationRequest, TokenEvent, Usage
    from bakeoff.loadgen.sweep import run_sweep

    def burn(s: float) -> None:
        t = _time.process_time()
        while _time.process_time() - t < s:
            pass

    class FakeSlowScanGroup:
        pid = 10**9  # not a live pid: the reading is all the fake's

        def cpu_seconds_by_pid(self):
            burn(0.05)  # what members() costs on a host with a few thousand processes
            return {self.pid: 1.0, self.pid + 1: 2.0}

    class FakeBackend:
        proc = FakeSlowScanGroup()
        bakeoff_worker = True

        async def stream(self, r):
            await asyncio.sleep(0.001)
            yield TokenEvent(t_ns=_time.monotonic_ns(), text="a b c d", token_ids=[1, 2, 3, 4])
            yield TokenEvent(t_ns=_time.monotonic_ns(), usage=Usage(3, 4), finish_reason="length")

        async def aclose(self):
            pass

    make = lambda s, t: GenerationRequest(request_id=f"s{s}-t{t}", prompt="x", max_tokens=4)  # noqa: E731
    out = run_sweep(FakeBackend(), make, [1], requests_per_session=4, warmup_requests=1)
    cpu = out["points"][0]["cpu_us_per_output_token"]
    # 16 tokens: one scan inside the point reads 50 ms / 16 = 3,125 us per token; the fake stream costs far less
    assert cpu["client"] < 1500, cpu


def test_pooled_repeats_never_read_a_missing_engine_side_as_zero():
    """Repeats pooled where one repeat's reading lost the engine side (its process group unreadable):
    the engine's CPU is not averaged with a 0 that was never measured (700 us read once would pool to
    350 and mark a point the only reading says is not serving-bound)."""
    from bakeoff.loadgen.throughput import _pooled_cpu

    reps = [{"output_tokens": 100, "cpu_us_per_output_token": {"client": 40.0, "bakeoff_worker": 0.0, "engine": 700.0}},
            {"output_tokens": 100, "cpu_us_per_output_token": {"client": 40.0}}]
    for order in (reps, reps[::-1]):
        pooled = _pooled_cpu(order)
        assert pooled == {"client": 40.0}, pooled
        assert serving_bound(pooled, "cpu") is False


def test_the_report_names_the_serving_bound_points_and_reads_any_run_directory():
    """report.md carries the note under the backend's sweep table; a run directory's points of any shape
    (an old run without the keys, a hand-edited one) never crash it."""
    from bakeoff.loadgen.serving_cpu import serving_bound_note

    good = {"sessions": 8, "serving_bound": True, "cpu_us_per_output_token": {"client": 9.0, "engine": 44.0}}
    assert "44/9" in serving_bound_note([good])
    for bad in ({"sessions": 8, "serving_bound": True}, {"sessions": 8, "serving_bound": True, "cpu_us_per_output_token": 5},
                {"sessions": 8, "serving_bound": "yes", "cpu_us_per_output_token": good["cpu_us_per_output_token"]},
                {"sessions": 8, "serving_bound": True, "cpu_us_per_output_token": {"client": "x", "engine": 44.0}}):
        assert serving_bound_note([bad]) is None, bad


def test_report_md_carries_the_note_under_the_sweep(tmp_path):
    """A run whose sweep marked points: report.md says so under that backend's sweep table; an old run
    without the keys renders as before."""
    import json

    from bakeoff.reporting.report import write_report

    def run(name: str, points: list) -> None:
        d = tmp_path / "runs" / name
        d.mkdir(parents=True)
        d.joinpath("verdict.json").write_text(json.dumps({
            "schema_version": 1, "run_id": name, "backend": name.split("_")[0], "model": "fixture:tiny-qwen3",
            "options": {}, "status": "qualified", "reasons": [], "backend_info": {"device": "cpu"},
            "checks": [{"name": "throughput.sweep", "status": "pass", "summary": "peak", "values": {"points": points}}]}))

    base = {"requests": 4, "ok": 4, "errors": 0, "input_tokens": 40, "output_tokens": 256, "output_tokens_per_s": 9000.0}
    run("ort-genai_a", [{**base, "sessions": 1, "serving_bound": True,
                         "cpu_us_per_output_token": {"client": 18.0, "bakeoff_worker": 13.0, "engine": 104.0}}])
    run("vllm_b", [{**base, "sessions": 1}])
    text = write_report([tmp_path / "runs"], tmp_path / "report").read_text()
    assert text.count("Serving-bound at 1 session (CPU us per output token, engine/bakeoff's client+worker: 104/31)") == 1
