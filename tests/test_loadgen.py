"""The load generator against the synthetic SSE server (loopback only, bounded loops)."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from bakeoff.loadgen.calibrate import _backend, calibrate, compare_to_server
from bakeoff.loadgen.multiproc import closed_loop_mp
from bakeoff.loadgen.stats import per_request, summarize
from bakeoff.loadgen.sweep import UNFINISHED, closed_loop, open_loop, poisson_arrivals_ns, run_request
from bakeoff.loadgen.synth_launch import SynthServer
from bakeoff.api.specs import GenerationRequest, TokenEvent, Usage

APIS = ["completions", "chat", "messages"]
N = 8  # tokens per response


@pytest.fixture(scope="module")
def server():
    with SynthServer({"ttft": {"ms": 5}, "itl": {"ms": 2}, "output_tokens": N}) as srv:
        yield srv


def req(i: int = 0, turn: int = 0, tag: str = "r") -> GenerationRequest:
    """The synthetic server sends its configured ``output_tokens`` whatever ``max_tokens`` asks; 64
    leaves room for the 16-token cases and a usage over them (above max_tokens it is impossible:
    ``accounting.impossible_count``)."""
    return GenerationRequest(request_id=f"{tag}-{i}-{turn}", prompt=f"prompt {i} {turn}", max_tokens=64)


def one(backend, r: GenerationRequest, **kw):
    async def main():
        try:
            return await run_request(backend, r, **kw)
        finally:
            await backend.aclose()
    return asyncio.run(main())


def words(text: str) -> int:
    return len(text.split())


@pytest.mark.parametrize("api", APIS)
def test_clean_stream_matches_server(server, api):
    b = _backend(server.url, {})
    b.client.api = api
    rec = one(b, req(tag=f"clean-{api}"))
    assert rec.status == "ok", rec.error
    assert rec.output_tokens == N and rec.output_tokens_source == "server-usage (agrees with client-events)"
    assert len(rec.token_times_ns) == N and not rec.accounting_mismatch and rec.accounting == "agree"
    assert rec.output_text.startswith(f"[clean-{api}-0-0]")
    cmp = compare_to_server([rec], server.records(expect=1))
    assert cmp["matched_requests"] == 1 and cmp["token_count_mismatches"] == 0
    assert abs(cmp["ttft_error_p50_ms"]) < 50


FAULTS = {
    "cut_tokens": ({"cut_after_tokens": 3}, "transport-distortion", 3),
    "cut_seconds": ({"cut_after_s": 0.012}, "transport-distortion", None),
    "malformed": ({"malformed_at_token": 2}, "transport-distortion", N - 1),
    "missing_done": ({"missing_done": True}, "transport-distortion", N),
    "http_500": ({"error_rate": 1.0}, "runtime-crash", 0),
    "http_429": ({"error_rate": 1.0, "error_status": 429}, "config-rejected", 0),
}


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_fault_is_recorded_with_what_came_before(server, api, fault):
    synth, cls, tokens = FAULTS[fault]
    b = _backend(server.url, {"synth": synth})
    b.client.api = api
    rec = one(b, req(tag=f"{fault}-{api}"), count_tokens=words)
    assert rec.status == "error" and rec.error_class == cls, rec.error
    if tokens is not None:
        assert len(rec.token_times_ns) == tokens
    if tokens:
        assert rec.first_token_ns is not None and rec.first_token_ns > rec.sent_ns
    if fault.startswith("cut"):
        assert "bytes" in rec.error and " s" in rec.error
        assert rec.token_times_ns, "tokens before the cut are kept"
    row = per_request(rec)
    assert row["error_class"] == cls


@pytest.mark.parametrize("api", APIS)
def test_slow_first_byte_and_keepalive_do_not_count_as_tokens(server, api):
    b = _backend(server.url, {"synth": {"slow_first_byte_ms": 15, "keepalive_ms": 2, "ttft": {"ms": 10}}})
    b.client.api = api
    rec = one(b, req(tag=f"ka-{api}"))
    assert rec.status == "ok" and len(rec.token_times_ns) == N
    assert (rec.first_token_ns - rec.sent_ns) / 1e6 >= 24
    sent = server.records(expect=1)[f"ka-{api}-0-0"]
    assert any(kind == "ka" for *_, kind in sent["events"])


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("ids", ["always", "never"])
def test_multi_token_chunks_give_exact_counts_and_per_token_itl(server, api, ids):
    b = _backend(server.url, {"synth": {"tokens_per_chunk": 4, "output_tokens": 16, "token_ids": ids}})
    b.client.api = api
    rec = one(b, req(tag=f"chunk4-{api}-{ids}"))
    assert rec.status == "ok" and rec.output_tokens == 16 and not rec.accounting_mismatch
    assert len(rec.token_times_ns) == 16
    itl = per_request(rec)["itl_ms"]
    assert len(itl) == 15
    # a 4-token chunk gives 3 zero gaps (more when a late server's chunks share one read)
    assert sum(1 for x in itl if x == 0) >= 12
    assert all(rec.token_times_ns.count(t) % 4 == 0 for t in set(rec.token_times_ns))
    cmp = compare_to_server([rec], server.records(expect=1))
    assert cmp["matched_requests"] == 1 and cmp["token_count_mismatches"] == 0
    # with re-tokenization instead of ids the per-chunk count is exact too
    b2 = _backend(server.url, {"synth": {"tokens_per_chunk": 4, "output_tokens": 16, "usage": "never"}})
    b2.client.api = api if api != "messages" else "chat"
    rec2 = one(b2, req(tag=f"chunk4b-{api}-{ids}"), count_tokens=words)
    assert rec2.output_tokens == 16 and rec2.output_tokens_source == "client-tokenizer"
    assert len(rec2.token_times_ns) == 16


def test_accounting_mismatch_is_flagged(server):
    b = _backend(server.url, {"synth": {"usage_delta": 2}, "return_token_ids": True})
    b.client.extra_body["synth"]["token_ids"] = "always"
    rec = one(b, req(tag="acct"))
    # the figures use the ids the client received, not the server's claim
    assert rec.output_tokens == N and rec.client_output_tokens == N and rec.usage_output_tokens == N + 2
    assert rec.accounting_mismatch and rec.output_tokens_source == "token-ids"
    s = summarize([rec], 1.0, 1)
    assert s["accounting_mismatches"] == 1 and s["accounting_failure_class"] == "client-accounting"


@pytest.mark.parametrize("api", ["chat", "messages"])
def test_reasoning_counted_apart(server, api):
    b = _backend(server.url, {"synth": {"reasoning_tokens": 3}})
    b.client.api = api
    rec = one(b, req(tag=f"think-{api}"), count_tokens=words)
    assert rec.status == "ok" and rec.reasoning_tokens == 3 and rec.output_tokens == N
    assert "[think" not in rec.output_text and rec.output_text.split() == [f"t{j}" for j in range(3, N)]


def test_run_request_chunk_without_server():
    class Fake:
        async def stream(self, r):
            yield TokenEvent(t_ns=1_000_000, text="a b c d", token_ids=[1, 2, 3, 4])
            yield TokenEvent(t_ns=3_000_000, text="e f", token_ids=[5, 6])
            yield TokenEvent(t_ns=3_000_000, usage=Usage(3, 6))

    rec = asyncio.run(run_request(Fake(), req()))
    assert rec.output_tokens == 6 and rec.output_token_ids == [1, 2, 3, 4, 5, 6]
    assert per_request(rec)["itl_ms"] == [0, 0, 0, 2.0, 0]


def test_max_error_rate_stops_cleanly_and_keeps_records(server):
    b = _backend(server.url, {"synth": {"error_rate": 1.0}})

    async def main():
        try:
            return await closed_loop(b, lambda i, t: req(i, t, "maxerr"), 2, 10, max_error_rate=0.5)
        finally:
            await b.aclose()
    recs, _ = asyncio.run(main())
    assert 2 <= len(recs) < 20
    assert all(r.status == "error" and r.error_class == "runtime-crash" for r in recs)


def test_poisson_arrivals_and_open_loop(server):
    gaps = np.diff(poisson_arrivals_ns(100.0, n=4000, seed=1)) / 1e9
    assert abs(gaps.mean() - 0.01) < 0.001 and abs(gaps.std() / gaps.mean() - 1) < 0.1
    b = _backend(server.url, {})

    async def main():
        try:
            return await open_loop(b, lambda i, t: req(i, t, "open"), rate_per_s=200, n=20, seed=3)
        finally:
            await b.aclose()
    recs, wall = asyncio.run(main())
    assert len(recs) == 20 and all(r.status == "ok" for r in recs)
    sched = sorted(r.scheduled_ns for r in recs)
    assert len(set(sched)) == 20
    waits = [per_request(r)["queue_wait_ms"] for r in recs]
    assert np.median(waits) < 20
    assert all(per_request(r)["ttft_from_schedule_ms"] >= per_request(r)["ttft_ms"] - 0.01 for r in recs)


def test_multiprocess_merges_records(server):
    recs, wall, errors = closed_loop_mp(lambda: _backend(server.url, {}), lambda i, t: req(i, t, "mp"), 4, 2,
                                        processes=2)
    assert not errors and len(recs) == 8 and wall > 0
    assert sorted({r.session for r in recs}) == [0, 1, 2, 3]
    assert all(r.status == "ok" and r.output_tokens == N for r in recs)


def test_calibration_reports_its_error():
    res = calibrate(4, ttft_ms=20, itl_ms=5, output_tokens=16, requests_per_session=2)
    assert res["matched_requests"] == 4 and res["errors"] == 0
    for k in ("ttft_error_p50_ms", "ttft_error_p99_ms", "itl_abs_error_p50_ms", "itl_abs_error_p99_ms"):
        assert res[k] is not None and res[k] < 100
    assert res["max_output_tokens_per_s"] > res["output_tokens_per_s"] > 0
    assert isinstance(res["within_budget"], bool) and "ttft_p50_ms" in res["budget"]
    assert res["server_slip"]["slip_p50_ms"] is not None


def test_pool_loop_keeps_concurrency_until_the_queue_drains(server):
    from bakeoff.loadgen.sweep import pool_loop

    b = _backend(server.url, {})
    reqs = [req(i, 0, "pool") for i in range(7)]

    async def main():
        try:
            return await pool_loop(b, reqs, 3)
        finally:
            await b.aclose()
    recs, wall = asyncio.run(main())
    assert [r.request_id for r in recs] == [r.request_id for r in reqs] and all(r.status == "ok" for r in recs)
    # never more than 3 in flight; a new request starts as soon as a slot frees
    events = sorted([(r.sent_ns, 1) for r in recs] + [(r.end_ns, -1) for r in recs])
    in_flight = peak = 0
    for _, d in events:
        in_flight += d
        peak = max(peak, in_flight)
    assert peak <= 3 and wall > 0


def test_a_transport_closed_under_the_write_is_a_transport_error():
    """A server dying between the pool's check and the write gives asyncio's RuntimeError
    ("unable to perform operation on <TCPTransport closed=True>"): it must be a TransportError
    (retried once on a pooled connection), so the backend names the engine's death."""
    import asyncio

    from bakeoff.loadgen.http import Pool, TransportError, _Conn

    class Closed:
        def write(self, data):
            raise RuntimeError("unable to perform operation on <TCPTransport closed=True>; the handler is closed")

        def is_closing(self):
            return False

        def close(self):
            pass

    async def main():
        pool = Pool()
        loop = asyncio.get_running_loop()
        calls = []

        async def fake_get(scheme, host, port, fresh=False):
            conn = _Conn(loop)
            conn.transport = Closed()
            calls.append(1)
            return conn, len(calls) == 1  # pooled first, fresh on the retry
        pool._get = fake_get
        try:
            await pool.request("POST", "http://127.0.0.1:9/v1/completions", {}, b"{}")
        except TransportError as exc:
            return exc.kind, len(calls)
    assert asyncio.run(main()) == ("connect", 2)


