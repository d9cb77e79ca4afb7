"""benchmarks/bench_fidelity.py: the table's structure and the ratio made of the two measured
figures (not a test of speed): one cheap engine (transformers, the fixture) at tiny settings."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_fidelity import (COLUMNS, alternate, main, paired_ratios, parse_args, ratio_cell,  # noqa: E402
                                       summarize_row, table)
from benchmarks.fidelity_tools import ToolSide  # noqa: E402


def test_paired_ratio_is_bakeoff_over_the_mean_of_the_tool_runs_around_it():
    assert paired_ratios([90.0, 50.0], [100.0, 80.0, 20.0]) == [90 / 90, 50 / 50]
    with pytest.raises(ValueError, match="need 3 tool runs"):
        paired_ratios([1.0, 2.0], [1.0, 2.0])


class _Side:
    """A FAKE side of the benchmark: its runs' tokens/s, in order."""

    def __init__(self, name, figures):
        self.name, self.figures = name, iter(figures)

    def run(self, sessions):
        return {"output_tokens_per_s": next(self.figures)}


def test_pairs_are_added_until_the_interval_is_narrow_enough_or_the_cap():
    """Steady runs stop at --pairs with a narrow interval; runs whose ratio swings 0.8-1.0 go on
    to --max-pairs and the row says unresolved, with its interval (issue 38: three pairs could not
    tell a gap from drift, and a bare median was quoted)."""
    steady_b, steady_t = _Side("b", [1] + [97.0] * 20), _Side("t", [1] + [100.0] * 21)
    b, t = alternate(steady_b, steady_t, 1, 3, lambda *_: None, max_pairs=10, half_width=0.03)
    row = summarize_row("e", "default", 1, "tool", b, t, 0.03)
    assert len(b) == 3 and row["resolved"] and row["ratio"] == pytest.approx(0.97)
    assert ratio_cell(row) == "0.970 [0.97, 0.97], 3"
    swing_b, swing_t = _Side("b", [1] + [80.0, 100.0] * 10), _Side("t", [1] + [100.0] * 21)
    b, t = alternate(swing_b, swing_t, 1, 3, lambda *_: None, max_pairs=6, half_width=0.03)
    row = summarize_row("e", "default", 1, "tool", b, t, 0.03)
    assert len(b) == 6 and not row["resolved"] and row["ratio_low"] < 0.85 < 0.95 < row["ratio_high"]
    assert ratio_cell(row).startswith("unresolved 0.8") and ratio_cell(row).endswith(", 6")
    one = summarize_row("e", "default", 1, "tool", b[:1], t[:2], 0.03)
    assert ratio_cell(one) == "unresolved 0.800 (one pair: no interval), 1"


@pytest.mark.parametrize("argv, words", [
    (["--engines", "vllm,nope"], "unknown engine 'nope'"),
    (["--sessions", "1,x"], "comma-separated integers"),
    (["--sessions", "0"], "positive integers"),
    (["--backend-opt", "vllm=max_model_len=8"], "ENGINE:key=value"),
    (["--half-width", "0"], "--half-width takes a number between 0 and 1"),
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
                "--warmup", "1", "--pairs", "2", "--max-pairs", "2", "--out", str(out)])
    assert json.loads(out.read_text())["rows"] == json.loads(json.dumps(res["rows"], default=str))
    assert res["skipped"] == {} and [r["sessions"] for r in res["rows"]] == [1, 2]
    for r in res["rows"]:
        # the kind is chosen once, in the untimed run, and every timed run is that kind alone
        assert r["engine"] == "transformers" and r["tool"].startswith("bare transformers, ")
        assert "(the best of serial / batched / continuous in the untimed run)" in r["tool"]
        assert len({x["kind"] for x in r["tool_runs"]}) == 1 and r["tool"].split(", ")[1].split(" (")[0] == \
            r["tool_runs"][0]["kind"]
        b = [x["output_tokens_per_s"] for x in r["bakeoff_runs"]]
        t = [x["output_tokens_per_s"] for x in r["tool_runs"]]
        assert len(b) == 2 and len(t) == 3 and all(x > 0 for x in b + t)
        # every request measured on both sides: sessions x requests x max_tokens output tokens
        assert all(x["output_tokens"] == r["sessions"] * 2 * 4 for x in r["bakeoff_runs"] + r["tool_runs"])
        assert r["ratios"] == pytest.approx([bi / ((t0 + t1) / 2) for bi, t0, t1 in zip(b, t, t[1:])])
        assert r["ratio"] == pytest.approx(statistics.geometric_mean(r["ratios"]))
        assert r["ratio_low"] <= r["ratio"] <= r["ratio_high"] and r["ratio_min"] <= r["ratio"] <= r["ratio_max"]
        assert r["bakeoff_output_tokens_per_s"] == pytest.approx(statistics.median(b))
        assert r["tool_output_tokens_per_s"] == pytest.approx(statistics.median(t))
        for k in ("bakeoff_ttft_p50_ms", "tool_ttft_p50_ms", "bakeoff_tpot_p50_ms", "tool_tpot_p50_ms"):
            assert r[k] is not None and r[k] > 0, k
    printed = capsys.readouterr().out
    assert table(res["rows"]) in printed and " | ".join(COLUMNS) in printed
    assert "transformers | 2 | " in printed
    assert "engine | sessions | bakeoff: us/token per process | tool: us/token per process" in printed


