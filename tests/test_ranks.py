"""Multi-process engines: every rank seen, its environment verified, a lost or stuck rank classed right.

A FAKE engine of two ranks (``tests/fakes/ranked_servers.py``, titled ``FAKE::Worker_TP0/1`` as vLLM
titles its ranks) launched as bakeoff launches engines (a ``ChildServerBackend``, its own process
group, 1 s progress timeout):

- a variable set for the engine that did not reach rank 1: the start fails ``config-rejected``
  naming the variable and the rank, with ``ranks.json``; every variable present: the start
  passes, each rank's record (pid, title, CPU, memory) in ``ranks.json``; ranks that write no
  report (``python -S``) are read from ``/proc``;
- rank 1 spinning on a core while rank 0 waits and the API sends nothing: ``hang`` within the
  timeout plus the watchdog's tick, with the per-rank CPU (the group's CPU alone would call it
  computing and wait the deadline);
- rank 1 killed mid-request: ``runtime-crash`` naming rank TP1, whether the server follows it
  down (vLLM's way) or keeps its port and answers nothing;
- vLLM's per-rank log lines (KV memory) counted once per rank, an earlier start's not at all.

The real vLLM CPU with two ranks is ``tests/test_vllm_ranks.py``.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

import pytest

from backends._server import ChildServerBackend
from bakeoff.api.errors import EngineFailure
from bakeoff.api.specs import BackendConfig, BackendInfo, Spec
from tests.test_faults import assert_no_process_left
from tests.test_slow_not_hung import SLACK_S, TICK_S, _failure

REPO = Path(__file__).resolve().parent.parent
TIMEOUT_S = 1.0
FLAG = "BAKEOFF_FAKE_RANK_FLAG"


class RankedOptions(Spec):
    env: dict[str, str] = {}


class RankedDouble(ChildServerBackend):
    """A FAKE engine backend: the two-rank server of tests/fakes/ranked_servers.py."""

    name, Options, ready_mode = "ranked-double", RankedOptions, "health"
    rank_title = re.compile(r"FAKE::Worker(?:_PP(?P<pp>\d+))?(?:_TP(?P<tp>\d+))?\b")
    server_args: list[str] = []
    ranks_asked: int | None = None

    def expected_ranks(self):
        return self.ranks_asked

    def command(self, port):
        self.engine_env_set = {FLAG: "on"}
        env = dict(os.environ, PYTHONPATH=str(REPO), **self.engine_env_set)
        return [sys.executable, "-m", "tests.fakes.ranked_servers", "--port", str(port), *self.server_args], env

    def describe(self, startup_s: float) -> BackendInfo:
        return BackendInfo(backend=self.name, engine="ranked-double", base_url=self.base_url,
                           served_model="ranked-double", startup_s=startup_s)


def launched(tmp_path, *server_args, options=None) -> RankedDouble:
    b = RankedDouble(BackendConfig(backend="ranked-double", model="m", workdir=str(tmp_path), start_timeout_s=60,
                                   progress_timeout_s=TIMEOUT_S, request_deadline_factor=30, options=options or {}))
    b.server_args = list(server_args)
    return b


@pytest.fixture
def engine(tmp_path):
    made = []

    def start(*server_args, options=None):
        b = launched(tmp_path, *server_args, options=options)
        made.append(b)
        b.start()
        return b
    yield start
    for b in made:
        b.stop()
    assert_no_process_left(tmp_path)


def test_every_rank_is_recorded_and_each_variable_verified_in_it(engine, tmp_path):
    b = engine(options={"env": {"USER_SET_VAR": "x|y"}})
    assert b.info.notes["ranks"].startswith("2 rank processes: TP0 pid"), b.info.notes
    assert b.info.notes["rank_environment"] == "2 variables checked in 3 processes", b.info.notes
    rec = json.loads((tmp_path / "ranks.json").read_text())
    assert [r["label"] for r in rec["ranks"]] == ["TP0", "TP1"]
    assert all(r["cmdline"].endswith(f"--title FAKE::Worker_TP{r['tp']}") for r in rec["ranks"])
    procs = rec["environment"]["processes"]
    assert {p["source"] for p in procs.values()} == {"the process's own report"}
    assert all(p["variables"] == {FLAG: "present", "USER_SET_VAR": "present"} for p in procs.values()), procs
    assert "x|y" not in json.dumps(rec)  # values are compared as hashes, never written
    assert b.client.watch.progress.unit == "CPU s of the slowest rank"  # the hang rule reads the ranks
    b.stop()
    after = json.loads((tmp_path / "ranks.json").read_text())
    assert all(r["samples"] >= 1 and r["cpu_s"] >= 0 and r["rss_max_bytes"] > 0 for r in after["ranks"]), after


def test_a_variable_missing_from_one_rank_is_named(tmp_path):
    b = launched(tmp_path, "--drop", FLAG)
    with pytest.raises(EngineFailure) as info:
        b.start()
    exc = info.value
    assert exc.failure_class == "config-rejected", exc
    assert re.match(rf"{FLAG} not in rank TP1's environment \(pid \d+; read from the process's own report\)$", exc.message), \
        exc.message
    table = json.loads(exc.evidence["ranks.json"])["environment"]["processes"]
    assert [k for k, v in table.items() if v["variables"][FLAG] == "missing"] == [
        next(k for k in table if k.startswith("rank TP1"))]
    assert_no_process_left(tmp_path)


def test_ranks_that_report_nothing_are_read_from_proc(engine, tmp_path):
    b = engine("--no-site")
    procs = json.loads((tmp_path / "ranks.json").read_text())["environment"]["processes"]
    ranks = {k: v for k, v in procs.items() if k.startswith("rank")}
    assert {v["source"] for v in ranks.values()} == {"/proc environ"}, procs
    assert all(v["variables"][FLAG] == "present" for v in ranks.values())
    assert "not verifiable" not in b.info.notes["rank_environment"]


def test_a_spinning_rank_while_the_api_answers_nothing_is_a_hang(engine):
    b = engine()
    ok, _ = _failure(b, "work")
    assert ok is None, ok
    exc, took = _failure(b, "spin")
    assert exc is not None and exc.failure_class == "hang", exc
    assert took < TIMEOUT_S * 2 + TICK_S + SLACK_S, took  # a window of the timeout, not the 30-timeout deadline
    m = re.search(r"per rank: rank TP0 ([\d.]+) cores, rank TP1 ([\d.]+) cores", exc.message)
    assert m and float(m.group(1)) < 0.1 and float(m.group(2)) > 0.3, exc.message
    assert "slowest rank" in exc.message, exc.message


@pytest.mark.parametrize("monitor", [True, False], ids=["server-exits", "server-keeps-port"])
def test_a_rank_killed_mid_request_is_the_crash_named(engine, monitor):
    b = engine(*(["--monitor"] if monitor else []))
    exc, took = _failure(b, "kill")
    assert exc is not None and exc.failure_class == "runtime-crash", exc
    assert re.match(r"rank TP1 \(pid \d+\) ended first", exc.message), exc.message
    ranks = json.loads(exc.evidence["ranks.json"])["ranks"]
    assert [r["label"] for r in ranks if r["ended_s"] is not None][:1] == ["TP1"], ranks
    if monitor:
        assert "died with code -9" in exc.message or "exited" in exc.message, exc.message
    assert took < TIMEOUT_S * 2 + TICK_S + SLACK_S + 1.0, took


def test_per_rank_kv_memory_is_counted_once_per_rank():
    from backends.vllm import option_log

    def line(rank, gib):
        return (f"({rank} pid={int(gib * 10)}) INFO 12-06 11:46:28 [cpu_worker.py:260] Explicitly set ({gib}/23.54) GiB for KV "
                "cache on node 0.")
    earlier = "\n".join([line("Worker_TP0", 2.0), line("Worker_TP1", 2.0)])
    log = "\n".join([earlier, "(APIServer pid=3) INFO restarted", line("Worker_TP0", 4.0), line("Worker_TP1", 4.0)])
    mem = option_log.kv_memory(log)
    assert mem["per_rank_gib"] == {"Worker_TP0": 4.0, "Worker_TP1": 4.0} and mem["all_ranks_gib"] == 8.0, mem
    assert mem["kv_cache_gib"] == 4.0  # one rank's, what kv_cache_space_gib (per worker) is verified against
    single = option_log.kv_memory(line("Worker", 4.0))
    assert single["all_ranks_gib"] == 4.0 and single["per_rank_gib"] == {"Worker": 4.0}


def test_the_slowest_rank_per_stage_is_the_progress():
    """Two stages of two TP ranks: stage 0 all busy counts; a stage with an idle rank adds nothing."""
    from bakeoff.host.ranks import RankWatch

    cpu = {1: 0.0, 2: 0.0, 3: 0.0, 4: 0.0}
    titles = {1: "W_PP0_TP0", 2: "W_PP0_TP1", 3: "W_PP1_TP0", 4: "W_PP1_TP1"}
    pat = re.compile(r"W_PP(?P<pp>\d)_TP(?P<tp>\d)")
    from backends._ranks import rank_of

    w = RankWatch(lambda: list(cpu), rank_of(pat))
    w.refresh = lambda: None  # no psutil: the ranks are set by hand
    from bakeoff.host.ranks import Rank

    w._ranks = {pid: Rank(pid, *rank_of(pat)(titles[pid]), titles[pid], 0.0) for pid in cpu}
    assert w.progress_cpu_s() == 0.0
    for pid, used in ((1, 1.0), (2, 0.9), (3, 1.0), (4, 0.0)):  # stage 1's TP1 idle: stage 1 stuck
        w._ranks[pid].cpu_s += used
    assert w.progress_cpu_s() == pytest.approx(0.9)
    w._ranks[2].cpu_s += 1.0  # only one rank of stage 0 works: nothing advances
    assert w.progress_cpu_s() == pytest.approx(0.9)
    w._ranks[2].ended_s = time.monotonic()
    assert w.progress_cpu_s() is None  # a rank gone: the engine cannot advance


def test_a_rank_lost_while_the_engine_starts_is_the_crash(tmp_path):
    """The FAKE server keeps serving after rank 1 died before it listened: the start finds 1 of the 2
    ranks asked for and fails as the crash it is, not later as a hang of every request."""
    b = launched(tmp_path, "--lose")
    b.ranks_asked = 2
    with pytest.raises(EngineFailure) as info:
        b.start()
    exc = info.value
    assert exc.failure_class == "runtime-crash", exc
    assert exc.message.startswith("1 of the 2 ranks asked for are running at start (TP0)"), exc.message
    assert [r["label"] for r in json.loads(exc.evidence["ranks.json"])["ranks"]] == ["TP0"]
    assert_no_process_left(tmp_path)


@pytest.mark.parametrize("items, words", [
    (['env={"A=B":"1"}'], "env name 'A=B' is not a variable name"),
    (['env={"":"1"}'], "env name '' is not a variable name"),
    (["env.PYTHONPATH=/x"], "env PYTHONPATH is bakeoff's to set"),
    (["env.BAKEOFF_RANK_ENV_KEYS=X"], "env BAKEOFF_RANK_ENV_KEYS is bakeoff's to set"),
    (['env={"A":"a\\u0000b"}'], "env A holds a NUL byte"),
    (["env.X=" + "a" * 140_000], "env X is longer than one variable may be"),
])
def test_an_env_the_engine_cannot_be_given_is_the_users_error(items, words):
    """Refused before anything starts (exit 2, one line), never a start failure blamed on the engine."""
    from backends.vllm.backend import VllmOptions
    from bakeoff.api.errors import UserError
    from bakeoff.api.options import parse_kv, parse_options

    with pytest.raises(UserError) as info:
        parse_options("vllm", VllmOptions, parse_kv(items))
    assert words in str(info.value) and "\n" not in str(info.value), info.value


def test_env_varied_by_the_matrix_joins_the_users_env():
    from bakeoff.api.errors import UserError
    from evaluations.inputs import Request, check_options

    req = Request(entry="qualify", backends=["vllm"], backend_opt=["env.Y=1"], matrix=["env.X=a,b"])
    runs = check_options(req, ["vllm"])[0]
    assert [r.options["env"] for r in runs] == [{"Y": "1", "X": "a"}, {"Y": "1", "X": "b"}]
    with pytest.raises(UserError, match="env.X is also varied by --matrix"):
        check_options(Request(entry="qualify", backends=["vllm"], backend_opt=["env.X=1"], matrix=["env.X=a,b"]),
                      ["vllm"])


def test_a_damaged_or_hostile_report_is_read_from_proc_instead(tmp_path):
    """A report nested past the JSON decoder's recursion, a FIFO in its place (a read would block), another
    process's pid: none is trusted or waited on; the process's /proc environ is read instead."""
    from bakeoff.host.ranks import environ_of, sha

    pid, report = os.getpid(), tmp_path / f"{os.getpid()}.json"
    for make in (lambda: report.write_text("[" * 100_000), lambda: os.mkfifo(report),
                 lambda: report.write_text(json.dumps({"pid": pid + 1, "vars": {"HOME": "x"}}))):
        if report.exists():
            report.unlink()
        make()
        t0 = time.monotonic()
        seen, source = environ_of(pid, ["HOME"], tmp_path)
        assert source == "/proc environ" and seen == {"HOME": sha(os.environ["HOME"])} and time.monotonic() - t0 < 2


def test_env_given_whole_as_text_says_the_item_form():
    from backends.vllm.backend import VllmOptions
    from bakeoff.api.errors import UserError
    from bakeoff.api.options import parse_kv, parse_options

    with pytest.raises(UserError, match=r"^--backend-opt env takes one variable per item: env.NAME=VALUE"):
        parse_options("vllm", VllmOptions, parse_kv(["env=FOO=1"]))
