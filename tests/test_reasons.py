"""Every status but ``qualified`` says why, wherever a verdict is shown: ``bakeoff report``'s
report.md, ``bakeoff compare``'s report.md, index.html and recommendations, and the console
summary of ``bakeoff qualify``. The reasons come from the run directory alone (its checks,
recomputed by today's rule), are one short line in a table (an engine's ``|`` or newline does not
break it; HTML escaped) and whole in a per-run section of the same report."""

from __future__ import annotations

import html
import shutil
import json
import re
from pathlib import Path
from urllib.parse import unquote

import pytest

from bakeoff.api.verdict import Check, Verdict, decide
from bakeoff.host.artifacts import RunDir
from bakeoff.host.run import RunContext
from bakeoff.reporting.compare import write_compare
from bakeoff.reporting.report import write_report

SKIP_WHY = "the reference answers only 49% of the 300 probes (< 50%): known answers cannot judge this model"
GARBAGE = "probe accuracy 10% | below 60%\nsecond line: '1, 2, 3' -> ''"
NO_GPU = "no NVIDIA GPU: TensorRT-LLM needs CUDA (ImportError: <b>libcuda.so.1</b>: cannot open shared object file)"
LONG_TAIL = "the very end of a long engine message that only the full text holds"


def _run(root: Path, backend: str, checks: list[Check], finished: bool = True, kv_tokens: int | None = None) -> Path:
    rd = RunDir.create(root, backend, "fixture:tiny-qwen3")
    run = RunContext(rd, Verdict(run_id=rd.run_id, backend=backend, model="fixture:tiny-qwen3",
                                 backend_info={"engine": backend, "kv_cache_tokens": kv_tokens}))
    for c in checks:
        run.record(c)
    run.finish(finished=finished)
    return rd.path


@pytest.fixture
def runs(tmp_path) -> dict[str, Path]:
    """One run of each status that is not ``qualified``, and a qualified one."""
    ok = lambda name: Check(name=name, status="pass", summary="fine")  # noqa: E731
    root = tmp_path / "my runs" / "_art"  # a link to a run here: its space encoded, its "_" as it is
    return {
        "incomplete": _run(root, "vllm", [ok("load"), Check(name="sanity.known_answers", status="skip", summary=SKIP_WHY),
                                          ok("throughput.sweep")], kv_tokens=123_456),
        "disqualified": _run(root, "openvino", [
            ok("load"), Check(name="sanity.known_answers", status="fail", failure_class="garbage-output", summary=GARBAGE),
            Check(name="throughput.sweep", status="fail", failure_class="runtime-crash",
                  summary="engine died " + "x " * 150 + LONG_TAIL)]),
        "unavailable": _run(root, "trtllm", [Check(name="load", status="fail", failure_class="unavailable", summary=NO_GPU)]),
        "cut-off": _run(root, "ort-genai", [ok("load"), ok("sanity.tokenizer"),
                                            Check(name="telemetry.gpu", status="skip", summary="no NVIDIA GPU")],
                        finished=False),
        "qualified": _run(root, "transformers", [ok("load"), ok("sanity.known_answers")]),
    }


def _section(md: str, title: str) -> str:
    """The text of the ``## title`` section of a Markdown report."""
    return md.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def _row(md: str, first_cell: str) -> str:
    rows = [line for line in md.splitlines() if line.startswith(f"| {first_cell} |")]
    assert len(rows) == 1, (first_cell, rows)
    return rows[0]


def _cells(row: str) -> list[str]:
    """A Markdown table row's cells (an escaped ``\\|`` is no separator)."""
    return [c.strip() for c in re.split(r"(?<!\\)\|", row)[1:-1]]


