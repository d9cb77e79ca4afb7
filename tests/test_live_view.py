"""``bakeoff qualify``'s view of the phases before the checks and of the sweep (issue 21):
engine environments (bakeoff/host/envs.py steps, pip's last line), the fixture's training line,
sweep points as they complete; plain lines for CI, nothing with ``--quiet``, one live display on a
terminal (a real pseudo-terminal here). Stand-ins only: a fake pip (``envs._run``), trainer lines,
a small script for the evaluation. No engine, no real install, seconds."""

from __future__ import annotations

import fcntl
import os
import re
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from cli import main as cli_main
from cli import steps
from cli.phases import STEP_LINE, PhaseBoard, last_line
from cli.progress import POINTS_LOG, Progress, read_point
from bakeoff.host import envs

REPO = Path(__file__).resolve().parent.parent
ANSI = re.compile(r"\x1b\[[0-9;?]*[a-zA-Z]")

# stands in for `python -m venv` and pip: the lines pip prints, a pause after each
FAKE_PIP = r'''
def fake_run(cmd, log_path, timeout_s, pause=PAUSE, env=None, background=False):
    import time
    from pathlib import Path
    with open(log_path, "a") as fh:
        fh.write("\n$ " + " ".join(cmd) + "\n")
        if "venv" in cmd:
            Path(cmd[-1]).mkdir(parents=True)
        for line in ("Collecting alpha==1.0", "Downloading alpha-1.0.tar.gz (12 kB)",
                     "Successfully installed alpha-1.0") if "install" in cmd else ():
            fh.write(line + "\n")
            fh.flush()
            time.sleep(pause)
    CALLS.append(cmd)
'''
# stands in for the evaluation: the run file, two sweep points (bakeoff's own append), a verdict
STAND_IN = r'''
import json, os, sys, time
from pathlib import Path
from evaluations.test_throughput import append_point
run = Path(sys.argv[1]); run.mkdir()
Path(os.environ["BAKEOFF_RUN_FILE"]).write_text(str(run))
def verdict(checks):
    (run / "verdict.json.tmp").write_text(json.dumps({"checks": checks}))
    os.replace(run / "verdict.json.tmp", run / "verdict.json")
verdict([{"name": "load", "status": "pass"}])
for n, tps in ((1, 410.0), (2, 800.0), (4, 1490.4)):
    time.sleep(float(sys.argv[2]))
    append_point(run, {"sessions": n, "output_tokens_per_s": tps, "ttft_p50_ms": 35.2, "errors": 0, "ok": n})
time.sleep(float(sys.argv[2]))
verdict([{"name": "load", "status": "pass"}, {"name": "throughput.sweep", "status": "pass"}])
time.sleep(float(sys.argv[2]))
print("bakeoff verdict: qualified", flush=True)
'''
TRAINER = ["fixture tiny-test: building into /cache/tiny-test",
           "  tokenizer: 1024 tokens (1.0 s)",
           "  step 200/1700  loss 2.3100  3.1 steps/s  ETA 8 min 04 s",
           "  step 400/1700  loss 1.2000  3.2 steps/s  ETA 6 min 46 s",
           "  step 1700/1700  loss 0.0500  3.2 steps/s  ETA 0 s",
           "  probes: 100.0% (count 100%), 1.2 s",
           "fixture tiny-test: done in 540 s"]


