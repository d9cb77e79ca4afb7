"""benchmarks/bench_fidelity.py: the table's structure and the ratio made of the two measured
figures (not a test of speed): one cheap engine (transformers, the fixture) at tiny settings."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_fidelity import COLUMNS, main, paired_ratios, parse_args, table  # noqa: E402


def test_paired_ratio_is_bakeoff_over_the_mean_of_the_tool_runs_around_it():
    assert paired_ratios([90.0, 50.0], [100.0, 80.0, 20.0]) == [90 / 90, 50 / 50]
    with pytest.raises(ValueError, match="need 3 tool runs"):
        paired_ratios([1.0, 2.0], [1.0, 2.0])


@pytest.mark.parametrize("argv, words", [
    (["--engines", "vllm,nope"], "unknown engine 'nope'"),
    (["--sessions", "1,x"], "comma-separated integers"),
    (["--sessions", "0"], "positive integers"),
    (["--backend-opt", "vllm=max_model_len=8"], "ENGINE:key=value"),
])
def test_bad_arguments_are_one_line(argv, words, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2 and words in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.engine("transformers")
def test_transformers_row_per_session_count_with_ratio_from_both_figures(tmp_path, capsys):
    out = tmp_path / "fidelity.json"
    res = main(["--engines", "transformers", "--sessions", "1,2", "--max-tokens", "4", "--requests-per-session", "2",
                "--warmup", "1", "--pairs", "2", "--out", str(out)])
    assert json.loads(out.read_text())["rows"] == json.loads(json.dumps(res["rows"], default=str))
    assert res["skipped"] == {} and [r["sessions"] for r in res["rows"]] == [1, 2]
    for r in res["rows"]:
        assert r["engine"] == "transformers" and r["tool"].startswith("bare transformers, best of serial / batched")
        b = [x["output_tokens_per_s"] for x in r["bakeoff_runs"]]
        t = [x["output_tokens_per_s"] for x in r["tool_runs"]]
        assert len(b) == 2 and len(t) == 3 and all(x > 0 for x in b + t)
        # every request measured on both sides: sessions x requests x max_tokens output tokens
        assert all(x["output_tokens"] == r["sessions"] * 2 * 4 for x in r["bakeoff_runs"] + r["tool_runs"])
        assert r["ratios"] == pytest.approx([bi / ((t0 + t1) / 2) for bi, t0, t1 in zip(b, t, t[1:])])
        assert r["ratio"] == pytest.approx(statistics.median(r["ratios"]))
        assert r["ratio_min"] <= r["ratio"] <= r["ratio_max"]
        assert r["bakeoff_output_tokens_per_s"] == pytest.approx(statistics.median(b))
        assert r["tool_output_tokens_per_s"] == pytest.approx(statistics.median(t))
        for k in ("bakeoff_ttft_p50_ms", "tool_ttft_p50_ms", "bakeoff_tpot_p50_ms", "tool_tpot_p50_ms"):
            assert r[k] is not None and r[k] > 0, k
    printed = capsys.readouterr().out
    assert table(res["rows"]) in printed and " | ".join(COLUMNS) in printed
    assert "transformers | 2 | " in printed