def test_decide_says_why_a_run_was_cut_off():
    """A run that did not finish names the last check it recorded (the telemetry written as the
    session ends is no step of the run); one cut before any check says so."""
    checks = [Check(name="load", status="pass"), Check(name="sanity.tokenizer", status="pass"),
              Check(name="telemetry.gpu", status="skip", summary="no NVIDIA GPU")]
    status, reasons = decide(checks, finished=False)
    assert status == "incomplete" and reasons == ["cut off after check sanity.tokenizer: the run did not finish"]
    failed = [Check(name="load", status="pass"), Check(name="sanity.known_answers", status="fail",
                                                        failure_class="garbage-output", summary="0%")]
    assert decide(failed, finished=False)[1] == ["cut off after check sanity.known_answers: the run did not finish",
                                                 "sanity.known_answers: garbage-output: 0%"]
    assert decide([], finished=False) == ("incomplete", ["cut off before its first check: the run did not finish"])
    skipped = [Check(name="load", status="pass"), Check(name="sanity.known_answers", status="skip", summary=SKIP_WHY)]
    assert decide(skipped, finished=True) == ("incomplete", [f"sanity.known_answers: required to qualify, skipped: {SKIP_WHY}"])
    silent = [Check(name="load", status="fail", failure_class="load-failure")]
    assert decide(silent, finished=True) == ("disqualified", ["load: load-failure: (no message recorded)"])


def test_report_table_names_every_reason(runs, tmp_path):
    report = write_report(list(runs.values()), tmp_path / "rep").read_text()
    md = _section(report, "Verdicts")
    header = _cells(next(line for line in md.splitlines() if line.startswith("| backend | model |")))
    why = header.index("why")
    rows = {k: _cells(_row(md, b)) for k, b in (("incomplete", "vllm"), ("disqualified", "openvino"),
                                                ("unavailable", "trtllm"), ("cut-off", "ort-genai"),
                                                ("qualified", "transformers"))}
    assert all(len(r) == len(header) for r in rows.values()), rows  # an engine's "|" or newline breaks no row
    assert "sanity.known_answers: required to qualify, skipped: the reference answers only 49%" in rows["incomplete"][why]
    dq = rows["disqualified"][why]
    assert "sanity.known_answers: garbage-output: probe accuracy 10% \\| below 60% second line" in dq
    assert "throughput.sweep: runtime-crash: engine died" in dq and dq.endswith("…") and LONG_TAIL not in dq
    assert "load: unavailable: no NVIDIA GPU: TensorRT-LLM needs CUDA (ImportError: \\<b>libcuda.so.1\\</b>" in rows["unavailable"][why]
    assert rows["cut-off"][why] == "cut off after check sanity.tokenizer: the run did not finish"
    assert rows["qualified"][why] == ""
    assert all(len(r[why]) <= 320 for r in rows.values())  # short: one line in a table
    # the whole text, in the per-run section of the same report
    whole = _section(report, "Why not qualified")
    assert LONG_TAIL in whole and "transformers" not in whole
    links = re.findall(r"\]\(([^)]*)\)", whole)
    assert len(links) == 4 and all((tmp_path / "rep" / unquote(t)).is_file() for t in links), links
    for run_dir in (runs["incomplete"], runs["disqualified"], runs["unavailable"], runs["cut-off"]):
        assert run_dir.name in whole


def test_the_report_shows_counts_configuration_and_every_skipped_check(tmp_path):
    """A new user's findings: the sanity figures came without their denominators, the backends'
    configurations (backend_info.notes) and the checks that ended skip were nowhere in report.md."""
    rd = RunDir.create(tmp_path, "vllm", "m")
    run = RunContext(rd, Verdict(run_id=rd.run_id, backend="vllm", model="m", backend_info={
        "engine": "vllm", "kv_cache_tokens": 46_592, "max_concurrency": 22.75, "max_model_len": 2048,
        "notes": {"dtype": "bfloat16", "cpu_memory": "kv_cache_space_gib 1"}}))
    run.record(Check(name="load", status="pass"))
    run.record(Check(name="sanity.known_answers", status="pass", values={"accuracy": 0.94, "probes": 300}))
    run.record(Check(name="sanity.reference_agreement", status="pass", values={
        "exact": 272, "tie_divergences": 27, "real_divergences": 0, "undetermined_divergences": 1,
        "exact_match_rate": 272 / 300, "accuracy": 0.94, "reference_accuracy": 0.94}))
    run.record(Check(name="needles.retrieval", status="skip", summary="report only: no recorded recall rate"))
    run.record(Check(name="throughput.sweep", status="pass", values={"points": [
        {"sessions": 1, "requests": 2, "ok": 2, "input_tokens": 100, "output_tokens": 64, "output_tokens_per_s": 300.0,
         "itl_p50_ms": 0.0, "tpot_p50_ms": 2.5}]}))
    run.finish()
    md = write_report([rd.path], tmp_path / "rep").read_text()
    assert "| vllm | 94% (282/300) |" in md and "272 exact, 27 tie, 0 real, 1 undetermined of 300" in md
    assert "- **vllm**: dtype bfloat16; cpu_memory kv_cache_space_gib 1" in _section(md, "Engines")
    assert "22.8 at 2,048 tokens" in md
    assert "`needles.retrieval`: report only: no recorded recall rate" in _section(md, "Checks not verified")
    assert "ITL is per token: at the points where its p50 is 0.00" in md
    assert "| 1 | 2 | 50 / 32 | 300.0 |" in md  # requests, tokens in / out per request