def fake_pip(pause: float, calls: list):
    ns = {"PAUSE": pause, "CALLS": calls}
    exec(FAKE_PIP, ns)
    return ns["fake_run"]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("BAKEOFF_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("BAKEOFF_ENVS", raising=False)
    return tmp_path / "cache"


def test_ensure_reports_each_step_and_pip_writes_its_lines_to_the_log(cache, monkeypatch):
    calls: list = []
    monkeypatch.setattr(envs, "_run", fake_pip(0, calls))
    seen: list[tuple[str, str]] = []
    spec = envs.EnvSpec("fake-engine", ("alpha==1.0",), uninstall=("beta",))
    python = envs.ensure(spec, progress=lambda step, log: seen.append((step, last_line(log))))
    assert python == spec.python and spec.is_ready()
    assert [s for s, _ in seen] == ["creating venv", "pip install", "pip uninstall"]
    install = next(c for c in calls if "install" in c)
    assert "-q" not in install and install[install.index("--progress-bar") + 1] == "off"
    assert seen[2][1] == "Successfully installed alpha-1.0"  # the last line pip wrote, read back
    log = spec.path.parent / f"{spec.path.name}.install.log"
    assert log.is_file() and last_line(log) == ""  # after a `$ command` line: nothing of its own yet


def test_install_commands_run_unbuffered_so_the_log_has_a_last_line(tmp_path, monkeypatch):
    monkeypatch.delenv("PYTHONUNBUFFERED", raising=False)
    log = tmp_path / "install.log"
    envs._run([sys.executable, "-c", "import os; print('unbuffered', os.environ.get('PYTHONUNBUFFERED'))"], log, 60)
    assert last_line(log) == "unbuffered 1"  # pip's lines reach the log as printed, not at exit


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_plain_lines_are_plain_and_an_item_speaks_at_most_once_per_interval(tmp_path):
    clock, lines = Clock(), []
    board = PhaseBoard("plain", out=lines.append, interval_s=10, clock=clock)
    log = tmp_path / "x.install.log"
    log.write_text("\n$ pip install alpha\nCollecting alpha==1.0\n")
    board.env_log("fake", "creating the fake environment at /cache/envs/fake (first use; reused later)")
    board.env_step("fake", "creating venv", log)
    board.env_step("fake", "pip install", log)  # within the interval: not printed yet
    assert lines == ["[envs] creating the fake environment at /cache/envs/fake (first use; reused later)"]
    clock.t += 3
    with open(log, "a") as fh:
        fh.write("Downloading alpha-1.0.tar.gz (12 kB)\n")
    board.tick()
    assert len(lines) == 1
    clock.t += 8  # 11 s after the last line
    board.tick()
    board.tick()
    assert lines[1:] == ["[envs] fake: pip install, 11 s: Downloading alpha-1.0.tar.gz (12 kB)"]
    clock.t += 20
    board.tick()  # nothing changed: no line until a minute passed
    assert len(lines) == 2
    clock.t += 45
    board.tick()
    assert lines[-1] == "[envs] fake: pip install, 1 min 16 s: Downloading alpha-1.0.tar.gz (12 kB)"
    for i, line in enumerate(TRAINER):
        clock.t += 1 if i < 3 else 2
        board.fixture_log(line)
    fixture = [x for x in lines if x.startswith("[fixture]")]
    assert "[fixture]   step 200/1700  loss 2.3100  3.1 steps/s  ETA 8 min 04 s" in fixture
    assert not any("step 400/1700" in x for x in fixture)  # 2 s after the one before: left out
    assert any("step 1700/1700" in x for x in fixture) and fixture[-1] == "[fixture] fixture tiny-test: done in 540 s"
    text = "\n".join(lines)
    assert "\x1b" not in text and "\r" not in text
    rows = {r[0]: r for r in board.rows()}
    assert rows["env fake"][1] == "pip install" and rows["fixture tiny-test"][1] == "ready"


def test_fixture_row_shows_steps_loss_rate_and_a_counting_down_eta():
    clock = Clock()
    board = PhaseBoard("live", out=lambda s: pytest.fail(f"live mode printed {s!r}"), clock=clock)
    for line in TRAINER[:4]:
        board.fixture_log(line)
    clock.t += 60
    item, step, _, detail, ok = board.rows()[0]
    assert (item, step) == ("fixture tiny-test", "training")
    assert detail == "step 400/1700  loss 1.2000  3.2 steps/s  ETA 5 min 46 s"


def test_the_trainer_line_carries_an_eta_the_board_reads():
    torch = pytest.importorskip("torch")
    from bakeoff.models.fixtures import recipes
    from bakeoff.models.fixtures.train import train

    class Tok:
        def encode(self, text):
            return SimpleNamespace(ids=[3 + b % 60 for b in text.encode()][:20])

        def token_to_id(self, token):
            return {"<|endoftext|>": 0}.get(token, 1)

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.out = torch.nn.Embedding(64, 8), torch.nn.Linear(8, 64)

        def forward(self, input_ids, labels, **kw):
            logits = self.out(self.emb(input_ids))
            return SimpleNamespace(loss=torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(),
                                                                          ignore_index=-100))

    recipe = {"corpus": recipes.CORPUS, "train": {**recipes.TRAIN, "steps": 4, "log_every": 2, "batch": 2,
                                                    "seq_len": 32, "long_kv": None}}
    lines: list[str] = []
    train(Tiny(), Tok(), recipe, lines.append)
    assert len(lines) == 2 and all(STEP_LINE.search(x) and " ETA " in x for x in lines), lines
    assert lines[-1].startswith("  step 4/4  loss ") and lines[-1].endswith("ETA 0 s")
    board = PhaseBoard("live", out=print)
    board.fixture_log(lines[0])
    assert board.rows()[0][3].startswith("step 2/4  loss ")


