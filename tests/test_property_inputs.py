"""Property tests (Hypothesis) of what bakeoff reads from a user: any argv of any subcommand, and any
``verdict.json`` / ``run.json`` (random JSON, a real verdict with random parts, random bytes).

Every case ends in exit 0, 1, 2 or 130 with no traceback and within a per-case time limit
(SIGALRM): never an exception out of ``main``, never a hang. ``bakeoff`` runs in-process; where
a case would start real work (a qualification, a fixture build, a calibration, a submission)
the work is stood in for by :class:`Reached`, which counts as an accepted input. The whole file
takes well under a minute on a 2-core host (modest ``max_examples``).
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import os
import shutil
import signal
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cli.main as cli
from bakeoff.api.errors import UserError
from evaluations import inputs

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "cpu" / "20261201T230336Z_transformers_tiny-qwen3_26dc9c"
CASE_S = 20  # per case; a refusal takes milliseconds, the first import of a backend's module about a second
ALLOWED = {0, 1, 2, 130}


class Reached(Exception):
    """Real work would start here: the input was accepted."""


class Hang(Exception):
    pass


def _reached(*_a, **_k):
    raise Reached


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory):
    """A folder with the runs and models the argv vocabulary names, a cache and artifacts folder;
    bakeoff's real work stood in for; the current folder moved there (relative paths land in it)."""
    root = tmp_path_factory.mktemp("prop")
    (root / "cache").mkdir()
    good = root / "runs" / "good"
    shutil.copytree(EXAMPLE, good)
    cut = root / "runs" / "cut"
    cut.mkdir(parents=True)
    (cut / "run.json").write_text(json.dumps({"run_id": "cut", "backend": "transformers", "model": "fixture:tiny-qwen3",
                                              "options": {}, "profile": "quick"}))
    (cut / "verdict.json").write_text(json.dumps({"run_id": "cut", "backend": "transformers", "model": "fixture:tiny-qwen3",
                                                  "checks": []}))
    fifo = root / "runs" / "fifo"
    fifo.mkdir()
    os.mkfifo(fifo / "verdict.json")
    (root / "model").mkdir()
    (root / "model" / "config.json").write_text('{"model_type": "qwen3"}')
    mp = pytest.MonkeyPatch()
    mp.chdir(root)
    mp.setenv("BAKEOFF_CACHE", str(root / "cache"))
    mp.setenv("HF_HOME", str(root / "hf"))
    mp.delenv("HF_TOKEN", raising=False)
    mp.setattr(cli, "DEFAULT_ARTIFACTS", str(root / "art"))
    mp.setitem(inputs.DEFAULTS, "artifacts", str(root / "art"))
    mp.setattr("cli.jobs.args.DEFAULT_ARTIFACTS", str(root / "art"))
    for target in ("cli.qualify._qualify", "cli.qualify.subprocess.run", "bakeoff.models.fixtures.build",
                   "bakeoff.loadgen.calibrate.calibrate_sweep", "adapters.awq_int4.quantize_awq",
                   "cli.jobs.submit.api_for", "bakeoff.reporting.compare_html.write_plots"):
        mp.setattr(target, _reached)
    yield root
    mp.undo()


def run_main(argv: list[str]) -> tuple[int, str]:
    """``main(argv)`` under a time limit: (exit code, stderr); Reached counts as 0."""
    err = io.StringIO()

    def alarm(*_):
        raise Hang(f"no answer within {CASE_S} s: {argv!r}")

    old = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, CASE_S)
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                code = cli.main(argv)
            except Reached:
                code = 0
            except SystemExit as exc:  # --help
                code = exc.code or 0
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    return code, err.getvalue()


def check(argv: list[str]) -> None:
    code, err = run_main(argv)
    assert code in ALLOWED, (argv, code, err)
    assert "Traceback (most recent call last)" not in err, (argv, err)  # the words alone may be an echoed argument
    if code == 2:
        assert len([ln for ln in err.splitlines() if ln.strip()]) == 1, (argv, err)