def test_an_old_run_without_reasons_gets_them_recomputed(runs, tmp_path):
    """A verdict.json written before reasons were recorded: the reason is recomputed from its
    checks, also where a check's summary is not a string (a damaged run: shown as its text)."""
    for key in ("incomplete", "cut-off"):
        path = runs[key] / "verdict.json"
        v = json.loads(path.read_text())
        del v["reasons"]
        v["checks"][0]["summary"] = ["started", 1]
        path.write_text(json.dumps(v))
    md = _section(write_report([runs["incomplete"], runs["cut-off"]], tmp_path / "rep").read_text(), "Verdicts")
    assert "skipped: the reference answers only 49%" in _row(md, "vllm")
    assert "cut off after check sanity.tokenizer" in _row(md, "ort-genai")


def test_compare_names_every_reason_in_markdown_html_and_recommendations(runs, tmp_path):
    out = write_compare(list(runs.values()), tmp_path / "cmp")
    md = out["markdown"].read_text()
    why = _cells(_row(md, "why"))
    assert len(why) == 1 + len(runs), why  # the cells stay cells
    assert why[0] == "why" and why[5] == "–"  # the qualified run needs none
    assert "sanity.known_answers: required to qualify, skipped: the reference answers only 49%" in why[1]
    assert "garbage-output: probe accuracy 10% \\| below 60% second line" in why[2] and LONG_TAIL not in why[2]
    assert "load: unavailable: no NVIDIA GPU" in why[3] and "\\<b>libcuda" in why[3]
    assert why[4] == "cut off after check sanity.tokenizer: the run did not finish"
    whole = _section(md, "Why not qualified")
    assert LONG_TAIL in whole and runs["unavailable"].name in whole
    # a recommendation from a run that was not qualified says why it was not
    kv = _row(md, "largest KV capacity")
    assert "a run that was not qualified (incomplete: sanity.known_answers: required to qualify, skipped" in kv

    page = out["html"].read_text()
    assert "<b>libcuda" not in page and html.escape("<b>libcuda.so.1</b>", quote=False) in page
    row = re.search(r"<tr><td[^>]*>why</td>(.*?)</tr>", page, re.S)
    assert row, "no why row in the HTML"
    assert "required to qualify, skipped: the reference answers only 49%" in row.group(1)
    assert "cut off after check sanity.tokenizer" in row.group(1)
    assert "garbage-output: probe accuracy 10% | below 60% second line" in row.group(1)
    reasons = page.split('id="reasons"', 1)[1]
    assert LONG_TAIL in reasons and "load: unavailable: no NVIDIA GPU" in reasons


def test_console_summary_names_every_reason(runs, capsys):
    from cli.progress import print_verdicts, verdict_rows

    rows = {r[0]: r for r in verdict_rows(list(runs.values()))}  # (backend, model, status, reasons, run, options)
    assert rows["ort-genai"][2:4] == ("incomplete", "cut off after check sanity.tokenizer: the run did not finish")
    assert rows["vllm"][3].startswith("sanity.known_answers: required to qualify, skipped: the reference answers only 49%")
    assert rows["trtllm"][3].startswith("load: unavailable: no NVIDIA GPU: TensorRT-LLM needs CUDA")
    dq = rows["openvino"][3].splitlines()  # one line per reason, each short
    assert dq[0].startswith("sanity.known_answers: garbage-output: probe accuracy 10% | below 60% second line")
    assert dq[1].startswith("throughput.sweep: runtime-crash: engine died") and dq[1].endswith("…") and len(dq) == 2
    assert rows["transformers"][2:4] == ("qualified", "")
    outcomes = print_verdicts(list(runs.values()))
    assert [o[1] for o in outcomes] == ["incomplete", "disqualified", "unavailable", "incomplete", "qualified"]
    words = set(re.split(r"[\s│┃|]+", capsys.readouterr().out))  # the printed table's words
    assert {"sanity.tokenizer:", "unavailable:", "runtime-crash:", "garbage-output:", "skipped:"} <= words


