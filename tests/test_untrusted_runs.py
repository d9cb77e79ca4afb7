"""Text and figures read from run directories are shown as what they are (issue 29): escaped in
every report, NaN as "–", an unknown status as itself; and the shipped examples say what the
current verdict rule says of their checks."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from bakeoff.api.verdict import Check, decide
from bakeoff.reporting.compare import write_compare
from bakeoff.reporting.report import fmt, load_run, write_report

REPO = Path(__file__).resolve().parent.parent
GOOD = REPO / "examples" / "cpu" / "20261201T230336Z_transformers_tiny-qwen3_26dc9c"
PAYLOADS = ['<script>alert(1)</script>', '<img src=x onerror=alert(1)>', '[x](javascript:alert(1))', '`<b>`', "a|b\n# h"]


def _copy(tmp_path: Path, name: str, change) -> Path:
    d = tmp_path / "runs" / name
    shutil.copytree(GOOD, d)
    v = json.loads((d / "verdict.json").read_text())
    change(v)
    (d / "verdict.json").write_text(json.dumps(v, allow_nan=True))
    return d


def _raw_html(md: str) -> list[str]:
    """Tags a Markdown renderer would pass through: a ``<`` not escaped by a backslash, outside code."""
    return re.findall(r"(?<!\\)<[A-Za-z/!]", re.sub(r"`[^`\n]*`", "", md))


@pytest.mark.parametrize("payload", PAYLOADS)
def test_run_text_is_escaped_in_every_output(tmp_path, payload):
    """A model name, a backend name, an option and a failed check's words from a run: text, never
    HTML or Markdown, in compare's report.md (the "Option effects" bullets included) and index.html,
    and in report's report.md."""
    def change(v):
        v["model"], v["backend"] = payload, f"vllm{payload}"
        v["options"] = {"kv_cache_dtype": "fp8", "note": payload}
        v["checks"][0].update(status="fail", failure_class="load-failure", summary=payload)
    a = _copy(tmp_path, "a", change)
    b = _copy(tmp_path, "b", lambda v: v.update(model=payload, backend=f"vllm{payload}",
                                                   options={"kv_cache_dtype": "auto", "note": payload}))
    out = write_compare([a, b], tmp_path / "cmp")
    md = out["markdown"].read_text()
    assert not _raw_html(md), _raw_html(md)
    assert not re.search(r"(?<!\\)\]\(javascript:", md)  # an escaped bracket is no link
    html = out["html"].read_text()
    assert "<script>alert" not in html and "<img src=x" not in html
    report = write_report([a, b], tmp_path / "rep").read_text()
    assert not _raw_html(report.replace("<br>", "")), _raw_html(report)


def test_nan_is_a_dash_and_an_unknown_status_is_itself(tmp_path):
    assert fmt(float("nan")) == "–" and fmt(float("inf"), 2) == "–" and fmt(1234.5) == "1,234.5"
    nan = _copy(tmp_path, "figures", lambda v: next(c for c in v["checks"] if c["name"] == "throughput.sweep")[
        "values"]["points"][0].update(output_tokens_per_s=float("nan")))
    five = _copy(tmp_path, "five", lambda v: v.update(status=5))
    assert load_run(five)["status"] == "unknown status '5'"
    md = write_compare([nan, five], tmp_path / "cmp")["markdown"].read_text()
    assert "unknown status '5'" in md and "nan" not in md.lower().replace("nanos", "")
    report = write_report([nan, five], tmp_path / "rep").read_text()
    assert "**unknown status '5'**" in report and " nan " not in report


def test_shipped_examples_say_what_the_current_rule_says():
    """A run directory under examples/ records the status today's rule gives its checks (three
    early runs said "qualified" with four checks and no known-answers check)."""
    for path in sorted(REPO.glob("examples/**/verdict.json")):
        v = json.loads(path.read_text())
        status, reasons = decide([Check.model_validate(c) for c in v["checks"]], finished=v.get("finished_at") is not None,
                                 left_out=v.get("left_out") or [])
        assert (v["status"], v["reasons"]) == (status, reasons), path.parent.name
