"""benchmarks/bench_request_floor.py: its figures are made of measured requests (not a test of speed)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_request_floor import main  # noqa: E402


def test_the_raw_round_trip_is_measured_request_by_request(tmp_path, capsys):
    out = main(["--backends", "", "--requests", "25", "--warmup", "3", "--out", str(tmp_path / "floor.json")])
    raw = out["rows"]["raw"]
    assert raw["n"] == 25 and 0 < raw["p50_ms"] < 1000
    assert raw["mean_low_ms"] <= raw["mean_ms"] <= raw["mean_high_ms"]
    assert raw["cpu_ms_per_request"]["client"] > 0
    assert (tmp_path / "floor.json").is_file() and "raw" in capsys.readouterr().out


def test_a_backend_row_has_every_process_cpu():
    out = main(["--backends", "transformers", "--requests", "5", "--warmup", "2", "--max-tokens", "2"])
    row = out["rows"]["transformers"]
    assert row["n"] == 5 and row["p50_ms"] > 0 and row["cpu_ms_per_request"]["client"] > 0
    assert any(k.startswith("transformers.") for k in row["cpu_ms_per_request"]), row  # the backend's own processes


@pytest.mark.parametrize("argv", [["--requests", "0"], ["--warmup", "-3"], ["--max-tokens", "0"],
                                  ["--backends", "nosuch"], ["--model", "/nonexistent/model"]])
def test_bad_arguments_are_one_line_errors_before_anything_runs(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2 and "error:" in capsys.readouterr().err
