"""benchmarks/peers.py: matching a peer tool's requests to the synthetic server's send records,
and reading each peer's export, without installing any peer (fake exports; loopback only)."""

from __future__ import annotations

import http.client
import importlib.util
import json
import sys
import time
from pathlib import Path

import pytest

from bakeoff.loadgen.synth_launch import SynthServer

_spec = importlib.util.spec_from_file_location("bench_peers", Path(__file__).parents[1] / "benchmarks" / "peers.py")
peers = sys.modules["bench_peers"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(peers)

MS = 1_000_000


def record(rid: str, recv_ns: int, first_ns: int, n: int = 4, itl_ns: int = 10 * MS) -> dict:
    """A server record as ``SynthServer.records()`` gives it: head, n one-token events, done."""
    events = [(recv_ns, recv_ns, 0, "head")]
    events += [(first_ns + j * itl_ns, first_ns + j * itl_ns, 1, "text") for j in range(n)]
    events.append((events[-1][1], events[-1][1], 0, "done"))
    return {"request_id": rid, "recv_ns": recv_ns, "status": 200, "events": events}


SENT = {
    "uuid-a": record("uuid-a", 1_000 * MS, 1_050 * MS),
    "srv-0-7": record("srv-0-7", 1_010 * MS, 1_060 * MS),
    "vb8-3": record("vb8-3", 1_020 * MS, 1_070 * MS),
}


def test_matches_by_request_id_then_by_the_text_token():
    by_id = peers.Observation("uuid-a", None, None, 0)
    by_text = peers.Observation("not-a-server-id", "[srv-0-7] t1 t2 t3", None, 0)
    assert peers.server_id(by_id, SENT) == "uuid-a"
    assert peers.server_id(by_text, SENT) == "srv-0-7"
    assert peers.server_id(peers.Observation(None, "[unknown] t1", None, 0), SENT) is None
    assert peers.server_id(peers.Observation(None, "no token here", None, 0), SENT) is None
    assert peers.server_id(peers.Observation(None, None, None, 0), SENT) is None


def test_compare_measures_against_the_first_token_write():
    obs = [peers.Observation("uuid-a", None, 999 * MS, 1_051 * MS),           # 1 ms late
           peers.Observation(None, "[srv-0-7] t1", 1_010 * MS, 1_063 * MS),   # 3 ms late
           peers.Observation(None, "[vb8-3] t1", None, 1_072 * MS),           # 2 ms late, no start stamp
           peers.Observation(None, "[vb8-3] t1", None, 1_072 * MS),           # the same request twice
           peers.Observation(None, "[gone] t1", None, 1_080 * MS)]            # no record
    out = peers.compare(obs, SENT)
    assert out["matched_requests"] == 3 and out["unmatched_requests"] == 2
    assert out["ttft_error_p50_ms"] == pytest.approx(2.0)
    # the tool's TTFT minus the server's TTFT from receipt: (52 - 50) and (53 - 50)
    assert out["ttft_error_vs_receipt_p50_ms"] == pytest.approx(2.5)
    assert out["receive_lag_p50_ms"] == pytest.approx(0.5)  # receipt - start: 1 ms and 0 ms
    # 12 tokens from the first receipt (1000 ms) to the last write (1070 + 30 ms)
    assert out["held_output_tokens_per_s"] == pytest.approx(12 / 0.100)
    assert out["server_slip"]["slip_p50_ms"] == 0.0


def test_held_tokens_per_s_of_nothing_is_none():
    assert peers.held_tokens_per_s([]) is None
    assert peers.compare([], SENT)["held_output_tokens_per_s"] is None


def test_vllm_result_gives_monotonic_stamps():
    res = {"generated_texts": ["[vb8-3] t1", "", "[x] t1"], "ttfts": [0.052, 0.05, None],
           "start_times": [1.018, 1.0, 1.0]}
    (o,) = peers.vllm_observations(res)  # empty text and missing TTFT dropped
    assert o.text.startswith("[vb8-3]") and o.start_ns == 1_018 * MS and o.first_token_ns == 1_070 * MS


def test_aiperf_export_profiling_phase_only_moved_onto_the_monotonic_clock():
    off = 5_000_000 * MS  # wall - monotonic
    lines = [{"metadata": {"x_request_id": "warm", "benchmark_phase": "warmup", "request_start_ns": off},
              "metrics": {"time_to_first_token": {"value": 50.0, "unit": "ms"}}},
             {"metadata": {"x_request_id": "uuid-a", "benchmark_phase": "profiling", "request_start_ns": off + 999 * MS},
              "metrics": {"time_to_first_token": {"value": 52.5, "unit": "ms"}}},
             {"metadata": {"x_request_id": "bad", "benchmark_phase": "profiling", "request_start_ns": off},
              "metrics": {}, "error": {"message": "boom"}}]
    obs, errors = peers.aiperf_observations("\n".join(json.dumps(x) for x in lines), off)
    assert errors == 1 and [o.request_id for o in obs] == ["uuid-a"]
    assert obs[0].start_ns == 999 * MS and obs[0].first_token_ns == 1_051_500_000
    assert peers.compare(obs, SENT)["ttft_error_p50_ms"] == pytest.approx(1.5)


def test_guidellm_report_leaves_the_first_wave_out():
    off = 2_000 * MS

    def req(start_ms: float, first_ms: float | None, text: str) -> dict:
        return {"output": text, "info": {"timings": {"request_start": (off + start_ms * MS) / 1e9,
                                                     "first_token_iteration": None if first_ms is None
                                                     else (off + first_ms * MS) / 1e9}}}

    bench = {"requests": {"successful": [req(1_010, 1_061, "[srv-0-7] t1"), req(5, 55, "[srv-0-1] t1"),
                                         req(6, None, "[srv-0-2]"), req(7, 57, "[srv-0-3] t1")]}}
    obs = peers.guidellm_observations(bench, skip_first=2, offset_ns=off)
    assert [o.text[:9] for o in obs] == ["[srv-0-7]"]
    assert peers.compare(obs, SENT)["ttft_error_p50_ms"] == pytest.approx(1.0, abs=1e-3)


def test_env_specs_pin_the_peers():
    a, g = peers.env_spec("aiperf"), peers.env_spec("guidellm")
    assert a.requirements == (peers.AIPERF,) and "==" in peers.AIPERF
    assert peers.GUIDELLM in g.requirements and peers.TORCH in g.requirements
    assert a.path != g.path
    with pytest.raises(ValueError):
        peers.env_spec("locust")


def _post(url: str, header_id: str | None) -> str:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    headers = {"Content-Type": "application/json", **({"X-Request-ID": header_id} if header_id else {})}
    conn.request("POST", "/v1/completions", json.dumps({"model": "synth", "prompt": "p", "stream": True}), headers)
    body = conn.getresponse().read().decode()
    conn.close()
    return "".join(json.loads(line[6:])["choices"][0]["text"] for line in body.splitlines()
                   if line.startswith("data: {") and '"choices":[{' in line)


def test_a_real_server_record_matches_with_and_without_a_request_id():
    with SynthServer({"ttft": {"ms": 5}, "itl": {"ms": 1}, "output_tokens": 4}) as srv:
        text_id = _post(srv.url, "tool-id-1")
        text_anon = _post(srv.url, None)
        done_ns = time.monotonic_ns()
        sent = srv.records(expect=2)
    assert text_id.startswith("[tool-id-1]")
    assert text_anon.startswith("[srv-") and text_anon[1:text_anon.index("]")] in sent
    obs = [peers.Observation("tool-id-1", None, None, done_ns), peers.Observation(None, text_anon, None, done_ns)]
    out = peers.compare(obs, sent)
    assert out["matched_requests"] == 2 and out["unmatched_requests"] == 0 and out["ttft_error_p50_ms"] > 0
