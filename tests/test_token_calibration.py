"""Prompt-length calibration (evaluations/measuring.py tokens_per_unit) under a short context, and the judge's scorer options."""

from __future__ import annotations

import pytest

import evaluations.measuring as measuring
from bakeoff.api.specs import RequestRecord


def _engine_with_context(max_len: int, tokens_per_char: float, calls: list):
    """A stand-in for ``send``: the engine counts tokens per character and refuses prompts over
    ``max_len`` tokens with vLLM's HTTP 400 text, as the H200 vLLM run of a fixture-tokenizer
    Qwen3-1.7B did."""
    def send(engine, reqs, concurrency=1):
        out = []
        for r in reqs:
            n = int(len(r.prompt) * tokens_per_char)
            calls.append(n)
            if n > max_len:
                out.append(RequestRecord(request_id=r.request_id, status="error", error=(
                    f"HTTP 400: This model's maximum context length is {max_len} tokens.")))
            else:
                out.append(RequestRecord(request_id=r.request_id, input_tokens=n))
        return out
    return send


@pytest.mark.parametrize("max_len", [100_000, 2048, 600])
def test_calibration_measures_within_the_context(monkeypatch, max_len):
    calls: list[int] = []
    monkeypatch.setattr(measuring, "send", _engine_with_context(max_len, 0.8, calls))
    per_unit, src = measuring.tokens_per_unit(object(), fixture=False)
    assert src == "engine-usage", calls
    sentence_chars = len(measuring._join(measuring.filler_units(40, False, 99), False)) / 40
    assert per_unit == pytest.approx(0.8 * sentence_chars, rel=0.15)


def test_calibration_falls_back_to_the_estimate_when_nothing_fits(monkeypatch):
    calls: list[int] = []
    monkeypatch.setattr(measuring, "send", _engine_with_context(5, 0.8, calls))
    assert measuring.tokens_per_unit(object(), fixture=False) == (20.0, "estimate")
    assert len(calls) == 6  # three sizes tried, two prompts each


def test_the_judges_scorer_starts_without_continuous_batching(tmp_path):
    """A reference run with ``--reference-opt batching=continuous`` generates through paged
    attention, which cannot serve the judge's forward passes (transformers 5.x ``sdpa_paged``:
    "called without a paged attention cache", the H200 run's /v1/score 500): the scorer drops it."""
    from types import SimpleNamespace

    from backends._hosting.threads import usable_cpus
    from evaluations.reference import reference_config

    settings = SimpleNamespace(reference_model=SimpleNamespace(path=str(tmp_path)), start_timeout_s=60.0,
                               progress_timeout_s=60.0, request_deadline_factor=5.0,
                               reference_options={"batching": "continuous", "device": "cuda"})
    assert reference_config(settings, tmp_path / "r").options == {"batching": "continuous", "max_batch_size": 32,
                                                                  "device": "cuda"}
    assert reference_config(settings, tmp_path / "j", scoring=True).options == {"batching": "none", "max_batch_size": 32,
                                                                                "device": "cuda"}
    assert settings.reference_options["batching"] == "continuous"  # the run's own settings untouched
    # the default static batches score between batches: the scorer keeps them (its open-ended answers one batch)
    settings.reference_options = {"device": "cpu"}
    assert reference_config(settings, tmp_path / "j", scoring=True).options == \
        {"batching": "static", "max_batch_size": 32, "dtype": "float32", "num_threads": usable_cpus(), "device": "cpu"}
