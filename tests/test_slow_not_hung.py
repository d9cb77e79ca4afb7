"""Slow is not hung (docs/design.md "Failure classes", the hang rule).

A FAKE engine (``tests/fakes/slow_servers.py``) launched as bakeoff launches engines (a
``ChildServerBackend``: its own process group) with a 1 s progress timeout:

- computing (burning CPU) for 3 s before its first byte: the request completes, not ``hang``;
- computing past the deadline (4 timeouts here): ``slo-miss`` at the deadline, with the CPU
  seconds it used over the time the request was open, and later requests still go;
- sleeping without CPU: ``hang`` within the timeout plus the watchdog's tick, with the CPU
  evidence (flat) in ``hang.json``;
- SIGSTOPped while computing: ``hang`` within two timeouts of the stop.

Through the ``openai`` backend (a server bakeoff did not launch) the same server's ``/metrics``
counters are the progress: advancing while it burns (not ``hang``), flat while it sleeps
(``hang``); without counters a timeout is a ``hang`` as before (``tests/test_openai_stalls.py``).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from backends._server import ChildServerBackend
from backends.openai.backend import OpenAIBackend
from bakeoff.api.specs import BackendConfig, BackendInfo, GenerationRequest, Spec
from bakeoff.loadgen.sweep import run_request
from tests.test_faults import assert_no_process_left

REPO = Path(__file__).resolve().parent.parent
TIMEOUT_S = 1.0
# the watchdog wakes a reader every 0.5 s (bakeoff/loadgen/http.py Pool._watch); slack for a loaded 2-core host
TICK_S, SLACK_S = 0.5, 1.5


class SlowDouble(ChildServerBackend):
    """A FAKE engine backend: the slow server of tests/fakes/slow_servers.py, launched in its own process group."""

    name, Options, ready_mode = "slow-double", Spec, "health"

    def command(self, port):
        return [sys.executable, "-m", "tests.fakes.slow_servers", "--port", str(port)], dict(os.environ, PYTHONPATH=str(REPO))

    def describe(self, startup_s: float) -> BackendInfo:
        return BackendInfo(backend=self.name, engine="slow-double", base_url=self.base_url, served_model="slow-double",
                           startup_s=startup_s)


@pytest.fixture(scope="module")
def double(tmp_path_factory):
    """The launched FAKE engine: progress timeout 1 s, deadline 4 timeouts."""
    work = tmp_path_factory.mktemp("slow")
    b = SlowDouble(BackendConfig(backend="slow-double", model="m", workdir=str(work), start_timeout_s=60,
                                 progress_timeout_s=TIMEOUT_S, request_deadline_factor=4))
    b.start()
    yield b
    b.stop()
    assert_no_process_left(work)


def send(backend, prompt: str, max_tokens: int = 4, during=None):
    """One request through ``backend``; ``during(t_send)`` runs beside it. Returns (record, seconds)."""
    async def main():
        try:
            task = asyncio.ensure_future(run_request(backend, GenerationRequest(request_id=f"r{time.monotonic_ns()}",
                                                                                prompt=prompt, max_tokens=max_tokens)))
            if during is not None:
                await during()
            return await task
        finally:
            await backend.aclose()
    t0 = time.monotonic()
    rec = asyncio.run(main())
    return rec, time.monotonic() - t0


@pytest.mark.parametrize("kind", ["burn", "burn-head"])
def test_computing_longer_than_the_timeout_is_not_a_hang(double, kind):
    """2.5 s of computing before the first byte (the head sent first, or not even the head) with a
    1 s timeout: a hang before (no byte for 1 s), a completed request now."""
    rec, took = send(double, f"{kind} 2.5")
    assert rec.status == "ok", rec.error
    assert rec.output_text == " t0 t1 t2 t3" and took >= 2.5, (rec.output_text, took)
    assert double.failed is None


def test_computing_past_the_deadline_is_slow_not_hang(double):
    rec, took = send(double, "burn 6")
    assert rec.status == "error" and rec.error_class == "slo-miss", (rec.error_class, rec.error)
    assert 4.0 <= took < 4.0 + TICK_S + SLACK_S, took  # the deadline: 4 x the 1 s timeout from the send
    assert "slow, not hung" in rec.error and "deadline of 4 s" in rec.error, rec.error
    assert "CPU s in" in rec.error and "of one core" in rec.error, rec.error
    assert double.failed is None  # not hung: the next request goes (and gets its answer)
    rec2, _ = send(double, "hello")
    assert rec2.status == "ok", rec2.error


def _failure(backend, prompt: str, during=None):
    """The EngineFailure of one request, straight from the backend's stream."""
    from bakeoff.api.errors import EngineFailure

    async def main():
        try:
            async for _ in backend.stream(GenerationRequest(request_id="x", prompt=prompt, max_tokens=2)):
                pass
        except EngineFailure as exc:
            return exc
        finally:
            await backend.aclose()

    async def both():
        task = asyncio.ensure_future(main())
        if during is not None:
            await during()
        return await task
    t0 = time.monotonic()
    exc = asyncio.run(both())
    return exc, time.monotonic() - t0