def test_a_retry_after_a_stale_pooled_connection_takes_a_new_one():
    """A server that closes its idle keep-alive connections (cpp-httplib's idle timeout: llama-server)
    closes every connection idle as long at once; a request that finds one closed under it is
    retried on a new connection, never on another idle one (seen: 1 of 300 probes failed the run)."""
    from bakeoff.loadgen.http import Pool

    async def main():
        served = []

        async def handle(reader, writer):
            first = True
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                n = int(next(ln.split(b":")[1] for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length")))
                await reader.readexactly(n)
                if not first:  # an idle connection's next request: closed unanswered, as at the idle timeout
                    writer.close()
                    return
                first = False
                served.append(1)
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                await writer.drain()
        srv = await asyncio.start_server(handle, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}/v1/completions"
        pool = Pool()
        try:
            async def one():
                resp = await pool.request("POST", url, {}, b"{}")
                try:
                    return await resp.read_all(5.0)
                finally:
                    resp.release()
            first = await asyncio.gather(*(one() for _ in range(3)))  # three pooled connections
            assert sum(len(v) for v in pool._idle.values()) == 3
            again = await one()  # a stale pooled one, then a new one
            return first, again, len(served)
        finally:
            await pool.aclose()
            srv.close()
    first, again, served = asyncio.run(main())
    assert served == 4 and again == first[0], (first, again, served)


def test_a_prompt_count_no_prompt_can_hold_is_never_a_figure():
    """usage.prompt_tokens of 10**18 for a 10-byte prompt (issue 36's census: printed as the needles'
    lengths): more than the prompt's bytes plus special tokens is impossible, dropped like a negative one."""
    from bakeoff.loadgen.accounting import PROMPT_SPECIAL_TOKENS, account
    from bakeoff.api.specs import RequestRecord

    for claimed, kept in ((10**18, None), (10 + PROMPT_SPECIAL_TOKENS + 1, None), (3, 3)):
        rec = RequestRecord(request_id="r", session=0)
        account(rec, [], claimed, 0, None, prompt="prompt 0 0", max_tokens=4)
        assert rec.input_tokens == kept, (claimed, rec.input_tokens)


def test_request_ids_travel_as_a_uuid_a_strict_server_accepts_and_an_empty_4xx_names_the_headers():
    """llama-cpp-python's request-id middleware answers HTTP 400 with an empty body to an
    ``X-Request-Id`` that is not a UUID (issue 37): bakeoff sends a UUID there (the id itself in
    ``X-Bakeoff-Request-Id``); a 4xx with an empty body still says what was sent."""
    import uuid

    from bakeoff.api.errors import EngineFailure
    from bakeoff.loadgen.client import OpenAIClient, wire_request_id

    seen = []

    async def main(strict: bool):
        async def handle(reader, writer):
            head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
            hdrs = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in head.split("\r\n")[1:] if ln)}
            await reader.readexactly(int(hdrs["content-length"]))
            seen.append(hdrs)
            try:
                uuid.UUID(hdrs.get("x-request-id", ""))
                ok = strict
            except ValueError:
                ok = False
            if not ok:
                writer.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
            else:
                body = b"".join(b"data: " + json.dumps({"choices": [{"index": 0, "text": t}]}).encode() + b"\n\n"
                                for t in (" a", " b")) + b"data: [DONE]\n\n"
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n" + body)
            await writer.drain()
            writer.close()
        srv = await asyncio.start_server(handle, "127.0.0.1", 0)
        client = OpenAIClient(f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}", "m")
        try:
            return [ev.text async for ev in client.stream(GenerationRequest(request_id="f1-s0-t0", prompt="p",
                                                                             max_tokens=2))]
        except EngineFailure as exc:
            return exc
        finally:
            await client.aclose()
            srv.close()
    assert "".join(asyncio.run(main(strict=True))) == " a b"
    assert seen[-1]["x-request-id"] == wire_request_id("f1-s0-t0") == str(uuid.uuid5(uuid.UUID(
        "6f1c1a52-3b0e-5d2e-9a57-6b616b656f66"), "f1-s0-t0")) and seen[-1]["x-bakeoff-request-id"] == "f1-s0-t0"
    failure = asyncio.run(main(strict=False))  # refuses every request: an empty 400
    assert isinstance(failure, EngineFailure) and failure.failure_class == "config-rejected"
    assert "HTTP 400 from /v1/completions: an empty body (request headers sent: " in failure.message
    assert "X-Request-Id" in failure.message and wire_request_id("f1-s0-t0") not in failure.message  # names, not values