def test_sweep_points_as_plain_lines_and_in_the_table(tmp_path, capfd):
    run_file = tmp_path / "x.run"
    run_file.write_text("")
    env = dict(os.environ, BAKEOFF_RUN_FILE=str(run_file), PYTHONPATH=str(REPO))
    with Progress("plain", poll_s=0.05, interval_s=60) as p:
        code, run_dir = p.run("transformers", [sys.executable, "-c", STAND_IN, str(tmp_path / "run"), "0.5"],
                              env, str(tmp_path), str(run_file))
    out = capfd.readouterr().out
    assert code == 0 and run_dir == tmp_path / "run"
    sweep = [x for x in out.splitlines() if x.startswith("[sweep]")]
    # the first point at once; the next within the interval, left out; the last once the sweep
    # check is recorded, before the run's verdict line (a new user's logs had it after)
    assert sweep == ["[sweep] transformers: sweep 1 session: 410 tok/s, TTFT p50 35 ms",
                     "[sweep] transformers: sweep 4 sessions: 1,490 tok/s, TTFT p50 35 ms"]
    lines = out.splitlines()
    assert lines.index(sweep[-1]) < lines.index("bakeoff verdict: qualified")
    assert "\x1b" not in out and "\r" not in out
    assert read_point(run_dir) == {"sessions": 4, "output_tokens_per_s": 1490.4, "ttft_p50_ms": 35.2,
                                   "valid": True, "errors": 0}
    assert len((run_dir / POINTS_LOG).read_text().splitlines()) == 3


def _fake_prepare():
    def prepare(model, specs, board, clock):
        prewarm = steps.EnvPrewarm([envs.EnvSpec("fake-engine", ("alpha==1.0",))], board=board)
        prewarm.wait()
        for line in TRAINER:
            board.fixture_log(line)
        return SimpleNamespace(local=False, path=model), prewarm
    return prepare


@pytest.mark.parametrize("quiet", [False, True])
def test_qualify_prints_phase_lines_in_plain_mode_and_none_when_quiet(cache, tmp_path, monkeypatch, capsys, quiet):
    calls: list = []
    monkeypatch.setattr(envs, "_run", fake_pip(0.05, calls))
    monkeypatch.setattr(steps, "prepare", _fake_prepare())
    monkeypatch.setattr("cli.qualify._one_run", lambda *a: None)  # no evaluation: "no run was written"
    code = cli_main.main(["qualify", "--backends", "transformers", "--artifacts", str(tmp_path / "art")]
                         + (["--quiet"] if quiet else []))
    out, err = capsys.readouterr()
    assert code != 0 and "no run was written" in err and calls  # the environment was made either way
    if quiet:
        assert out == ""
    else:
        assert "[envs] creating the fake-engine environment" in out and "[fixture]   step 200/1700" in out
        assert "[envs] fake-engine environment ready in" in out and "qualifying transformers" in out
        assert "\x1b" not in out and "\r" not in out


