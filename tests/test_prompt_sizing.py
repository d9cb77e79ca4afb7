"""Long-context prompts sized from the engine's measured prefill rate and a time budget
(``evaluations/sizing.py``).

The rule on the numbers seen in the field (SmolLM2-135M on 2 CPU cores, about 116 prompt tokens/s,
an 8,192-token context) and on a fixture's (thousands of tokens/s, a 512-token context); the
calibration's rate from a stand-in ``send``; then the suite on the real transformers engine and
the fixture: at the default budgets the lengths are the context's, as before; with a budget too
small for them the needles check, whose fixture record was measured at the context's lengths,
skips saying why, and the other checks record the shorter lengths they used and why.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import evaluations.measuring as measuring
from bakeoff.api.specs import RequestRecord
from bakeoff.models.fixtures.corpus import NEEDLE_DEPTHS, NEEDLE_FRACTIONS
from evaluations.measuring import Calibration
from evaluations.sizing import Budget, fit

REPO = Path(__file__).resolve().parent.parent
DEFAULT = Budget(30.0, 120.0)  # evaluations/inputs.py DEFAULTS
NEEDLES = [f for f in NEEDLE_FRACTIONS["quick"] for _ in NEEDLE_DEPTHS["quick"]]  # 9 prompts, 4.95 x the context


def test_a_slow_engine_gets_needles_its_prefill_rate_fits():
    scale = fit(8192, NEEDLES, Calibration(20.0, "engine-usage", 116.0, 2000, 17_000), DEFAULT, "max_model_len")
    # 116 tok/s x 120 s / 4.95 = 2,812 tokens of scale; 0.9 x 2,812 = 2,531 tokens for the longest (22 s < 30 s)
    assert scale.capped and scale.tokens == 2812, scale
    assert scale.why.startswith("capped at 2,812 tokens (max_model_len 8,192): prefill 116 tok/s at the longest x "
                                "120 s budget for the check's 9 prompts"), scale.why
    v = scale.values()
    assert v["prefill_tokens_per_s"] == 116.0 and v["prefill_measured_on"] == "a 2000-token prompt, TTFT 17000 ms"
    # one long prompt: the per-prompt budget binds (116 x 30 s = 3,480)
    one = fit(8192, [1.0], Calibration(20.0, "engine-usage", 116.0, 2000, 17_000), DEFAULT, "long prompt")
    assert one.tokens == 3480 and "x 30 s budget per prompt" in one.why, one.why


def test_longer_prompts_are_estimated_slower_through_both_calibration_prompts():
    """Two timed prompts (800 and 1,600 tokens) give ``a n + b n^2``: SmolLM2-135M through the transformers
    worker took 24.3 s for 5,924 tokens where the longer prompt's rate alone (417 tok/s) said 14.2 s."""
    cal = Calibration(20.0, "engine-usage", 417.0, 1600, 3837.0, 800, 1700.0)
    assert cal.prefill_s(1600) == pytest.approx(3.837) and cal.prefill_s(800) == pytest.approx(1.7)
    assert 21.0 < cal.prefill_s(5924) < 26.0
    linear = Calibration(20.0, "engine-usage", 417.0, 1600, 3837.0)  # one prompt timed: its rate
    assert linear.prefill_s(5924) == pytest.approx(5924 / 417.0)
    flat = Calibration(20.0, "engine-usage", 417.0, 1600, 3837.0, 800, 3000.0)  # overhead-bound: no growth shown
    assert flat.prefill_s(5924) == pytest.approx(5924 / 417.0)
    scale = fit(8192, [1.0] * 8, cal, DEFAULT, "long prompt")  # the prefix cache's 8 sends
    assert scale.capped and sum(cal.prefill_s(scale.tokens) for _ in range(8)) <= 120.0 < 8 * cal.prefill_s(scale.tokens + 1)
    assert "x 120 s budget for the check's 8 prompts" in scale.why, scale.why


def test_a_fast_engine_keeps_the_contexts_lengths():
    scale = fit(512, NEEDLES, Calibration(1.0, "engine-usage", 2300.0, 82, 36.0), DEFAULT, "the fixture's needle context")
    assert not scale.capped and scale.tokens == 512, scale
    assert scale.why.startswith("the context's lengths (the fixture's needle context 512): prefill 2,300 tok/s fits")


