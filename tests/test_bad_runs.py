"""Bad run directories given to ``compare``, ``report`` and ``--resume`` (both ``bakeoff qualify``
and ``pytest evaluations/``), and bad plugin options: one line naming the fix, nothing written.
Split from tests/test_bad_input.py (helpers and the ``bad_runs`` fixture live there)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.test_bad_input import BAKEOFF, PYTEST, _verdict_run, bad_runs, nothing_written, one_error_line, run  # noqa: F401 - bad_runs is a fixture


@pytest.mark.parametrize("which, message", [
    ("missing", "cannot read run directory"),
    ("corrupt", "pass folders that hold a verdict.json"),
    ("empty", "no verdict.json in it or below it"),
])
def test_compare_unreadable_runs(tmp_path, bad_runs, which, message):
    art = tmp_path / "art"
    proc = run(BAKEOFF + ["compare", str(bad_runs[which]), "--artifacts", str(art)])
    assert proc.returncode == 2, proc.stderr
    assert message in one_error_line(proc)
    assert nothing_written(art)


@pytest.mark.parametrize("extra, message", [
    (["--backends", "vllm"], "--resume continues a run with its own settings; drop --backends"),
    (["--model", "fixture:tiny-qwen3"], "drop --model"),
    (["--backends", "vllm", "--backend-opt", "dtype=float32"], "drop --backends, --backend-opt"),
    (["--matrix", "prefix_cache=on,off"], "drop --matrix"),
])
def test_resume_conflicts_with_run_settings(bad_runs, extra, message):
    proc = run(BAKEOFF + ["qualify", "--resume", str(bad_runs["corrupt"]), *extra])
    assert proc.returncode == 2 and message in one_error_line(proc)
    assert sorted(p.name for p in bad_runs["corrupt"].iterdir()) == ["run.json", "verdict.json"]


@pytest.mark.parametrize("which, message", [
    ("missing", "not a readable run directory (FileNotFoundError"),
    ("corrupt", "not a readable run directory (JSONDecodeError"),
    ("empty", "not a readable run directory"),
    ("finished", "finished (qualified); nothing to resume"),
    ("foreign", "run.json or verdict.json is not bakeoff's"),
])
def test_resume_unusable_run(bad_runs, which, message):
    before = sorted(bad_runs["finished"].parent.rglob("*"))
    proc = run(BAKEOFF + ["qualify", "--resume", str(bad_runs[which])])
    assert proc.returncode == 2
    assert message in one_error_line(proc)
    assert sorted(bad_runs["finished"].parent.rglob("*")) == before


@pytest.mark.parametrize("args, message", [
    (["--backend", "transformers", "--backend-opt", "batching=sometimes"], "bad value for option 'batching'"),
    (["--backend", "transformers", "--memory-limit-gib", "0"], "--memory-limit-gib must be a positive number of GiB"),
    (["--backend", "transformers", "--profile", "huge"], "unknown profile 'huge'"),
    (["--backend", "transformers", "--min-probe-accuracy", "2"], "--min-probe-accuracy must be between 0 and 1"),
    (["--backend", "transformers", "--repeats", "0"], "--repeats must be at least 1"),
    (["--backend", "transformers", "--start-timeout", "-5"], "--start-timeout must be a positive number"),
    (["--backend", "transformers", "--progress-timeout", "0"], "--progress-timeout must be a positive number"),
    (["--backend", "transformers", "--request-deadline-factor", "0.5"],
     "--request-deadline-factor must be a number of progress timeouts from 1 to 1000"),
    (["--backend", "transformers", "--prefill-budget", "0"], "--prefill-budget must be a positive number of seconds"),
    (["--backend", "transformers", "--check-prefill-budget", "-1"], "--check-prefill-budget must be a positive number"),
])
def test_pytest_plugin_bad_options(tmp_path, args, message):
    art = tmp_path / "art"
    proc = run(PYTEST + ["--artifacts", str(art), "--model", "fixture:tiny-qwen3-untrained", *args])
    assert proc.returncode == 4, proc.stdout[-2000:] + proc.stderr
    assert message in one_error_line(proc, "ERROR: ")
    assert nothing_written(art)


def test_pytest_resume_unreadable_run(bad_runs):
    proc = run(PYTEST + ["--resume", str(bad_runs["corrupt"])])
    assert proc.returncode == 4
    assert "cannot resume" in one_error_line(proc, "ERROR: ")


@pytest.mark.parametrize("verdict_text, message", [
    ("[]", "verdict.json holds a list, not an object"),
    ("null", "verdict.json holds a NoneType"),
    ('{"backend": "b", "model": "m", "checks": "abc"}', "checks that are not a list"),
    ('{"backend": "b", "model": "m", "checks": [{"foo": 1}]}', "a check without a name and a status"),
    ('{"backend": "b", "model": "m", "checks": [], "options": "abc"}', "options that is not an object"),
    ("{}", "has no backend"),
])
@pytest.mark.parametrize("command", ["compare", "report"])
def test_runs_that_are_not_bakeoffs_are_refused(tmp_path, verdict_text, message, command):
    run_dir = _verdict_run(tmp_path / "in", "r1", verdict_text)
    art = tmp_path / "art"
    proc = run(BAKEOFF + [command, str(run_dir), "--artifacts", str(art)])
    assert proc.returncode == 2 and message in one_error_line(proc), proc.stderr
    binary = _verdict_run(tmp_path / "in", "r2", "")
    (binary / "verdict.json").write_bytes(b"\xff\xfe\x00garbage")
    proc = run(BAKEOFF + [command, str(binary), "--artifacts", str(art)])
    assert proc.returncode == 2 and "cannot read run directory" in one_error_line(proc)


def _damaged(tmp_path: Path, name: str, model: str, checks: list) -> Path:
    import json

    d = tmp_path / "runs" / name
    d.mkdir(parents=True)
    meta = {"run_id": name, "backend": "transformers", "model": "fixture:tiny-qwen3", "options": {}, "profile": "quick"}
    (d / "run.json").write_text(json.dumps(meta))
    (d / "verdict.json").write_text(json.dumps({**meta, "model": "MODEL", "status": "qualified", "checks": checks,
                                                "finished_at": "2026-12-04T00:00:00Z"}).replace('"MODEL"', model))
    return d


def test_damaged_numbers_and_text_in_a_finished_run_are_shown_not_raised(tmp_path):
    """A census of 2026-12-04 found tracebacks from finished runs a user might hand over damaged:
    an integer too large for a float (``OverflowError`` in the report's percentages), a lone
    surrogate in the model name (``UnicodeEncodeError`` writing report.md), negative session counts
    and throughputs (matplotlib refused a log axis of no positive values). Each is shown, written
    escaped or left out of the plot; the command succeeds."""
    from cli.main import main

    big = _damaged(tmp_path, "big", '"fixture:tiny-qwen3"', [
        {"name": "sanity.known_answers", "status": "pass", "values": {"accuracy": 10 ** 4000}}])
    sur = _damaged(tmp_path, "sur", '"\\ud800x"', [])
    neg = _damaged(tmp_path, "neg", '"fixture:tiny-qwen3"', [
        {"name": "throughput.sweep", "status": "pass",
         "values": {"points": [{"sessions": -2, "output_tokens_per_s": -5.0, "ok": 2, "requests": 2}]}}])
    for i, argv in enumerate((["report", str(big)], ["report", str(sur)], ["compare", str(neg), str(big)],
                              ["compare", str(sur), str(big)])):
        art = tmp_path / f"art{i}"
        assert main(argv + ["--artifacts", str(art)]) == 0, argv
        assert list(art.rglob("report.md")), argv
    text = next((tmp_path / "art1").rglob("report.md")).read_text()
    assert "\\ud800x" in text


def test_an_endpoint_with_credentials_is_never_printed(monkeypatch, capsys):
    """``--endpoint https://user:TOKEN@host`` that does not answer: the line names the endpoint
    with its user part masked (the census saw the token printed back)."""
    from cli.main import main

    monkeypatch.setenv("HF_TOKEN", "hf_census_placeholder")
    rc = main(["jobs", "status", "j1", "--endpoint", "https://u:hf_SECRETcensus123@127.0.0.1:9"])
    err = capsys.readouterr().err
    assert rc == 2 and "hf_SECRETcensus123" not in err and "https://***@127.0.0.1:9 did not answer" in err, err
    monkeypatch.setenv("HF_TOKEN", "hf_SECRETcensus123")  # a secret of the environment typed into a path
    assert main(["qualify", "--backends", "transformers", "--model", "/nonexistent/hf_SECRETcensus123"]) == 2
    err = capsys.readouterr().err
    assert "hf_SECRETcensus123" not in err and "does not exist" in err, err