@pytest.fixture
def fresh(tmp_path):
    """A launched FAKE engine of its own (a hang marks a backend failed for the rest of its life)."""
    b = SlowDouble(BackendConfig(backend="slow-double", model="m", workdir=str(tmp_path), start_timeout_s=60,
                                 progress_timeout_s=TIMEOUT_S, request_deadline_factor=30))
    b.start()
    yield b
    b.stop()
    assert_no_process_left(tmp_path)


def test_a_sleeping_engine_is_a_hang_with_flat_cpu(fresh):
    exc, took = _failure(fresh, "sleep 4")
    assert exc is not None and exc.failure_class == "hang", exc
    assert took < TIMEOUT_S + TICK_S + SLACK_S, took
    assert "no byte for 1 s" in exc.message and "no progress: the engine used 0.0" in exc.message, exc.message
    window = json.loads(exc.evidence["hang.json"])["progress"]["window"]
    assert window["unit"] == "CPU s" and not window["computing"] and window["window_s"] >= TIMEOUT_S / 2, window
    assert window["used"] < 0.1 * window["window_s"], window  # flat: under 10% of one core


@pytest.mark.parametrize("busy_before", ["burn 0.8", "stall"])
def test_work_before_the_silence_does_not_hide_a_hang(fresh, busy_before):
    """The window starts inside the silence: CPU the engine spent just before it (a previous
    request's prefill, or this request's own before its tokens stopped) does not count as
    progress, so the hang is told at the first check (at most a quarter timeout later)."""
    if busy_before == "stall":
        exc, took = _failure(fresh, "stall 4")
    else:
        assert send(fresh, busy_before)[0].status == "ok"
        exc, took = _failure(fresh, "sleep 4")
    assert exc is not None and exc.failure_class == "hang", exc
    assert took < (0.5 if busy_before == "stall" else 0) + 1.25 * TIMEOUT_S + TICK_S + SLACK_S, took
    record = json.loads(exc.evidence["hang.json"])
    assert record["progress"]["window"]["used"] < 0.1 * record["progress"]["window"]["window_s"], record
    assert record["bytes"] > 0 if busy_before == "stall" else record["bytes"] == 0, record


def test_a_stopped_engine_is_a_hang_within_two_timeouts(fresh):
    stopped = {}

    async def stop_soon():
        await asyncio.sleep(0.3)
        os.killpg(fresh.proc.pgid, signal.SIGSTOP)
        stopped["t"] = time.monotonic()
    try:
        exc, _ = _failure(fresh, "burn 5", stop_soon)
        after_stop_s = time.monotonic() - stopped["t"]
    finally:
        os.killpg(fresh.proc.pgid, signal.SIGCONT)
    assert exc is not None and exc.failure_class == "hang", exc
    # the window that holds the stop may still show its CPU; the next one is flat
    assert after_stop_s < 2 * TIMEOUT_S + 2 * TICK_S + SLACK_S, after_stop_s
    assert "stopped (SIGSTOP)" in exc.message and "no progress" in exc.message, exc.message
    window = json.loads(exc.evidence["hang.json"])["progress"]["window"]
    assert window["used"] < 0.1 * window["window_s"], window


# ---- a server bakeoff did not launch: its /metrics counters ------------------------------------

def attach(tmp_path, url: str) -> OpenAIBackend:
    b = OpenAIBackend(BackendConfig(backend="openai", model="remote", workdir=str(tmp_path), start_timeout_s=30,
                                    request_deadline_factor=30,
                                    options={"base_url": url, "read_timeout_s": TIMEOUT_S}))
    b.start()
    return b


def test_attached_server_computing_with_advancing_counters_is_not_a_hang(double, tmp_path):
    b = attach(tmp_path, double.base_url)
    assert b.info.notes["progress"].startswith("GET /metrics token"), b.info.notes
    rec, took = send(b, "burn 2.5")
    assert rec.status == "ok" and took >= 2.5, (rec.error, took)


def test_attached_server_with_flat_counters_is_a_hang(fresh, tmp_path):
    b = attach(tmp_path, fresh.base_url)
    rec, took = send(b, "sleep 4")
    assert rec.status == "error" and rec.error_class == "hang", rec.error
    assert "no progress" in rec.error and "tokens" in rec.error and took < TIMEOUT_S + TICK_S + SLACK_S, (rec.error, took)