def test_without_a_measured_rate_the_context_decides():
    scale = fit(8192, NEEDLES, Calibration(20.0, "estimate"), DEFAULT, "max_model_len")
    assert not scale.capped and scale.tokens == 8192 and "not measured" in scale.why


def test_calibration_times_the_longer_prompt(monkeypatch):
    """The prefill rate is the longer calibration prompt's tokens per second of its TTFT."""
    def send(engine, reqs, concurrency=1):
        out = []
        for r in reqs:
            n = len(r.prompt) // 4
            out.append(RequestRecord(request_id=r.request_id, input_tokens=n, sent_ns=0, first_token_ns=n * 10_000_000))
        return out  # 10 ms per token: 100 tok/s
    monkeypatch.setattr(measuring, "send", send)
    cal = measuring.calibrate(object(), fixture=False)
    assert cal.source == "engine-usage" and cal.prefill_tokens_per_s == pytest.approx(100.0), cal
    assert cal.probe_tokens > 500 and cal.probe_ttft_ms == pytest.approx(cal.probe_tokens * 10)
    assert cal.short_tokens == pytest.approx(cal.probe_tokens / 2, rel=0.1) and cal.short_ttft_ms == cal.short_tokens * 10
    assert cal.prefill_s(10_000) == pytest.approx(100.0)  # no growth with length: linear


# ---- the suite, real engine --------------------------------------------------------------------

def _suite(tmp_path: Path, *opts: str) -> dict[str, dict]:
    art = tmp_path / "art"
    cmd = [sys.executable, "-m", "pytest", "evaluations/", "-q", "-p", "no:cacheprovider", "--backend", "transformers",
           "--model", "fixture:tiny-qwen3", "--artifacts", str(art),
           "-k", "test_load or test_prefix_cache or test_needles or test_agents", *opts]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    runs = list((art / "runs").glob("*/checks"))
    assert len(runs) == 1, proc.stdout[-3000:] + proc.stderr[-2000:]
    return {p.stem: json.loads(p.read_text()) for p in runs[0].glob("*.json")}


@pytest.mark.engine("transformers")
def test_the_fixture_keeps_its_lengths_at_the_default_budgets(tmp_path):
    checks = _suite(tmp_path)
    needles, agents, prefill = checks["needles.retrieval"], checks["agents.multiturn"], checks["prefix_cache.prefill"]
    for c in (needles, agents, prefill):
        v = c["values"]
        assert v["capped_by_budget"] is False and v["scale_tokens"] == v["context_tokens"], (c["name"], v)
        assert v["sizing"].startswith("the context's lengths") and v["prefill_tokens_per_s"] > 0, v["sizing"]
    assert needles["values"]["scale_tokens"] == needles["values"]["max_model_len"]  # the recorded lengths
    assert needles["status"] in ("pass", "fail") and "not judged" not in needles["summary"], needles["summary"]
    # no prefix-cache counters in the transformers worker: one informational pair, and no correctness pair
    assert prefill["status"] == "skip" and prefill["values"]["pairs"] == 1, prefill
    correctness = checks["prefix_cache.correctness"]
    assert correctness["status"] == "skip" and "(nothing sent)" in correctness["summary"], correctness
    v = agents["values"]  # the context's rule alone: 4 turns in 90% of the 512-token context
    assert v["tool_tokens"] == v["context_tokens"] - v["max_tokens"] - 8 == int(0.9 * 512 / 4) - 24, v


@pytest.mark.engine("transformers")
def test_a_budget_below_the_recorded_lengths_skips_the_needles_honestly(tmp_path):
    checks = _suite(tmp_path, "--check-prefill-budget", "0.05")
    needles, agents, prefill = checks["needles.retrieval"], checks["agents.multiturn"], checks["prefix_cache.prefill"]
    assert needles["status"] == "skip", needles
    assert needles["summary"].startswith("not judged: capped at ") and "x 0.05 s budget for the check's 9 prompts" in \
        needles["summary"] and "recorded its needle recall" in needles["summary"], needles["summary"]
    assert agents["status"] == "pass" and agents["values"]["capped_by_budget"], agents["values"]
    assert agents["values"]["tool_tokens"] < int(0.9 * 512 / 4) - 24 and agents["values"]["sizing"].startswith(
        "capped at "), agents["values"]
    assert prefill["values"]["capped_by_budget"] and prefill["values"]["prompt_tokens"] < 300, prefill["values"]
