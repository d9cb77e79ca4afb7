"""Damaged cache entries cost time, never a verdict (issue 36): the reference's cached outputs and the
judge's cached answers that do not read whole are computed again. (Fixtures, exports and engine
environments: tests/test_fixtures_shipped.py, test_export_cache_schema.py, test_envs.py.)"""

from __future__ import annotations

import json

import pytest

from evaluations.judging import ReferenceAnswers
from evaluations.reference import _cached_reference

WHOLE = {"ok": True, "outputs": [{"status": "ok", "text": " Paris", "token_ids": [1]}] * 3, "engine": {}}


@pytest.mark.parametrize("damage", [
    "truncated", "not json", "a list", "ok false", "one output short", "an output without text", "an error output"])
def test_a_damaged_reference_entry_is_not_used(tmp_path, damage):
    path = tmp_path / "ref.json"
    good = json.dumps(WHOLE)
    path.write_text(good)
    assert _cached_reference(path, 3) == WHOLE
    bad = {"truncated": good[: len(good) // 2], "not json": "\x00\x01", "a list": "[1, 2]",
           "ok false": json.dumps({**WHOLE, "ok": False}),
           "one output short": json.dumps({**WHOLE, "outputs": WHOLE["outputs"][:2]}),
           "an output without text": json.dumps({**WHOLE, "outputs": [{"status": "ok"}] * 3}),
           "an error output": json.dumps({**WHOLE, "outputs": [{"status": "error", "text": ""}] * 3})}[damage]
    path.write_text(bad)
    assert _cached_reference(path, 3) is None
    assert _cached_reference(tmp_path / "absent.json", 3) is None


def test_a_damaged_judge_answer_is_asked_again(tmp_path, monkeypatch):
    monkeypatch.setenv("BAKEOFF_CACHE", str(tmp_path))
    asked: list[str] = []

    def score(base_url, prompt, ids, text, top_k):
        asked.append(prompt)
        return {"token_ids": [1], "logprobs": [-0.5], "top_logprobs": []}

    ref = ReferenceAnswers(["model", "stamp", {}], lambda: type("B", (), {"base_url": "http://x"})(), score, None)
    first = ref.score("p", [1], "", 0)
    assert ref.score("p", [1], "", 0) == first and asked == ["p"]  # cached
    for entry in ref.root.glob("*.json"):
        entry.write_text(json.dumps({"question": json.loads(entry.read_text())["question"], "answer": 7}))
    assert ref.score("p", [1], "", 0) == first and asked == ["p", "p"]  # damaged: asked again
    for entry in ref.root.glob("*.json"):
        entry.write_text("{")
    assert ref.score("p", [1], "", 0) == first and asked == ["p", "p", "p"]


@pytest.mark.slow
def test_a_reference_cache_that_cannot_be_written_costs_no_check(tmp_path):
    """Census 5.11 (a read-only cache): writing the reference's fresh outputs raised OSError in a
    fixture, and the sanity checks went missing from the verdict with no word. Now the outputs are
    used, the run says they were not cached, and the checks are recorded (here a file stands where
    the reference's cache folder goes)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from bakeoff.loadgen.synth_launch import SynthServer

    repo = Path(__file__).resolve().parents[1]
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "reference").write_text("not a folder")
    with SynthServer({"model": "m", "output_tokens": 4}) as srv:
        proc = subprocess.run([sys.executable, "-m", "pytest", "evaluations/", "-p", "no:cacheprovider", "-q",
                               "--backend", "openai", f"--backend-opt=base_url={srv.url}", "--model=fixture:tiny-qwen3",
                               f"--artifacts={tmp_path / 'art'}", "-k", "test_calibration or test_load or test_sanity"],
                              capture_output=True, text=True, cwd=repo, timeout=900,
                              env=dict(os.environ, BAKEOFF_CACHE=str(cache)))
    out = proc.stdout + proc.stderr
    assert "the reference's outputs were not cached" in out, out[-3000:]
    v = json.loads(next((tmp_path / "art" / "runs").glob("*/verdict.json")).read_text())
    names = {c["name"]: c for c in v["checks"]}
    assert names["sanity.reference_agreement"]["status"] == "fail", names.get("sanity.reference_agreement")
    assert "Traceback" not in out
