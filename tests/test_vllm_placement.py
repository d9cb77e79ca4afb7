"""vLLM CPU's process placement on a host whose worker decodes on one core (backends/vllm/placement.py):
the engine core beside the worker, the API server on the reserved core, and vLLM's own placement
kept wherever the rule does not apply."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from backends.vllm import placement

TWO_CORE_LOG = ("(EngineCore pid=1) INFO [ompmultiprocessing.py:185] OpenMP thread binding info: \n"
                "\tVLLM_CPU_OMP_THREADS_BIND='auto', auto_setup=True, skip_setup=False\n"
                "\tlocal_world_size=1, reserve_cpu_num=1\n\tlocal_rank=0, core ids=[0]\n\treserved_cpus=[1]\n")
needs_two = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 or not {0, 1} <= os.sched_getaffinity(0),
                               reason="needs cores 0 and 1")


def test_plan_reads_vllms_binding_lines():
    assert placement.plan(TWO_CORE_LOG) == ({0}, {1})
    many = TWO_CORE_LOG.replace("core ids=[0]", "core ids=[0, 1, 2]").replace("reserved_cpus=[1]", "reserved_cpus=[3]")
    assert "decodes on 3 cores" in placement.plan(many)
    assert "no OpenMP binding" in placement.plan("INFO nothing here")
    restarted = TWO_CORE_LOG + TWO_CORE_LOG.replace("[0]", "[2]").replace("[1]", "[3]")
    assert placement.plan(restarted) == ({2}, {3})  # the last start's lines


def _named(name: str) -> subprocess.Popen:
    """A sleeping child whose /proc comm is ``name`` (as vLLM names its processes), with a second thread."""
    code = (f"import threading, time; open('/proc/self/comm', 'w').write({name!r}); "
            "threading.Thread(target=time.sleep, args=(60,), daemon=True).start(); print('ok', flush=True); time.sleep(60)")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ok"
    return p


def _cores(pid: int) -> set[frozenset]:
    return {frozenset(os.sched_getaffinity(int(t))) for t in os.listdir(f"/proc/{pid}/task")}


@needs_two
def test_engine_core_joins_the_worker_and_the_frontend_gets_the_rest():
    api, core, worker = _named("python"), _named(placement.ENGINE_CORE), _named(placement.WORKER)
    mine = _cores(os.getpid())
    try:
        said = placement.place([api.pid, core.pid, worker.pid], api.pid, TWO_CORE_LOG)
        assert _cores(core.pid) == {frozenset({0})} and _cores(worker.pid) == {frozenset({0})}
        assert _cores(api.pid) == {frozenset({1})}
        assert _cores(os.getpid()) == mine  # the caller (bakeoff's client) stays where it was
        assert "engine core with the worker on core 0" in said and "API server on [1]" in said
    finally:
        for p in (api, core, worker):
            p.kill()
            p.wait()


@needs_two
def test_a_worker_on_several_cores_keeps_vllms_placement():
    core = _named(placement.ENGINE_CORE)
    try:
        before = _cores(core.pid)
        said = placement.place([core.pid], core.pid, TWO_CORE_LOG.replace("core ids=[0]", "core ids=[0, 1]"))
        assert said.startswith("vLLM's own") and "decodes on 2 cores" in said
        assert _cores(core.pid) == before
    finally:
        core.kill()
        core.wait()


@pytest.mark.slow
@pytest.mark.engine("vllm")
@needs_two
def test_real_vllm_cpu_is_placed(tmp_path):
    import backends
    from bakeoff.host import envs
    from bakeoff.api.specs import BackendConfig
    from bakeoff.models import fixtures

    if envs.has_cuda() or len(os.sched_getaffinity(0)) != 2:
        pytest.skip("the rule applies where vLLM CPU binds its worker to one of two cores")
    mine = _cores(os.getpid())
    v = backends.resolve("vllm")(BackendConfig(backend="vllm", model=str(fixtures.build("tiny-qwen3-untrained")),
                                               workdir=str(tmp_path), options={"kv_cache_space_gib": 1}))
    v.start()
    try:
        roles = {placement._comm(p): p for p in v.proc.members()}
        decode, front = placement.plan(v.log_path.read_text())
        assert _cores(roles[placement.ENGINE_CORE]) == {frozenset(decode)} == _cores(roles[placement.WORKER])
        assert _cores(v.proc.pid) == {frozenset(front)} and _cores(os.getpid()) == mine
        assert "engine core with the worker" in v.info.notes["cpu_placement"]
        # vLLM's ZMQ IPC sockets go to a folder of the run's own, not the system's temp folder ...
        rpc_dir = Path(v.rpc_dir)
        assert any(p.is_socket() for p in rpc_dir.iterdir()), list(rpc_dir.iterdir())
    finally:
        v.stop()
    assert not rpc_dir.exists()  # ... removed at stop (a stopped server leaves its socket files)


def test_several_ranks_keep_vllms_placement_and_say_so():
    two = ("(EngineCore pid=1) INFO [ompmultiprocessing.py:185] OpenMP thread binding info: \n"
           "\tlocal_rank=0, core ids=[0]\n\tlocal_rank=1, core ids=[1]\n\treserved_cpus=[]\n")
    said = placement.plan(TWO_CORE_LOG + two)  # the last start's lines count
    assert isinstance(said, str) and said.startswith("2 ranks, each bound to its CPUs"), said
    assert placement.plan(two + TWO_CORE_LOG) == ({0}, {1})
