"""``bakeoff compare`` on the real runs of ``examples/`` (issue 19, the evening in miniature):
the speculative decoding acceptance table (figures from an n-gram run on an H200; status and
class for the evening's MTP runs that failed or never loaded), the engines' own words under the
verdict table, a run whose requests all failed shown as no measurement, and column labels that
name the model where it differs from the first column's."""

from __future__ import annotations

import re
from pathlib import Path

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
        "a \\| b c \\[x\\](y) \\*z\\* \\_w\\_ snake_case \\`k\\` \\<t\\>"
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


def test_labels_name_the_model_where_it_differs_from_the_first_column():
    cols = load_columns([run("2a11f7"), run("53af89"), run("8fc745"), run("df2a90"), run("fa9920"), run("a108f4")])
    assert [c.label for c in cols] == [
        "vllm kv_cache_dtype=auto", "vllm (tiny-qwen3.5-moe-w4a16)", "vllm speculative_config=mtp (tiny-qwen3.5-moe-w4a16)",
        "vllm speculative_config=mtp (tiny-qwen3.5-moe-w4a16-patched)", "ort-genai", "ort-genai (tiny-qwen3.5-moe-cg)"]
