"""One run, one verdict (issue 36): a pytest selection that splits or filters the evaluations suite
does not produce a ``qualified`` run (``evaluations/selection.py``)."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from bakeoff.api.verdict import Check, decide
from evaluations.selection import left_out, suite_checks
from evaluations.session import MODULE_ORDER

REPO = Path(__file__).resolve().parent.parent


def _item(check: str | None):
    mark = SimpleNamespace(args=(check,)) if check else None
    return SimpleNamespace(get_closest_marker=lambda name: mark if name == "check" else None)


def test_the_suites_checks_read_from_its_source_are_the_markers_pytest_sees():
    seen: list[str] = []
    for mod in MODULE_ORDER:
        m = importlib.import_module(f"evaluations.{mod}")
        for name in sorted(vars(m), key=lambda n: getattr(getattr(m, n), "__code__", None) and
                           getattr(m, n).__code__.co_firstlineno or 0):
            fn = getattr(m, name)
            if name.startswith("test") and callable(fn):
                seen += [mk.args[0] for mk in getattr(fn, "pytestmark", []) if mk.name == "check"]
    assert suite_checks(MODULE_ORDER) == list(dict.fromkeys(seen)) and len(seen) >= 18, (suite_checks(MODULE_ORDER), seen)


def test_left_out_is_what_no_selected_item_records_and_the_run_has_not_recorded():
    everything = suite_checks(MODULE_ORDER)
    assert left_out(MODULE_ORDER, [_item(c) for c in everything] + [_item(None)], set()) == []
    assert left_out(MODULE_ORDER, [_item("load"), _item("sanity.known_answers")], set()) == \
        [c for c in everything if c not in ("load", "sanity.known_answers")]
    # a resumed run keeps what it measured: a filter that skips those leaves nothing out
    assert left_out(MODULE_ORDER, [_item("agents.multiturn")], set(everything) - {"agents.multiturn"}) == []


def test_a_partial_run_is_incomplete_and_a_failure_it_found_still_disqualifies():
    ok = [Check(name="load", status="pass"), Check(name="sanity.known_answers", status="pass")]
    assert decide(ok, True) == ("qualified", [])
    status, reasons = decide(ok, True, left_out=["throughput.sweep", "agents.multiturn"])
    assert status == "incomplete" and reasons == [
        "partial run: its test selection left out throughput.sweep, agents.multiturn (-k, -m, --deselect, --lf or "
        "module paths); a partial run measures, it does not qualify: run the whole suite (or --resume without the filter)"]
    bad = ok + [Check(name="sanity.degeneration", status="fail", failure_class="garbage-output", summary="x")]
    assert decide(bad, True, left_out=["throughput.sweep"])[0] == "disqualified"


def test_xdist_is_refused_in_one_line_before_anything_is_written(tmp_path):
    pytest.importorskip("xdist", reason="pytest-xdist is not installed: -n does not exist to refuse")
    art = tmp_path / "art"
    proc = subprocess.run([sys.executable, "-m", "pytest", "evaluations/", "-n", "2", "-p", "no:cacheprovider",
                           "--backend", "transformers", "--model", "fixture:tiny-qwen3", f"--artifacts={art}"],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 4, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert len(err) == 1 and "pytest-xdist's -n splits one evaluation into several partial runs" in err[0], err
    assert not (art / "runs").exists() or not any((art / "runs").iterdir())


def test_a_required_check_that_skips_makes_the_run_incomplete():
    ok = [Check(name="load", status="pass"), Check(name="sanity.known_answers", status="pass")]
    skipped = Check(name="sanity.reference_agreement", status="skip", summary="the transformers reference could "
                    "not run: load-failure: x", required=True)
    assert decide(ok + [skipped], True) == ("incomplete", [
        "sanity.reference_agreement: required to qualify, skipped: the transformers reference could not run: "
        "load-failure: x"])
    assert decide(ok + [skipped.model_copy(update={"required": False})], True)[0] == "qualified"


@pytest.mark.slow
def test_a_reference_that_cannot_run_leaves_the_run_incomplete(tmp_path):
    """A broken --reference-model (its weights truncated): the fixture's known answers still pass on
    the builder's record, the agreement could not be judged: ``incomplete`` naming the reference,
    never ``qualified`` (the census on 524d87b: ``qualified``)."""
    import json
    import shutil

    from bakeoff.models import fixtures

    ref = tmp_path / "broken-ref"
    shutil.copytree(fixtures.build("tiny-qwen3"), ref)
    weights = ref / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:4096])
    art = tmp_path / "art"
    proc = subprocess.run([sys.executable, "-m", "pytest", "evaluations/", "-p", "no:cacheprovider", "-q",
                           "--backend", "transformers", "--model", "fixture:tiny-qwen3", f"--reference-model={ref}",
                           f"--artifacts={art}", "-k", "test_load or test_sanity"],
                          capture_output=True, text=True, cwd=REPO, timeout=900)
    v = json.loads(next((art / "runs").glob("*/verdict.json")).read_text())
    checks = {c["name"]: c for c in v["checks"]}
    assert checks["sanity.known_answers"]["status"] == "pass", (checks["sanity.known_answers"], proc.stdout[-2000:])
    assert v["status"] == "incomplete", v["reasons"]
    assert v["reasons"][0].startswith("sanity.reference_agreement: required to qualify, skipped: the transformers "
                                      "reference could not run: "), v["reasons"]