@pytest.mark.slow
@pytest.mark.engine("llamacpp")
def test_llamacpp_row_counts_every_token_on_both_sides(tmp_path):
    """llama.cpp's own side is its server code in process (no HTTP), on the GGUF the backend serves."""
    res = main(["--model", "smollm2-135m-instruct", "--engines", "llamacpp", "--sessions", "2", "--max-tokens", "4",
                "--requests-per-session", "2", "--warmup", "1", "--pairs", "1", "--max-pairs", "1",
                "--out", str(tmp_path / "fidelity.json")])
    assert res["skipped"] == {} and len(res["rows"]) == 1, res["skipped"]
    r = res["rows"][0]
    assert r["engine"] == "llamacpp" and r["tool"] == "llama.cpp in process"
    assert all(x["output_tokens"] == 2 * 2 * 4 for x in r["bakeoff_runs"] + r["tool_runs"]), r
    assert r["ratio"] > 0 and r["tool_ttft_p50_ms"] > 0 and r["tool_tpot_p50_ms"] > 0


class _Kinds(ToolSide):
    """A fake tool (named so) whose kinds give fixed figures; records which kinds ran."""

    kinds = ("serial", "batched")

    def __init__(self, figures: dict[str, float], fails: tuple[str, ...] = ()):
        self.figures, self.fails, self.ran = figures, fails, []

    def run_kind(self, sessions: int, kind: str | None) -> dict:
        self.ran.append((sessions, kind))
        if kind in self.fails:
            raise RuntimeError(f"{kind} gave no result")
        return {"output_tokens_per_s": self.figures[kind] * sessions, "kind": kind}


def test_a_tools_kind_is_chosen_in_its_first_run_at_a_session_count_and_kept():
    tool = _Kinds({"serial": 10.0, "batched": 12.0})
    first = tool.run(8)
    assert first["kind"] == "batched" and first["kinds"] == {"serial": 80.0, "batched": 96.0}
    assert [tool.run(8)["kind"] for _ in range(3)] == ["batched"] * 3
    assert tool.ran == [(8, "serial"), (8, "batched")] + [(8, "batched")] * 3  # timed runs: the chosen kind alone
    tool.run(1)  # another session count chooses again
    assert tool.ran[-2:] == [(1, "serial"), (1, "batched")]
    assert "batched (the best of serial / batched in the untimed run)" in tool.describe(8)


def test_a_kind_that_fails_in_the_choosing_run_is_named_and_never_chosen():
    tool = _Kinds({"serial": 10.0, "batched": 12.0}, fails=("batched",))
    first = tool.run(4)
    assert first["kind"] == "serial" and "batched" in first["failed_kinds"]
    assert tool.run(4)["kind"] == "serial"
    with pytest.raises(RuntimeError, match="every kind failed"):
        _Kinds({"serial": 1.0, "batched": 1.0}, fails=("serial", "batched")).run(2)
