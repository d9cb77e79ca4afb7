"""Capacity: the KV cache the engine allocated and the warm-up cost of its first request.

- ``capacity.kv_cache``: KV cache capacity in tokens and the engine's stated maximum
  concurrency at ``max_model_len`` (vLLM's startup line ``<pool> KV cache size: N tokens,
  Maximum concurrency for L tokens per request: Xx``, read into ``BackendInfo``). An engine that
  states only the KV memory (OpenVINO GenAI) gets that memory and the tokens it should hold
  at the element type it reports, as ``info`` (a computation, not a statement). Skipped, with
  the reason, when the engine states none of these. Every run states its KV ratio: a run with
  ``kv_cache_dtype`` auto/unset is the baseline (1.0); a quantized dtype is compared with the
  baseline run passed as ``--baseline-run DIR`` (``bakeoff qualify --matrix
  kv_cache_dtype=auto,fp8`` runs the auto cell first and passes it): KV tokens per GiB of KV
  memory (vLLM CPU sizes the cache from the memory free at start, so raw tokens differ run to
  run) against what the dtype's bytes predict (bf16 -> fp8: 2.0x). Within 1% of 1.0 the option
  changed nothing: ``ineffective-option``, naming both runs (:func:`bakeoff.analysis.matrix.kv_capacity_ratio`).
  ``bakeoff compare`` still shows the tokens of matrix twins side by side.
  The check explains the figure from the checkpoint's config (:mod:`bakeoff.analysis.kv_layout`):
  which layers hold a KV cache (a hybrid's full-attention layers only: 10 of 40 in a
  Qwen3.5-35B-A3B), bytes per token per layer kind, the tokens the stated KV memory should hold
  (``predicted_kv_tokens``), and the ratio the dtype should give; a measured ratio below that
  prediction by more than 25% is ``ineffective-option`` too, except on a hybrid model, where vLLM
  sizes attention blocks to the linear-attention state page and the ratio moves in whole blocks:
  there it is recorded (``below-prediction-hybrid``) and only no gain at all fails
  (:func:`bakeoff.analysis.kv_layout.judge_ratio`); a ratio above the prediction is recorded, not failed.
- ``capacity.warmup``: the first request after start against the steady state, from the
  ``throughput.sweep`` check's warm-up (its first request is the first of the sweep's
  shape; the sanity probes ran before it) and its single-session point. Report only (pass): a slow first
  request is common (autotune, JIT, lazy allocation) and is what operators pre-warm for.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from bakeoff.analysis.kv_layout import kv_layout
from bakeoff.analysis.matrix import kv_capacity_ratio, kv_dtype, load_baseline
from bakeoff.analysis.preflight import read_config
from evaluations.measuring import serves_one_at_a_time


def _states_memory_only(info) -> bool:
    """Whether the engine stated its KV cache in bytes only (no tokens, no concurrency)."""
    return info is not None and info.kv_cache_tokens is None and info.max_concurrency is None \
        and bool(info.kv_cache_memory_gib)


def _stated_kv(c, run, info) -> None:
    """Record the KV cache the engine stated (tokens, concurrency, pool, memory); ``load-failure``
    when it states no tokens."""
    c.values.update({"kv_cache_tokens": info.kv_cache_tokens, "max_concurrency": info.max_concurrency,
                     "max_model_len": info.max_model_len, "kv_pool": (info.notes or {}).get("kv_pool"),
                     "kv_cache_dtype": run.verdict.options.get("kv_cache_dtype", "auto")})
    if info.kv_cache_tokens and info.max_model_len:
        c.values["full_context_sequences"] = round(info.kv_cache_tokens / info.max_model_len, 2)
    c.require(bool(info.kv_cache_tokens) and info.kv_cache_tokens > 0,
              f"the engine stated a KV cache of {info.kv_cache_tokens} tokens", "load-failure")
    c.values["kv_cache_memory_gib"] = info.kv_cache_memory_gib
    if info.kv_cache_memory_gib:
        c.values["kv_tokens_per_gib"] = round(info.kv_cache_tokens / info.kv_cache_memory_gib)


def _kv_ratio(c, run, info, pytestconfig, settings) -> tuple[dict, dict | None]:
    """The KV ratio against the ``--baseline-run`` (:func:`kv_capacity_ratio`) and the checkpoint's
    KV layout, recorded in values and evidence: ``(ratio, layout)``."""
    base_dir = pytestconfig.getoption("--baseline-run", None)
    baseline = load_baseline(Path(base_dir)) if base_dir else None
    if baseline is not None and kv_dtype(baseline["options"]) == kv_dtype(run.verdict.options):
        baseline = None  # a twin in another choice (speculation, chunked prefill): no KV dtype to compare
    config = read_config(settings.model.path) if settings.model.local else {}
    ratio = kv_capacity_ratio(run.verdict.options, info.model_dump(), run.verdict.run_id, baseline, config or None)
    layout = ratio.pop("kv_layout", None)
    c.values["kv_ratio"] = ratio
    if layout:
        c.values["kv_layout"] = layout
        c.evidence("kv_layout.json", layout)
        if layout["kv_bytes_per_token"] and info.kv_cache_memory_gib:
            c.values["predicted_kv_tokens"] = int(info.kv_cache_memory_gib * 2**30 / layout["kv_bytes_per_token"])
    if baseline is not None:
        c.evidence("baseline_backend_info.json", baseline)
    return ratio, layout


def _kv_summary(info, ratio: dict, layout: dict | None) -> str:
    """The check's summary: the stated KV cache, its concurrency, the KV ratio and the layout's words."""
    return (f"KV cache {info.kv_cache_tokens:,} tokens"
            + (f" in {info.kv_cache_memory_gib} GiB" if info.kv_cache_memory_gib else "")
            + (f" ({info.max_concurrency}x at {info.max_model_len} tokens per request)" if info.max_concurrency else "")
            + "; " + ratio["text"]
            + (f"; {layout['text']}" if layout and ratio.get("role") != "compared" else ""))


@pytest.mark.check("capacity.kv_cache")
def test_kv_cache(run, engine, pytestconfig, settings):
    with run.check("capacity.kv_cache", "ineffective-option") as c:
        info = engine.info
        c.evidence("backend_info.json", info.model_dump() if info else {})
        if _states_memory_only(info):
            _memory_only(c, info, settings)
            return
        if info is None or (info.kv_cache_tokens is None and info.max_concurrency is None):
            why = ("serves one request at a time and keeps no shared KV pool"
                   if serves_one_at_a_time(engine) else "did not state its KV cache size at start")
            c.skip(f"KV capacity not stated: {info.engine if info else 'engine'} {why}")
        _stated_kv(c, run, info)
        ratio, layout = _kv_ratio(c, run, info, pytestconfig, settings)
        c.summary = _kv_summary(info, ratio, layout)
        if ratio["ineffective"]:
            c.fail(f"kv_cache_dtype {ratio['kv_cache_dtype']} is ineffective: {ratio['text']}")


def _memory_only(c, info, settings) -> None:
    """An engine that states its KV cache in bytes only (OpenVINO GenAI's ``SchedulerConfig.cache_size``).

    The stated memory is recorded as the capacity; the tokens it holds are derived from the
    checkpoint's KV bytes per token at the element type the engine reports
    (``notes.kv_cache_precision``, its size in ``notes.kv_cache_element_bytes``, which the
    engine's backend folder fills in: backends/openvino), and the check ends ``info``: bakeoff read the bytes from the
    engine, but the token count is a computation, not an engine statement, so it is not a pass."""
    notes = info.notes or {}
    precision = str(notes.get("kv_cache_precision") or "")
    config = read_config(settings.model.path) if settings.model.local else {}
    try:
        eb = float(notes.get("kv_cache_element_bytes") or "nan")
    except ValueError:
        eb = math.nan
    eb = eb if math.isfinite(eb) and eb > 0 else None
    layout = kv_layout(config, "auto") if config else None
    gib = info.kv_cache_memory_gib
    if layout and eb and layout.get("kv_bytes_per_token") and layout.get("kv_element_bytes") \
            and math.isfinite(gib) and gib > 0:
        per_token = layout["kv_bytes_per_token"] / layout["kv_element_bytes"] * eb
        tokens = int(info.kv_cache_memory_gib * 2**30 / per_token)
    else:
        per_token = tokens = None
    c.values.update({"kv_cache_memory_gib": info.kv_cache_memory_gib, "kv_cache_precision": precision or None,
                     "kv_bytes_per_token": per_token, "derived_kv_cache_tokens": tokens,
                     "kv_cache_tokens": None, "max_model_len": info.max_model_len,
                     "source": "stated memory (bytes) / KV bytes per token of the checkpoint at the stated precision"})
    if layout:
        c.evidence("kv_layout.json", layout)
    c.report_only(f"KV cache {info.kv_cache_memory_gib} GiB stated by {info.engine}, not in tokens"
                  + (f"; about {tokens:,} tokens at {per_token:g} bytes per token ({precision}, scales left out)"
                     if tokens is not None else
                     f"; tokens not derived (element type {precision or 'not stated'}, memory {gib} GiB)"))


@pytest.mark.check("capacity.warmup")
def test_warmup(run, engine):
    with run.check("capacity.warmup", "slo-miss") as c:
        sweep = run.get("throughput.sweep")
        w = (sweep.values.get("warmup") if sweep else None) or {}
        pts = (sweep.values.get("points") if sweep else None) or []
        if not w or w.get("first_request_ttft_ms") is None or not pts:
            c.skip("no warm-up measured: the throughput.sweep check did not run or got no token; the engine "
                   "already served other checks, so a first request measured now would not be the first after start")
        first = w["first_request_ttft_ms"]
        steady = pts[0].get("ttft_p50_ms")
        c.values.update({"first_request_ttft_ms": round(first, 3), "warmup_requests": w.get("requests"),
                         "warmup_ttft_p50_ms": w.get("ttft_p50_ms"), "warmup_e2e_p50_ms": w.get("e2e_p50_ms"),
                         "steady_ttft_p50_ms": steady, "steady_sessions": pts[0].get("sessions"),
                         "steady_tpot_p50_ms": pts[0].get("tpot_p50_ms"),
                         "first_over_steady": round(first / steady, 2) if steady else None,
                         "source": "throughput.sweep warm-up and first point",
                         "note": "sanity probes run before the sweep: this is the first sweep-shaped request "
                                 "after start, not necessarily the engine's very first"})
        c.evidence("warmup.json", {"warmup": w, "steady_point": pts[0]})
        ratio = c.values["first_over_steady"]
        c.report_only((f"first request TTFT {first:.1f} ms vs steady {steady:.1f} ms ({ratio}x)" if steady
                       else f"first request TTFT {first:.1f} ms") + "; report only (no objective set)")