PTY_PROGRAM = r'''
import os, sys
from bakeoff.host import envs
from cli.progress import Progress, choose_mode
from cli.steps import EnvPrewarm
CALLS = []
exec(FAKE_PIP_SRC, globals())
envs._run = fake_run
stand_in, run_dir, tmp = sys.argv[1:4]
run_file = os.path.join(tmp, "x.run")
open(run_file, "w").close()
with Progress(choose_mode(False), poll_s=0.1) as p:
    pre = EnvPrewarm([envs.EnvSpec("fake-engine", ("alpha==1.0",))], board=p.phases)
    for line in TRAINER:
        p.phases.fixture_log(line)
        if "step" in line:
            import time; time.sleep(0.4)
    pre.wait()
    p.run("transformers", [sys.executable, "-c", stand_in, run_dir, "1.0"],
          dict(os.environ, BAKEOFF_RUN_FILE=run_file), tmp, run_file)
'''


def run_in_pty(cmd: list[str], env: dict, timeout_s: float = 120) -> str:
    """Run ``cmd`` with a 120 x 40 pseudo-terminal as its stdin, stdout and stderr; its output."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    proc = subprocess.Popen(cmd, stdin=slave, stdout=slave, stderr=slave, env=env, cwd=REPO, close_fds=True)
    os.close(slave)
    chunks, deadline = [], time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            if select.select([master], [], [], 0.5)[0]:
                try:
                    data = os.read(master, 65536)
                except OSError:  # EIO: the child closed the terminal
                    break
                if not data:
                    break
                chunks.append(data)
            elif proc.poll() is not None:
                break
    finally:
        os.close(master)
        proc.kill() if proc.poll() is None else None
        proc.wait()
    return b"".join(chunks).decode(errors="replace")


def test_live_view_on_a_terminal_shows_environment_rows_then_the_checks(cache, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("NO_COLOR", "FORCE_COLOR", "COLUMNS", "LINES", "TERM")}
    env.update(TERM="xterm-256color", PYTHONPATH=str(REPO), BAKEOFF_CACHE=str(cache))
    program = (f"FAKE_PIP_SRC = {FAKE_PIP.replace('PAUSE', '0.8')!r}\nTRAINER = {TRAINER!r}\n" + PTY_PROGRAM)
    raw = run_in_pty([sys.executable, "-c", program, STAND_IN, str(tmp_path / "run"), str(tmp_path)], env)
    text = ANSI.sub("", raw)
    assert ANSI.search(raw), raw[-2000:]  # drawn in place, not printed line by line
    assert "Traceback" not in text, text[-3000:]
    assert re.search(r"env fake-engine\s+│\s*pip install\s+│\s*\d+ s\s+│\s*(Collecting|Downloading) alpha", text), text[-3000:]
    assert re.search(r"env fake-engine\s+│\s*ready\s+│", text)  # the row stays, finished
    assert re.search(r"fixture tiny-test\s+│\s*training\s+│.*step 400/1700\s+loss 1.2000\s+3.2 steps/s\s+ETA", text)
    assert "bakeoff qualify" in text and "sweep 4 sessions: 1,490 tok/s" in text  # the sweep's point, live
    last = text[text.rindex("environments and fixture"):]  # the final frame: both tables, the verdicts in
    assert "bakeoff qualify" in last and re.search(r"throughput\.sweep\s+│\s*pass", last), last


@pytest.mark.parametrize("last_line, shown", [
    (b'{"sessions": 4, "output_tokens_per_s": 1490.2, "ttft_p50_ms": 35}\n', "sweep 4 sessions: 1,490 tok/s, TTFT p50 35 ms"),
    (b"5\n", None), (b"[1, 2]\n", None), (b'"x"\n', None), (b"NaN\n", None), (b"\xff\xfe garbage\n", None),
    (b'{"sessions": 2, "output_tokens_per_s": "fast", "ttft_p50_ms": NaN}\n', "sweep 2 sessions: – tok/s"),
    (b'{"sessions": 2, "output_tokens_per_s": 10}', None),  # cut mid-line: not a whole point yet
])
def test_a_damaged_points_file_never_breaks_the_view(tmp_path, last_line, shown):
    """points.jsonl is read while it is written, and may be damaged: the view shows a whole point
    or nothing, and never raises (it watches a child that must not be left running alone)."""
    from cli.progress import point_text

    f = tmp_path / POINTS_LOG
    f.parent.mkdir(parents=True)
    f.write_bytes(last_line)
    point = read_point(tmp_path)
    if shown is None:
        assert point is None or point_text(point)  # a dict with odd fields still renders
    else:
        assert point is not None and point_text(point) == shown