COMMANDS = {
    "qualify": ["--backends", "--model", "--backend-opt", "--profile", "--artifacts", "--report", "--reference-model",
                "--reference-opt", "--no-preflight", "--patch", "--matrix", "--repeats", "--quiet", "--fail-on", "--resume"],
    "compare": ["--baseline", "--artifacts", "--name"],
    "report": ["--artifacts", "--name"],
    "calibrate": ["--concurrency", "--ttft-ms", "--itl-ms", "--output-tokens", "--requests-per-session", "--processes",
                  "--server-workers", "--ttft-budget-ms", "--out"],
    "quantize awq": ["--model", "--out", "--dataset", "--num-samples", "--mtp-as-released"],
    "fixture build": ["--force"],
    "jobs export ort-genai": ["--model", "--push-to", "--path-in-repo", "--timeout", "--secret", "--env", "--label",
                              "--image", "--python", "--bakeoff-spec", "--torch-index", "--dry-run", "--save-script",
                              "--precision", "--block-size", "--extra-option", "--flavor"],
    "jobs qualify": ["--backends", "--model", "--flavors", "--profile", "--backend-opt", "--reference-model", "--dry-run",
                     "--push-to", "--env", "--label", "--python"],
    "jobs wait": ["--timeout-s", "--poll-s"],
    "envs": [],
}
VALUES = ["", " ", ",", "1,,2", "0", "-1", "1", "8", "1e9", "nan", "inf", "-inf", "1000000000", "x", "vllm", "transformers",
          "vllm,ort-genai", "nope", "quick", "full", "fixture:tiny-qwen3", "fixture:nope", "org/m", "org/..", "a..b/..",
          "max_model_len=2048", "vllm:max_model_len=1", "gpu_headroom_gib=Infinity", "kv_cache_dtype=auto,fp8",
          "speculative=ngram", "k=v", "=", "a=b=c", 'x={"a":', "../x", "a\nb", "\t", "$(id)", '"""', "\\", "{}", "[]",
          "runs/good", "runs/cut", "runs/fifo", "runs", "model", "out", "art", "file:///x", "none", "3.12", "cpu-xl",
          "HF_TOKEN", "-", "--", "-h"]
# free text: no absolute path, no way out of the sandbox (a random --save-script is written where it says)
FREE = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00/~"), max_size=12).filter(
    lambda t: ".." not in t)


@st.composite
def argvs(draw):
    cmd = draw(st.sampled_from(sorted(COMMANDS)))
    flags = COMMANDS[cmd]
    words = draw(st.lists(st.one_of(st.sampled_from(flags or ["--x"]), st.sampled_from(VALUES), FREE), max_size=8))
    return cmd.split() + words


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(argv=argvs())
def test_any_argv_ends_in_a_known_exit_code(sandbox, argv):
    check(argv)


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                    max_leaves=20)
GOOD_VERDICT = json.loads((EXAMPLE / "verdict.json").read_text())
GOOD_RUN = json.loads((EXAMPLE / "run.json").read_text())


def _paths(value, prefix=()):
    """Every path into a JSON value (to replace one part of a real verdict)."""
    yield prefix
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value[:3]):
            yield from _paths(v, (*prefix, i))


PATHS = [p for p in _paths(GOOD_VERDICT) if p]


def _replace(doc, path, value):
    doc = copy.deepcopy(doc)
    cur = doc
    for k in path[:-1]:
        cur = cur[k]
    cur[path[-1]] = value
    return doc


def _write(folder: Path, name: str, content) -> None:
    data = content if isinstance(content, bytes) else json.dumps(content, allow_nan=True).encode()
    (folder / name).write_bytes(data)


def _all_readers(sandbox: Path, run: Path) -> None:
    """compare, report, qualify --resume and the plugin's resume check on one run directory."""
    from evaluations.inputs import Request, resume_request

    check(["compare", str(run), "--artifacts", str(sandbox / "art-p")])
    check(["report", str(run), "--artifacts", str(sandbox / "art-p")])
    check(["qualify", "--resume", str(run)])
    try:  # what `pytest evaluations/ --resume` runs at configure: a UserError, or the run's request
        resume_request(Request(entry="pytest", resume=str(run)))
    except UserError:
        pass


@pytest.fixture(scope="module")
def run_dir(sandbox):
    d = sandbox / "runs" / "random"
    d.mkdir()
    return d


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(verdict=st.one_of(JSON, st.binary(max_size=64)), meta=st.one_of(JSON, st.just(GOOD_RUN)))
def test_any_verdict_or_run_json(sandbox, run_dir, verdict, meta):
    _write(run_dir, "verdict.json", verdict)
    _write(run_dir, "run.json", meta)
    _all_readers(sandbox, run_dir)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(path=st.sampled_from(PATHS), value=JSON, unfinished=st.booleans())
def test_a_real_verdict_with_one_part_replaced(sandbox, run_dir, path, value, unfinished):
    doc = _replace(GOOD_VERDICT, path, value)
    if unfinished:
        doc["finished_at"] = None
    _write(run_dir, "verdict.json", doc)
    _write(run_dir, "run.json", GOOD_RUN)
    _all_readers(sandbox, run_dir)
