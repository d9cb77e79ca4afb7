"""Transport distortion: telling a buffering hop from the engine by the shape of the stream.

A proxy or load balancer that buffers (nginx with ``proxy_buffering on``, a compressing hop,
anything holding bytes until a size or a quiet time) leaves a signature the field knows:
TTFT goes up while ITL falls, because a hop can delay tokens but cannot make decoding faster.
On the wire that is:

- **the first token held back**: a direct stream sends the first token as soon as the
  prefill ends, alone. Engines that coalesce steps do it after the first token (vLLM's
  ``stream_interval``; bakeoff's ORT GenAI worker rings its doorbell for a stream's first
  token and batches later ones into frames every ``stream_interval_ms``: an engine-side
  effect, not a transport one). Through a buffering hop the first event arrives together with
  the events that filled the buffer;
- **bursts**: events arrive in clusters (gaps under :data:`CLUSTER_GAP_MS` inside a cluster)
  separated by a long period, so ITL inside the clusters is ~0.

Rule (:func:`judge`): over the requests with at least :data:`MIN_EVENTS` content events, the
stream is distorted when events arrive in bursts (the median cluster holds at least
:data:`HELD_FIRST_EVENTS` events and the median cluster period, a stream that arrived whole
counting as unbounded, is at least :data:`BURST_PERIOD_MS`) **and** TTFT was inflated in
transit: the median first cluster holds at least :data:`HELD_FIRST_EVENTS` events, or, where
the engine reports its own per-request timing (vLLM's ``/metrics`` histograms ``vllm:time_to_first_token_seconds`` and
``vllm:inter_token_latency_seconds``), the client's mean TTFT exceeds the engine's by more than
max(20 ms, the engine's own). Medians over requests, so one late read cannot flip it. Response
headers that name a hop (``Via``, ``X-Accel-Buffering``, ``Content-Encoding``, a
``Content-Length`` on an event stream) are quoted as evidence, never decisive alone.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from bakeoff.api.specs import RequestRecord

CLUSTER_GAP_MS = 1.0
MIN_EVENTS = 8
HELD_FIRST_EVENTS = 4
BURST_PERIOD_MS = 20.0
ENGINE_TTFT = "vllm:time_to_first_token_seconds"
ENGINE_ITL = ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds")


def stream_shape(times_ns: list[int]) -> dict[str, Any]:
    """Arrival clusters of one request's content events.

    Returns:
        ``events``, ``clusters``, ``first_cluster_events``, ``events_per_cluster`` (mean),
        ``cluster_period_ms`` (median time between cluster starts; None with one cluster),
        ``event_gap_p50_ms``.
    """
    if not times_ns:
        return {"events": 0, "clusters": 0}
    gap_ns = CLUSTER_GAP_MS * 1e6
    sizes, starts = [1], [times_ns[0]]
    for a, b in zip(times_ns, times_ns[1:]):
        if b - a < gap_ns:
            sizes[-1] += 1
        else:
            sizes.append(1)
            starts.append(b)
    gaps = [(b - a) / 1e6 for a, b in zip(times_ns, times_ns[1:])]
    periods = [(b - a) / 1e6 for a, b in zip(starts, starts[1:])]
    return {"events": len(times_ns), "clusters": len(sizes), "first_cluster_events": sizes[0],
            "events_per_cluster": len(times_ns) / len(sizes),
            "cluster_period_ms": statistics.median(periods) if periods else None,
            "event_gap_p50_ms": statistics.median(gaps) if gaps else None}


def hop_headers(records: list[RequestRecord]) -> dict[str, str]:
    """Response headers that name a hop or buffering, with the first value seen."""
    out: dict[str, str] = {}
    for r in records:
        for k, v in (r.response_headers or {}).items():
            if k in ("via", "x-accel-buffering", "content-encoding", "content-length", "x-cache", "cf-ray"):
                out.setdefault(k, v)
    return out


def engine_timing(before: dict[str, float], after: dict[str, float]) -> dict[str, float] | None:
    """The engine's own mean TTFT and ITL (ms) over a window, from ``/metrics`` histogram sums
    and counts read before and after it; None when the engine does not report them."""
    def mean(name: str) -> float | None:
        n = after.get(f"{name}_count", 0.0) - before.get(f"{name}_count", 0.0)
        s = after.get(f"{name}_sum", 0.0) - before.get(f"{name}_sum", 0.0)
        return s / n * 1e3 if n > 0 else None

    ttft = mean(ENGINE_TTFT)
    itl = next((v for v in (mean(n) for n in ENGINE_ITL) if v is not None), None)
    if ttft is None:
        return None
    return {"engine_ttft_mean_ms": ttft, "engine_itl_mean_ms": itl}


def judge(records: list[RequestRecord], engine: dict[str, float] | None = None) -> dict[str, Any]:
    """Whether the streams of ``records`` show a buffering hop (module docstring's rule).

    Args:
        records: requests of a sweep (ok ones are used).
        engine: :func:`engine_timing` over the same window, when the engine reports it.

    Returns:
        ``distorted`` (True / False / None when too few events to tell), ``reasons`` (the
        evidence in words) and the medians and headers behind them.
    """
    shapes = [stream_shape(r.event_times_ns) for r in records if r.status == "ok" and len(r.event_times_ns) >= MIN_EVENTS]
    out: dict[str, Any] = {"requests": len(shapes), "headers": hop_headers(records), "rule": {
        "cluster_gap_ms": CLUSTER_GAP_MS, "min_events": MIN_EVENTS, "held_first_events": HELD_FIRST_EVENTS,
        "burst_period_ms": BURST_PERIOD_MS}}
    if engine:
        out.update(engine)
    if not shapes:
        out.update(distorted=None, reasons=[f"no request streamed {MIN_EVENTS} or more content events"])
        return out
    first, per, period = _medians(shapes, records, out)
    held = first >= HELD_FIRST_EVENTS
    # period None: most streams arrived as one cluster each, the whole stream one burst
    bursts = per >= HELD_FIRST_EVENTS and (period is None or period >= BURST_PERIOD_MS)
    reasons = []
    if held:
        reasons.append(f"the first token arrived together with {first - 1:g} more events (median): it was held back, while a "
                       "direct stream sends it alone as soon as the prefill ends")
    if bursts and period is None:
        reasons.append(f"each stream arrived as one burst of {per:.1f} events (median), with gaps under "
                       f"{CLUSTER_GAP_MS:g} ms: ITL ~0 that no engine decodes at")
    elif bursts:
        reasons.append(f"events arrive in bursts of {per:.1f} every {period:.0f} ms (median), with gaps under "
                       f"{CLUSTER_GAP_MS:g} ms inside a burst: ITL ~0 that no engine decodes at")
    inflated = _ttft_inflated(out, engine, reasons)
    if out["headers"]:
        reasons.append("response headers: " + ", ".join(f"{k}: {v}" for k, v in out["headers"].items()))
    out.update(distorted=bursts and (held or inflated), reasons=reasons)
    return out


def _medians(shapes: list[dict[str, Any]], records: list[RequestRecord], out: dict[str, Any]) -> tuple:
    """``(first cluster's events, events per cluster, cluster period ms or None)``, medians over the
    streams' shapes, recorded in ``out`` with the client's TTFT mean and event gap median."""
    first = statistics.median(s["first_cluster_events"] for s in shapes)
    per = statistics.median(s["events_per_cluster"] for s in shapes)
    # a stream that arrived whole has no period: it counts as unbounded, so every stream has a say
    # (over multi-cluster streams only, a few paced ones outvoted a sweep of whole-stream bursts)
    period = statistics.median(math.inf if s["cluster_period_ms"] is None else s["cluster_period_ms"] for s in shapes)
    period = None if math.isinf(period) else period
    ttfts = [(r.first_token_ns - r.sent_ns) / 1e6 for r in records if r.status == "ok" and r.first_token_ns]
    gaps = [s["event_gap_p50_ms"] for s in shapes if s["event_gap_p50_ms"] is not None]
    out.update(first_cluster_events_p50=first, events_per_cluster_p50=round(per, 2),
               cluster_period_p50_ms=round(period, 3) if period is not None else None,
               client_ttft_mean_ms=round(statistics.fmean(ttfts), 3) if ttfts else None,
               client_event_gap_p50_ms=round(statistics.median(gaps), 3) if gaps else None)
    return first, per, period


def _ttft_inflated(out: dict[str, Any], engine: dict[str, float] | None, reasons: list[str]) -> bool:
    """Whether the client's TTFT mean exceeds the engine's own (``/metrics``) by more than 20 ms and
    more than the engine's TTFT itself; the difference in ``out``, the evidence in ``reasons``."""
    if not engine or out.get("client_ttft_mean_ms") is None:
        return False
    extra = out["client_ttft_mean_ms"] - engine["engine_ttft_mean_ms"]
    out["ttft_added_in_transit_ms"] = round(extra, 3)
    inflated = extra > max(20.0, engine["engine_ttft_mean_ms"])
    if inflated:
        reasons.append(f"client TTFT mean {out['client_ttft_mean_ms']:.1f} ms vs the engine's own "
                       f"{engine['engine_ttft_mean_ms']:.1f} ms (/metrics)")
    return inflated
