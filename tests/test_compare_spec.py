"""``bakeoff compare`` on the real runs of ``examples/`` (issue 19, the evening in miniature):
the speculative decoding acceptance table (figures from an n-gram run on an H200; status and
class for the evening's MTP runs that failed or never loaded), the engines' own words under the
verdict table, a run whose requests all failed shown as no measurement, and column labels that
name the model where it differs from the first column's."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from bakeoff.reporting.compare import build, load_columns, write_compare
from bakeoff.reporting.compare_tables import engine_words, md_escape

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
EVENING = EXAMPLES / "evening"
NGRAM_H200 = EXAMPLES / "h200" / "20261202T014111Z_vllm_tiny-qwen3_8f14d9"  # ngram, 3 speculative tokens, figures


def run(suffix: str) -> Path:
    return next(EVENING.glob(f"*_{suffix}"))


def texts(row: list[dict]) -> list[str]:
    return [c["text"] for c in row]


def test_acceptance_table_figures_per_position_and_status_of_runs_without_them(tmp_path):
    auto, mtp, w4a16_mtp = run("2a11f7"), run("21ceef"), run("8fc745")
    cols = load_columns([auto, mtp, w4a16_mtp, NGRAM_H200])
    spec = build(cols, 0)["spec"]
    assert spec["header"][-3:] == ["position 0", "position 1", "position 2"]  # the widest k: ngram's 3
    rows = {r[0]["text"]: texts(r) for r in spec["rows"]}
    assert cols[0].label not in rows  # no speculative_config, nothing measured: no row
    ngram = rows[cols[3].label]
    assert ngram[1:] == ["ngram", "3", "pass", "51", "139", "48 (34.5%)", "1.94", "45.1%", "27.5%", "21.6%"]
    assert rows[cols[1].label][1:4] == ["mtp", "1", "fail (incompatible-features)"]
    assert set(rows[cols[1].label][4:]) == {"–"}  # no figures from a check that failed
    assert rows[cols[2].label][3] == "skip (load fail: config-rejected)"  # pre-flight refused: never served

    out = write_compare([auto, mtp, w4a16_mtp, NGRAM_H200], tmp_path / "r")
    md = out["markdown"].read_text()
    assert "## Speculative decoding acceptance" in md
    assert "| 51 | 139 | 48 (34.5%) | 1.94 | 45.1% | 27.5% | 21.6% |" in md
    assert 'id="spec-decode"' in out["html"].read_text()


def test_no_acceptance_table_without_speculative_runs():
    assert build(load_columns([run("2a11f7"), run("6c97e8")]), 0)["spec"] is None


def test_engine_words_are_in_the_markdown_escaped_and_trimmed(tmp_path):
    md = write_compare([run("2a11f7"), run("21ceef"), run("53af89"), run("8fc745")], tmp_path / "r")["markdown"].read_text()
    section = md.split("### What the engines said", 1)[1].split("\n## ", 1)[0]
    items = [line for line in section.splitlines() if line.startswith("- ")]
    assert len(items) == 9 + 1 + 1  # every failed check of the MTP run, the WNA16 load, the pre-flight refusal
    assert ("- **vllm speculative_config=mtp (tiny-qwen3.5-moe-w4a16)** · `load` · config-rejected: preflight: "
            "speculative\\_config method mtp: 32 MTP weights are stored unquantized (BF16)") not in md  # intraword _ kept
    assert ("- **vllm speculative_config=mtp (tiny-qwen3.5-moe-w4a16)** · `load` · config-rejected: preflight: "
            "speculative_config method mtp: 32 MTP weights are stored unquantized (BF16)") in md
    # vLLM's log prefix is taken out, so the engine's sentence survives the cut
    assert ("· `load` · incompatible-features: vllm exited with code 1 during start: NotImplementedError: "
            "No WNA16 MoE backend supports the deployment configuration.") in md
    assert "precopy_mamba_align_fused_kernel\\[grid\\](...)" in md  # brackets escaped: no link
    for item in items:
        words = item.split(": ", 1)[1]
        assert len(words.replace("\\", "")) <= 160 and "\n" not in words
        assert not re.search(r"(?<!\\)\|", item)  # a pipe in the words is escaped


def test_md_escape_and_engine_words():
    assert md_escape("a | b\nc [x](y) *z* _w_ snake_case `k` <t>") == \
        "a \\| b c \\[x\\](y) \\*z\\* \\_w\\_ snake_case \\`k\\` \\<t>"  # a ">" is no HTML without its "<"
    said = engine_words("vllm exited: (Worker pid=19588) ERROR 12-02 10:45:11 [multiproc_executor.py:953] Boom: no\nTraceback")
    assert said == "vllm exited: Boom: no"
    assert len(engine_words("word " * 100)) <= 160 and engine_words(None) == ""


def test_run_whose_requests_all_failed_is_no_measurement(tmp_path):
    auto, mtp = run("2a11f7"), run("21ceef")  # mtp: its one sweep request failed (incompatible-features)
    cols = load_columns([auto, mtp])
    assert 1 in cols[1].failed_points and not cols[1].points
    data = build(cols, 0)
    spec_line = next(f for f in data["findings"] if f.startswith("speculative decoding mtp"))
    assert "no measurement (all requests failed with it)" in spec_line and "%" not in spec_line.split(";")[0]
    for t in data["sweeps"]:
        first = next(r for r in t["rows"] if r[0]["text"] == "1")
        assert first[2]["text"] == "– (all requests failed)", t["title"]
    md = write_compare([auto, mtp], tmp_path / "r")["markdown"].read_text()
    assert "-100.0%" not in md and "0.0 (" not in md


def test_labels_name_the_model_when_the_runs_have_several():
    cols = load_columns([run("2a11f7"), run("53af89"), run("8fc745"), run("df2a90"), run("fa9920"), run("a108f4")])
    assert [c.label for c in cols] == [  # the first (baseline) column too
        "vllm kv_cache_dtype=auto (tiny-qwen3.5-moe)", "vllm (tiny-qwen3.5-moe-w4a16)", "vllm speculative_config=mtp (tiny-qwen3.5-moe-w4a16)",
        "vllm speculative_config=mtp (tiny-qwen3.5-moe-w4a16-patched)", "ort-genai (tiny-qwen3.5-moe)",
        "ort-genai (tiny-qwen3.5-moe-cg)"]
    assert load_columns([run("2a11f7")])[0].label == "vllm kv_cache_dtype=auto"  # one model: labels stay short


def damaged(tmp_path: Path, name: str, change) -> Path:
    """A copy of the H200 n-gram run whose verdict.json ``change(verdict, checks by name)`` damages."""
    dst = tmp_path / f"dir with spaces ü — {name}" / NGRAM_H200.name
    shutil.copytree(NGRAM_H200, dst)
    v = json.loads((dst / "verdict.json").read_text())
    change(v, {c["name"]: c for c in v["checks"]})
    (dst / "verdict.json").write_text(json.dumps(v))
    return dst


def per_position(value):
    def change(v, ck):
        ck["spec_decode.acceptance"]["values"]["per_position_acceptance"] = value
    return change


def declared_k(value):
    def change(v, ck):
        v["options"]["speculative_config"]["num_speculative_tokens"] = value
    return change


@pytest.mark.parametrize("change, positions, note", [
    (per_position({"a": 0.5, "0": 0.4}), ["40.0%"], "malformed (1 entry ignored)"),
    (per_position({"0.0": 0.5}), [], "malformed (1 entry ignored)"),
    (per_position({"-1": 0.5, "1": 0.25}), ["–", "25.0%"], "malformed (1 entry ignored)"),
    (per_position({"0": "45%", "1": None}), [], "malformed (1 entry ignored)"),
    (per_position([0.5, 0.3]), [], "malformed (a list, not an object)"),
    (per_position({"100000000": 0.5}), [], "positions past 15 not shown (1)"),
    (per_position({str(i): 0.5 for i in range(40)}), ["50.0%"] * 16, "positions past 15 not shown (24)"),
    (declared_k(10**8), ["45.1%", "27.5%", "21.6%"], None),  # a declared k makes no column
    (declared_k("3"), ["45.1%", "27.5%", "21.6%"], None),
])
def test_odd_per_position_acceptance_is_named_not_fatal(tmp_path, change, positions, note):
    bad = damaged(tmp_path, "odd positions", change)
    spec = build(load_columns([bad]), 0)["spec"]
    pos_cols = [h for h in spec["header"] if h.startswith("position ")]
    assert pos_cols == [f"position {i}" for i in range(len(positions))]
    row = texts(spec["rows"][0])
    assert row[8:8 + len(positions)] == positions
    assert (spec["header"][-1] == "per position" and row[-1] == note) if note else spec["header"][-1] != "per position"
    md = write_compare([NGRAM_H200, bad], tmp_path / "r")["markdown"].read_text()
    assert "## Speculative decoding acceptance" in md


@pytest.mark.parametrize("summary, words", [
    (["a", "b"], "\\['a', 'b'\\]"), (42, "42"), (None, "(no message recorded)"), ("  \n  \n", "(no message recorded)"),
    ({"x": "y"}, "{'x': 'y'}")])
def test_a_summary_of_any_type_is_shown_as_text(tmp_path, summary, words):
    def change(v, ck):
        ck["sanity.tokenizer"].update(status="fail", failure_class="runtime-crash", summary=summary)
    bad = damaged(tmp_path, "summary", change)
    assert engine_words(summary) == ("" if words.startswith("(no") else words.replace("\\", ""))
    out = write_compare([NGRAM_H200, bad], tmp_path / "r")
    md = out["markdown"].read_text()
    assert f"· `sanity.tokenizer` · runtime-crash: {words}" in md
    assert "runtime-crash" in out["html"].read_text()


def all_points_failed(v, ck):
    for p in ck["throughput.sweep"]["values"]["points"]:
        p.update(errors=p["requests"], ok=0, output_tokens_per_s=0.0)


def point_64_failed(v, ck):
    points = ck["throughput.sweep"]["values"]["points"]
    points.append({**points[-1], "sessions": 64, "errors": points[-1]["requests"], "ok": 0, "output_tokens_per_s": 0.0})


@pytest.mark.parametrize("change, others, failed_rows", [
    (all_points_failed, [], ["1", "2", "4", "8"]),  # no column succeeded anywhere: every row still there
    (point_64_failed, [NGRAM_H200], ["64"]),  # 64 sessions: only the failed point has it
])
def test_sweep_rows_where_every_request_failed_are_shown(tmp_path, change, others, failed_rows):
    bad = damaged(tmp_path, "failed points", change)
    data = build(load_columns([*others, bad]), 0)
    assert data["sweeps"]
    for t in data["sweeps"]:
        rows = {r[0]["text"]: texts(r)[-1] for r in t["rows"]}
        assert set(failed_rows) <= set(rows), t["title"]
        assert all(rows[n] == "– (all requests failed)" for n in failed_rows), t["title"]


def test_labels_escaped_in_the_markdown_and_naming_every_model(tmp_path):
    def other(v, ck):
        v.update(backend="vllm | <b>x</b> *y*", model="/some/path/Other Model ü/")
    bad = damaged(tmp_path, "label", other)
    cols = load_columns([NGRAM_H200, bad])
    assert [c.label for c in cols] == ["vllm speculative_config=ngram (tiny-qwen3)",
                                       "vllm | <b>x</b> *y* speculative_config=ngram (Other Model ü)"]
    out = write_compare([NGRAM_H200, bad], tmp_path / "r")
    md = out["markdown"].read_text()
    assert not re.search(r"(?<!\\)<b>", md) and "*y*" not in md and not re.search(r"[^\\]\| \\?<b>", md)
    esc = "vllm \\| \\<b>x\\</b> \\*y\\* speculative_config=ngram (Other Model ü)"
    assert f"| check | vllm speculative_config=ngram (tiny-qwen3) | {esc} |" in md  # the verdicts' header
    assert f"[{esc}](" in md  # the spec table's run cell
    out2 = write_compare([bad, NGRAM_H200], tmp_path / "r2")
    assert f"baseline: **{esc}**" in out2["markdown"].read_text()
    html = out["html"].read_text()
    assert "<b>x</b>" not in html and "&lt;b&gt;x&lt;/b&gt;" in html


def test_a_label_with_dollars_is_no_mathtext_in_the_plots(tmp_path):
    bad = damaged(tmp_path, "dollars", lambda v, ck: v.update(backend=r"vllm $\frac$"))
    out = write_compare([bad], tmp_path / "r")
    assert out["throughput"].is_file() and out["needles"].is_file()


def _points(change):
    def damage(v, ck):
        change(ck["throughput.sweep"]["values"]["points"], v)
    return damage


@pytest.mark.parametrize("change, words", [
    (_points(lambda pts, v: v.update(run_id=None)), "run_id is None"),
    (_points(lambda pts, v: pts[0].update(sessions=None)), "no integer sessions"),
    (_points(lambda pts, v: pts[0].update(sessions="one")), "no integer sessions"),
    (_points(lambda pts, v: pts.__setitem__(0, 5)), "no integer sessions"),
    (_points(lambda pts, v: pts[0].update(output_tokens_per_s="fast")), "output_tokens_per_s is 'fast'"),
    (_points(lambda pts, v: pts[1].update(ttft_p50_ms="x")), "ttft_p50_ms is 'x'"),
    (_points(lambda pts, v: pts[0].update(repeats="abc")), "repeats are not a list"),
    (_points(lambda pts, v: pts[0].update(repeats=[{"output_tokens_per_s": "z"}])), "output_tokens_per_s is 'z'"),
])
def test_a_sweep_figure_of_the_wrong_type_is_one_line(tmp_path, change, words):
    """A break-it review's damages that escaped as tracebacks from the tables, noise and plots."""
    from bakeoff.api.errors import UserError
    from bakeoff.reporting.compare import write_compare

    bad = damaged(tmp_path, "types", change)
    with pytest.raises(UserError, match="not bakeoff's") as err:
        write_compare([NGRAM_H200, bad], tmp_path / "out")
    assert words in str(err.value) and "\n" not in str(err.value)