def test_one_engine_in_a_lossy_and_a_lossless_configuration_reads_as_the_configurations_cost(tmp_path):
    """``--matrix ort-genai:precision=int4,fp32``: int4 disqualified for accuracy, fp32 qualified: the report
    says the engine serves the model and int4 costs the accuracy (absent when every cell agrees)."""
    ok = lambda name: Check(name=name, status="pass", summary="fine")  # noqa: E731
    root = tmp_path / "art"

    def cell(options: dict, checks: list[Check]) -> Path:
        rd = RunDir.create(root, "ort-genai", "smollm2-135m-instruct")
        run = RunContext(rd, Verdict(run_id=rd.run_id, backend="ort-genai", model="smollm2-135m-instruct", options=options))
        for c in checks:
            run.record(c)
        run.finish(finished=True)
        return rd.path

    cell({"precision": "int4"}, [ok("load"), ok("sanity.known_answers"), Check(
        name="sanity.reference_agreement", status="fail", failure_class="accuracy-regression",
        summary="backend 38.0% vs reference 49.3%")])
    cell({"precision": "fp32"}, [ok("load"), ok("sanity.known_answers"), ok("sanity.reference_agreement")])
    md = write_report([root], tmp_path / "rep").read_text()
    line = _section(md, "One engine, several configurations").strip()
    assert line.startswith("- **ort-genai** on smollm2-135m-instruct:"), line
    assert "precision=int4 **disqualified** (accuracy-regression)" in line and "precision=fp32 **qualified**" in line
    assert "the engine serves the model (precision=fp32); precision=int4 costs accuracy against the reference" in line
    single = tmp_path / "single"
    shutil.copytree(next(root.glob("runs/*")), single / "runs" / "one")
    assert "One engine, several configurations" not in write_report([single], tmp_path / "rep2").read_text()


def test_sweep_points_keep_the_token_totals_the_report_shows():
    """The report's "tokens in / out per request" reads each point's ``input_tokens`` and
    ``output_tokens`` (totals over its ok requests); the sweep check's values are filtered through
    ``POINT_KEYS``, which dropped them, so every real report showed "– / –" (a new user saw it)."""
    from bakeoff.loadgen.stats import summarize
    from bakeoff.loadgen.throughput import POINT_KEYS
    from bakeoff.reporting.report import per_request

    point = {k: v for k, v in summarize([], 1.0, 1).items() if k in POINT_KEYS}
    assert {"input_tokens", "output_tokens"} <= set(point)
    assert per_request({**point, "input_tokens": 100, "output_tokens": 64, "ok": 2}, "input_tokens") == "50"



def test_console_table_tells_a_backends_configurations_apart(tmp_path, capsys):
    """Two ORT GenAI runs of one model (``--matrix ort-genai:precision=int4,fp32``) read as two rows
    of the same backend unless the table shows their options (a new user's find)."""
    from cli.progress import print_verdicts

    root = tmp_path / "art"
    made = []
    for precision, status in (("int4", "fail"), ("fp32", "pass")):
        rd = RunDir.create(root, "ort-genai", "fixture:tiny-qwen3")
        run = RunContext(rd, Verdict(run_id=rd.run_id, backend="ort-genai", model="fixture:tiny-qwen3",
                                     options={"precision": precision}, backend_info={"engine": "ort-genai"}))
        run.record(Check(name="load", status="pass", summary="fine"))
        run.record(Check(name="sanity.known_answers", status=status, summary="probe accuracy",
                         failure_class="accuracy-regression" if status == "fail" else None))
        run.finish(finished=True)
        made.append(rd.path)
    outcomes = print_verdicts(made)
    out = capsys.readouterr().out
    assert "ort-genai [precision=int4]" in out and "ort-genai [precision=fp32]" in out
    assert [o[:2] for o in outcomes] == [("ort-genai", "disqualified"), ("ort-genai", "qualified")]