@pytest.mark.parametrize("finish, cls", [("stop", "ineffective-option"), (None, "transport-distortion")])
def test_a_short_stream_with_eos_ignored_is_a_failed_request_not_a_figure(finish, cls):
    """Doubles of issue 37's servers: one that ignores ``ignore_eos`` (ends at EOS, finish ``stop``),
    one that cuts a stream after a token (``interrupt_requests``): 1 of 8 tokens with usage agreeing
    is a failed request with its class; a full stream is not."""
    def stream(n_tokens: int):
        evs = [{"choices": [{"index": 0, "text": f" t{i}", "finish_reason": None}]} for i in range(n_tokens)]
        evs += [{"choices": [{"index": 0, "text": "", "finish_reason": finish}]},
                {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": n_tokens}}]
        return _one_stream(evs, GenerationRequest(request_id="s", prompt="p", max_tokens=8, ignore_eos=True))
    short, full = stream(1), stream(8)
    assert short.status == "error" and short.error_class == cls and "after 1 of max_tokens 8" in short.error, short
    if finish:
        assert full.status == "ok" and full.output_tokens == 8, (full.status, full.error)
    else:  # all 8 tokens, but no finish_reason: the server never finished it (bakeoff/loadgen/sweep.py unfinished_stream)
        assert full.status == "error" and full.error.startswith(UNFINISHED + " after 8 tokens"), full.error


def test_a_stream_ended_without_a_finish_reason_is_a_failed_request():
    """llama-cpp-python's interrupt_requests: ``[DONE]`` after a token, no finish_reason, no usage (so no
    exact count): a failed request, ``transport-distortion``, saying so; with a finish_reason it is an answer."""
    def stream(finish):
        evs = [{"choices": [{"index": 0, "text": " t", "finish_reason": None}]}]
        evs += [{"choices": [{"index": 0, "text": "", "finish_reason": finish}]}] if finish else []
        return _one_stream(evs, GenerationRequest(request_id="u", prompt="p", max_tokens=8))
    cut, answered = stream(None), stream("stop")
    assert cut.status == "error" and cut.error_class == "transport-distortion", cut
    assert cut.error.startswith(UNFINISHED + " after 1 tokens") and "interrupt_requests" in cut.error
    assert answered.status == "ok" and answered.output_text == " t"


def test_a_request_the_server_took_then_dropped_is_not_sent_again():
    """The stale-connection retry is for a close that crosses the request (no byte, at once): a
    server that takes a request on a kept-alive connection, works on it and closes unanswered has
    received it; sending it again would run it twice and hide the drop (found by a breaker)."""
    from bakeoff.loadgen.http import Pool, TransportError

    async def main():
        got = []

        async def handle(reader, writer):
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                n = int(next(ln.split(b":")[1] for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length")))
                await reader.readexactly(n)
                got.append(1)
                if len(got) == 2:  # the second request, on the kept-alive connection: taken, then dropped
                    await asyncio.sleep(0.6)
                    writer.close()
                    return
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                await writer.drain()
        srv = await asyncio.start_server(handle, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}/v1/completions"
        pool = Pool()
        try:
            resp = await pool.request("POST", url, {}, b"{}")
            await resp.read_all(5.0)
            resp.release()
            try:
                await pool.request("POST", url, {}, b"{}")
                return "ok", len(got)
            except TransportError as exc:
                return exc.kind, len(got)
        finally:
            await pool.aclose()
            srv.close()
    assert asyncio.run(main()) == ("cut", 2)


@pytest.mark.parametrize("trailer, idle_close", [(b"", False), (b"X-Checksum: 1\r\n", False), (b"", True)])
def test_a_chunked_bodys_final_crlf_is_read_before_its_connection_is_kept(trailer, idle_close):
    """cpp-httplib (llama-server) writes the last chunk and the final CRLF apart, and closes a connection
    idle for its keep-alive timeout: the CRLF, left on the kept connection, was read as the next response's
    first bytes before the close ("closed before the response headers (2 bytes)": a real run's probes
    failed as transport-distortion). The stray CRLF is skipped, so the close counts as one with no byte
    and the request goes again on a new connection; nothing waits for the CRLF (a body is complete at
    its last chunk); a body with trailers does not keep its connection."""
    from bakeoff.loadgen.http import Pool

    async def main():
        conns = []

        async def handle(reader, writer):
            conns.append(1)
            answered = 0
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError:
                    return
                n = int(next(ln.split(b":")[1] for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length")))
                await reader.readexactly(n)
                if idle_close and answered:  # its keep-alive timeout crossing the next request: closed unanswered
                    writer.close()
                    return
                writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n")
                await writer.drain()
                await asyncio.sleep(0.05)  # the rest of the body, apart
                writer.write(trailer + b"\r\n")
                await writer.drain()
                answered += 1
        srv = await asyncio.start_server(handle, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}/v1/completions"
        pool = Pool()
        bodies = []
        try:
            for _ in range(3):
                resp = await pool.request("POST", url, {}, b"{}")
                bodies.append(await resp.read_all(5.0))
                resp.release()
                await asyncio.sleep(0.3)
            return bodies, len(conns)
        finally:
            await pool.aclose()
            srv.close()
    assert asyncio.run(main()) == ([b"hello"] * 3, 3 if idle_close or trailer else 1)


@pytest.mark.parametrize("size", [b"-3", b"+5", b"0x5", b"1_0", b"-1"])
def test_a_chunk_size_that_is_not_hex_digits_is_malformed(size):
    """int(x, 16) takes signs, a 0x prefix and underscores; a chunk size does not (found by a breaker:
    "-3" cut a body silently)."""
    from bakeoff.loadgen.http import Response, TransportError

    resp = Response.__new__(Response)
    resp._mode, resp._pend, resp._chunk_left, resp.nbytes, resp.complete, resp._keep = "chunked", b"", 0, 0, False, True
    with pytest.raises(TransportError, match="chunk size"):
        resp._decode(b"5\r\nhello\r\n" + size + b"\r\nworld\r\n0\r\n\r\n")


def test_more_cached_tokens_than_prompt_tokens_is_never_a_figure():
    """A server's cached-token claim above the request's prompt tokens (10**30, a breaker's double)
    is dropped, as impossible prompt counts are: it cannot prove a cache hit."""
    def stream(cached: int):
        return _one_stream([{"choices": [{"index": 0, "text": " t", "finish_reason": "length"}]},
                            {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 1,
                                                      "prompt_tokens_details": {"cached_tokens": cached}}}],
                           GenerationRequest(request_id="c", prompt="p", max_tokens=1))
    assert stream(10**30).cached_prompt_tokens is None
    assert stream(1).cached_prompt_tokens == 1


def _one_stream(events: list[dict], req: GenerationRequest):
    """``req`` through the client against a FAKE server that answers any request with ``events``
    as one SSE stream, then ``[DONE]``; the record."""
    from bakeoff.loadgen.client import OpenAIClient

    async def main():
        async def handle(reader, writer):
            head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
            length = next(int(ln.split(":")[1]) for ln in head.split("\r\n") if ln.lower().startswith("content-length"))
            await reader.readexactly(length)
            body = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n" + body)
            await writer.drain()
            writer.close()
        srv = await asyncio.start_server(handle, "127.0.0.1", 0)
        client = OpenAIClient(f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}", "m")
        try:
            return await run_request(client, req, count_tokens=lambda t: len(t.split()))
        finally:
            await client.aclose()
            srv.close()
    return asyncio.run(main())


def test_a_shared_calibration_is_reused_only_when_it_certified_the_same_sessions(tmp_path, monkeypatch):
    """evaluations/test_calibration.py: a run of a qualify command reuses the command's calibration only
    for the same sessions and budget, and only one that certified every session; a damaged file is
    measured again, never trusted."""
    from evaluations import test_calibration as cal

    shared = tmp_path / "calibration.json"
    monkeypatch.setenv(cal.SHARED_ENV, str(shared))
    certified = {"calibrated_concurrency": 8, "points": [{"concurrency": 8, "within_budget": True, "violations": []}]}
    assert cal._shared([1, 8]) is None  # nothing measured yet
    cal._share([1, 8], {"calibrated_concurrency": 1, "points": []}, "run-a")
    assert not shared.exists()  # a miss at 8 is not kept: the next run measures again
    cal._share([1, 8], certified, "run-a")
    saved = cal._shared([1, 8])
    assert saved["result"] == certified and saved["measured_in_run"] == "run-a"
    assert cal._shared([1, 4]) is None and cal._shared([1, 8, 16]) is None  # other sessions: measured again
    shared.write_text("{not json")
    assert cal._shared([1, 8]) is None
    monkeypatch.delenv(cal.SHARED_ENV)
    cal._share([1, 8], certified, "run-b")  # outside a qualify command: nothing shared
    assert cal._shared([1, 8]) is None


def test_a_hostile_shared_calibration_is_measured_again_never_read_unbounded(tmp_path, monkeypatch):
    """A breaker's files at BAKEOFF_CALIBRATION_FILE: a device, a FIFO, a huge file, wrong types, a folder
    to write to; none crashes, blocks or is trusted (evaluations/test_calibration.py)."""
    import os

    from evaluations import test_calibration as cal

    good = {"calibrated_concurrency": 8, "points": [{"concurrency": 8, "within_budget": True, "violations": []}]}
    cases = {"zero": "/dev/zero", "fifo": str(tmp_path / "fifo"), "huge": str(tmp_path / "huge"), "folder": str(tmp_path)}
    os.mkfifo(cases["fifo"])
    with open(cases["huge"], "wb") as fh:
        fh.truncate(cal.MAX_SHARED_BYTES + 1)
    for path in cases.values():
        monkeypatch.setenv(cal.SHARED_ENV, path)
        assert cal._shared([1, 8]) is None
    cal._share([1, 8], good, "run-a")  # a folder cannot be written: no loss, no crash
    shared = tmp_path / "calibration.json"
    monkeypatch.setenv(cal.SHARED_ENV, str(shared))
    cal._share([1, 8], good, "run-a")
    assert cal._shared([1, 8])["measured_in_run"] == "run-a"
    saved = json.loads(shared.read_text())
    for bad in ({"calibrated_concurrency": True}, {"calibrated_concurrency": 8.0}, {"points": "x"}, {"points": [{}]},
                {"points": [{"concurrency": 8, "within_budget": False, "violations": ["x"]}]}):
        shared.write_text(json.dumps({**saved, "result": {**saved["result"], **bad}}))
        assert cal._shared([1, 8]) is None, bad
    shared.write_text(json.dumps({k: v for k, v in saved.items() if k != "measured_in_run"}))
    assert cal._shared([1, 8]) is None
    shared.write_text("[" * 100000 + "]" * 100000)  # deeper than the JSON decoder recurses
    assert cal._shared([1, 8]) is None
