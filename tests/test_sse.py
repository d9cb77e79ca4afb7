"""The SSE parser (:mod:`bakeoff.loadgen.sse`): each WHATWG event-stream rule, recorded streams split
at every byte offset and at random, a spec-literal oracle on random streams, and the client end
to end against a FAKE server that sends a BOM, splits CRLF across writes and uses lone CR."""

from __future__ import annotations

import asyncio
import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bakeoff.loadgen import client as client_mod
from bakeoff.loadgen.client import OpenAIClient
from bakeoff.loadgen.sse import SSEParser
from bakeoff.api.specs import GenerationRequest

BOM = b"\xef\xbb\xbf"
EOLS = {"lf": b"\n", "crlf": b"\r\n", "cr": b"\r"}


def parse(*pieces: bytes, parser: SSEParser | None = None) -> list[tuple]:
    """Events of ``pieces`` fed in order, piece i stamped ``t_ns = i``."""
    p = parser or SSEParser()
    return [ev for i, piece in enumerate(pieces) for ev in p.feed(i, piece)]


def cut(s: bytes, offsets) -> list[bytes]:
    bounds = [0, *sorted(set(offsets)), len(s)]
    return [s[a:b] for a, b in zip(bounds, bounds[1:])]


# --- one test per rule ---------------------------------------------------------------------------

def test_leading_bom_is_stripped_once_even_split_byte_by_byte():
    assert parse(BOM + b"data: a\n\n") == [(0, "a", "message", "")]
    assert [e[1] for e in parse(*[bytes([b]) for b in BOM + b"data: a\n\n"])] == ["a"]
    assert parse(BOM + BOM + b"data: a\n\ndata: b\n\n") == [(0, "b", "message", "")]  # 2nd BOM: field "\ufeffdata"
    assert parse(b"data: a\n\n", BOM + b"data: b\n\n") == [(0, "a", "message", "")]  # mid-stream BOM is data
    assert parse(b"\xef\xbb", b"data: a\n\n") == []  # a BOM prefix that is not a BOM: field name "\ufffddata"


@pytest.mark.parametrize("eol", sorted(EOLS))
def test_each_line_ending_ends_lines_and_events(eol):
    e = EOLS[eol]
    assert parse(b"event: x" + e + b"data: a" + e + b"data: b" + e + e) == [(0, "a\nb", "x", "")]


def test_mixed_line_endings_in_one_stream():
    assert [e[1] for e in parse(b"data: a\r\ndata: b\rdata: c\n\r\ndata: d\r\r\n\n")] == ["a\nb\nc", "d"]


def test_crlf_split_across_reads_is_one_line_end():
    # the LF after a CR that ended the previous read is not a second (blank) line
    assert parse(b"data: a\r", b"\ndata: b\r", b"\n\r", b"\n") == [(2, "a\nb", "message", "")]
    assert parse(b"data: a\r", b"\n", b"\r\n") == [(2, "a", "message", "")]
    assert parse(b"data: a\r", b"\r") == [(1, "a", "message", "")]


def test_lone_cr_dispatches_without_waiting_for_the_next_read():
    # the standard ends a line at CR: the event is complete in the read that holds the blank CR
    assert parse(b"data: a\r\r", b"data: b\r\r") == [(0, "a", "message", ""), (1, "b", "message", "")]


def test_event_keeps_the_stamp_of_the_read_with_its_blank_line():
    assert parse(b"da", b"ta: a\n", b"\n") == [(2, "a", "message", "")]
    assert parse(b"data: a\n\ndata: b", b"\n\n") == [(0, "a", "message", ""), (1, "b", "message", "")]


def test_multi_line_data_is_joined_by_lf_without_the_last_one():
    assert parse(b"data: a\ndata:\ndata: b\n\n")[0][1] == "a\n\nb"
    assert parse(b"data\n\n")[0][1] == ""  # one empty data line: an event with empty data


def test_only_one_leading_space_is_removed():
    assert [e[1] for e in parse(b"data:x\n\ndata:  x\n\ndata: \n\n")] == ["x", " x", ""]
    assert parse(b"event:  y\ndata: a\n\n")[0][2] == " y"


def test_line_without_colon_is_a_field_with_empty_value():
    assert parse(b"data\ndata\n\n")[0][1] == "\n"
    assert parse(b"event\ndata: a\n\n")[0][2] == "message"  # empty type: the default


def test_comments_and_unknown_fields_are_ignored():
    assert parse(b": keep-alive\n\n:\n\n") == []
    assert parse(b"data: a\n: note\nfoo: bar\nDATA: no\nData: no\ndata : no\n\n") == [(0, "a", "message", "")]


def test_event_type_defaults_to_message_and_resets_after_dispatch():
    ev = parse(b"event: content_block_delta\ndata: {}\n\ndata: {}\n\nevent: a\nevent: b\ndata: x\n\n")
    assert [e[2] for e in ev] == ["content_block_delta", "message", "b"]


def test_id_is_kept_across_events_and_ignored_with_nul():
    p = SSEParser()
    ev = parse(b"id: 1\ndata: a\n\ndata: b\n\nid: 2\x00\ndata: c\n\nid\ndata: d\n\n", parser=p)
    assert [e[3] for e in ev] == ["1", "1", "1", ""]
    assert parse(b"id: 9\n\n", parser=p) == [] and p.last_event_id == "9"  # set at the blank line
    assert parse(b"data: e\n\n", b"id: 8\n", b"data: f\n\n", b"data: g\n\n", parser=p) == [
        (0, "e", "message", "9"), (2, "f", "message", "8"), (3, "g", "message", "8")]


def test_retry_takes_ascii_digits_only():
    p = SSEParser()
    parse(b"retry: 1500\n\n", parser=p)
    assert p.retry_ms == 1500
    for bad in (b"retry: 1.5\n", b"retry: -1\n", b"retry: 12a\n", b"retry:\n",
                "retry: \u0661\u0662\n".encode(), b"retry:  7\n"):
        parse(bad + b"\n", parser=p)
        assert p.retry_ms == 1500, bad


def test_event_with_empty_data_buffer_is_not_dispatched():
    assert parse(b"event: ping\n\nid: 3\n\nretry: 5\n\n\n\n") == []


def test_incomplete_event_at_end_of_stream_is_not_dispatched():
    p = SSEParser()
    assert parse(b"data: a\n\ndata: b\n", b"data: c", parser=p) == [(0, "a", "message", "")]
    assert p.pending == b"data: b\ndata: c"


def test_invalid_utf8_is_replaced_and_split_characters_are_whole():
    s = "data: é日🙂\n\n".encode()
    for i in range(len(s) + 1):
        assert parse(s[:i], s[i:])[0][1] == "é日🙂"
    assert parse(b"data: \xff\xe6\n\n")[0][1] == "\ufffd\ufffd"


# --- recorded streams, split everywhere ----------------------------------------------------------

def _events(pairs) -> list[tuple[list[bytes], tuple[str, str] | None]]:
    """``(lines, expected (data, type) or None)`` per event from ``(event type or None, JSON or raw)``."""
    out = []
    for etype, obj in pairs:
        if etype == ":":
            out.append(([b": " + obj.encode()], None))
            continue
        data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
        lines = ([b"event: " + etype.encode()] if etype else []) + [b"data: " + data.encode()]
        out.append((lines, (data, etype or "message")))
    return out


TOKENS = [" Paris", " est", " la", " capitale", " de", " la", " Fran", "ce", " é", "日本", "🙂", "\n", " \"q\""]


def completions_stream(texts=TOKENS):
    """vLLM ``/v1/completions`` with ``stream_options.include_usage``."""
    head = {"id": "cmpl-8d3b4e0f", "object": "text_completion", "created": 1764590000, "model": "Qwen/Qwen3-0.6B"}
    pairs = [(None, {**head, "choices": [{"index": 0, "text": t, "logprobs": None,
                                          "finish_reason": "length" if i == len(texts) - 1 else None,
                                          "stop_reason": None}], "usage": None}) for i, t in enumerate(texts)]
    pairs += [(None, {**head, "choices": [], "usage": {"prompt_tokens": 5, "total_tokens": 5 + len(texts),
                                                       "completion_tokens": len(texts)}}), (None, "[DONE]")]
    return _events(pairs)


def chat_stream(reasoning=(" Think", "ing", " é"), texts=TOKENS[:6]):
    """vLLM ``/v1/chat/completions``: a role delta, ``reasoning_content`` deltas, content, usage;
    a proxy's keep-alive comment in the middle."""
    head = {"id": "chatcmpl-5f0c", "object": "chat.completion.chunk", "created": 1764590000, "model": "Qwen/Qwen3-0.6B"}

    def chunk(delta, fr=None):
        return (None, {**head, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": fr}]})
    pairs = [chunk({"role": "assistant", "content": ""})]
    pairs += [chunk({"reasoning_content": r}) for r in reasoning] + [(":", "OPENROUTER PROCESSING")]
    pairs += [chunk({"content": t}, "stop" if i == len(texts) - 1 else None) for i, t in enumerate(texts)]
    n = len(reasoning) + len(texts)
    pairs += [(None, {**head, "choices": [], "usage": {"prompt_tokens": 9, "total_tokens": 9 + n, "completion_tokens": n}}),
              (None, "[DONE]")]
    return _events(pairs)


def messages_stream(thinking=("Let me", " see"), texts=TOKENS[:5]):
    """Anthropic ``/v1/messages``: ``event:`` lines, a ping, a thinking block then a text block."""
    def delta(i, d):
        return ("content_block_delta", {"type": "content_block_delta", "index": i, "delta": d})
    pairs = [("message_start", {"type": "message_start", "message": {
        "id": "msg_01XFDUDYJgAACzvnptvVoYEL", "type": "message", "role": "assistant", "content": [],
        "model": "claude-sonnet-4-5", "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": 25, "output_tokens": 1}}}),
        ("content_block_start", {"type": "content_block_start", "index": 0,
                                 "content_block": {"type": "thinking", "thinking": ""}}),
        ("ping", {"type": "ping"})]
    pairs += [delta(0, {"type": "thinking_delta", "thinking": t}) for t in thinking]
    pairs += [delta(0, {"type": "signature_delta", "signature": "EqQBCgIYAhIM1gbcDa9GJwZA2b3h"}),
              ("content_block_stop", {"type": "content_block_stop", "index": 0}),
              ("content_block_start", {"type": "content_block_start", "index": 1,
                                       "content_block": {"type": "text", "text": ""}})]
    pairs += [delta(1, {"type": "text_delta", "text": t}) for t in texts]
    pairs += [("content_block_stop", {"type": "content_block_stop", "index": 1}),
              ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                                 "usage": {"output_tokens": len(thinking) + len(texts)}}),
              ("message_stop", {"type": "message_stop"})]
    return _events(pairs)


STREAMS = {"completions": completions_stream, "chat": chat_stream, "messages": messages_stream}


def render(events, eols, bom: bool, ends: list | None = None) -> tuple[bytes, list[tuple[int, str, str]]]:
    """The stream's bytes and its expected ``(offset, data, type)``: ``offset`` is the first byte of
    the terminator of the blank line that dispatches the event. ``eols`` yields each line's end;
    ``ends``, when given, gets the offset after each event."""
    out, want = bytearray(BOM if bom else b""), []
    for lines, expect in events:
        for line in lines:
            out += line + next(eols)
        if expect:
            want.append((len(out), *expect))
        out += next(eols)
        if ends is not None:
            ends.append(len(out))
    return bytes(out), want


def check(pieces: list[bytes], want) -> None:
    starts, pos = [], 0
    for piece in pieces:
        starts.append(pos)
        pos += len(piece)
    stamp = [next(i for i, s in enumerate(starts) if s <= off < s + len(pieces[i])) for off, _, _ in want]
    got = parse(*pieces)
    assert [(d, ty) for _, d, ty, _ in got] == [(d, ty) for _, d, ty in want]
    assert [t for t, *_ in got] == stamp


def _repeat(eol: bytes):
    while True:
        yield eol


@pytest.mark.parametrize("bom", [False, True], ids=["no-bom", "bom"])
@pytest.mark.parametrize("eol", sorted(EOLS))
@pytest.mark.parametrize("name", sorted(STREAMS))
def test_recorded_stream_split_at_every_byte_offset(name, eol, bom):
    s, want = render(STREAMS[name](), _repeat(EOLS[eol]), bom)
    assert len(want) >= 9
    for i in range(len(s) + 1):
        check(cut(s, [i]), want)


@pytest.mark.parametrize("bom", [False, True], ids=["no-bom", "bom"])
@pytest.mark.parametrize("eol", sorted(EOLS))
@pytest.mark.parametrize("name", sorted(STREAMS))
def test_recorded_stream_one_event_per_read(name, eol, bom):
    ends: list[int] = []
    s, want = render(STREAMS[name](), _repeat(EOLS[eol]), bom, ends)
    check(cut(s, ends), want)
    check(cut(s, [e - 1 for e in ends]), want)  # each read ends inside the blank line's terminator


@settings(max_examples=300, deadline=None)
@given(name=st.sampled_from(sorted(STREAMS)), bom=st.booleans(), data=st.data())
def test_recorded_stream_mixed_endings_random_splits(name, bom, data):
    events = STREAMS[name]()
    n_eols = sum(len(lines) + 1 for lines, _ in events)
    eols = data.draw(st.lists(st.sampled_from(sorted(EOLS.values())), min_size=n_eols, max_size=n_eols))
    # a lone CR then an LF-ended blank line is one CRLF by the standard: not a stream with these events
    eols = [b"\r\n" if e == b"\n" and prev == b"\r" else e for prev, e in zip([b""] + eols, eols)]
    ends: list[int] = []
    s, want = render(events, iter(eols), bom, ends)
    # cuts between events too: a read holding exactly one event takes the parser's fast path
    offsets = data.draw(st.lists(st.integers(0, len(s)), max_size=40) | st.lists(st.sampled_from(ends), max_size=40))
    offsets += data.draw(st.lists(st.sampled_from(ends), max_size=40))
    check(cut(s, offsets), want)


# --- a spec-literal oracle on random streams -----------------------------------------------------

def oracle(stream: bytes) -> tuple[list[tuple[str, str, str]], int | None]:
    """The standard's steps read literally: decode, drop one BOM, split lines, interpret each."""
    text = stream.decode("utf-8", "replace")
    text = text[1:] if text.startswith("\ufeff") else text
    events, data, etype, id_buf, retry = [], "", "", "", None
    for line in re.split(r"\r\n|\r|\n", text)[:-1]:  # the last piece has no line end yet
        if line == "":
            if data:
                events.append((data[:-1] if data.endswith("\n") else data, etype or "message", id_buf))
            data, etype = "", ""
            continue
        if line.startswith(":"):
            continue
        field, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if field == "data":
            data += value + "\n"
        elif field == "event":
            etype = value
        elif field == "id" and "\x00" not in value:
            id_buf = value
        elif field == "retry" and value and all(c in "0123456789" for c in value):
            retry = int(value)
    return events, retry


FRAGMENTS = [b"data", b"event", b"id", b"retry", b":", b" ", b"x", b"7", b"\n", b"\r", b"\r\n", b"\n\n",
             b"\x00", "é".encode(), b"\xe6", BOM, b"Data", b"message"]


@settings(max_examples=500, deadline=None)
@given(bom=st.booleans(), frags=st.lists(st.sampled_from(FRAGMENTS), max_size=60), data=st.data())
def test_random_streams_match_the_spec_oracle(bom, frags, data):
    s = (BOM if bom else b"") + b"".join(frags)
    p = SSEParser()
    got = parse(*cut(s, data.draw(st.lists(st.integers(0, len(s)), max_size=12))), parser=p)
    want, retry = oracle(s)
    assert [(d, ty, i) for _, d, ty, i in got] == want
    assert p.retry_ms == retry


LOOKALIKES = [b"data: a\nb\r\n\r\n", b"data: a\rb\n\n", b"data: a\nb\r\r", b"data: a\rb\r\n\r\n", b"data: a\r\nb\r\r",
              b"data: a\n\r\n", b"event: x\nid: 1\n\n", b"event: x\nfoo: ab\n\n",
              b"event: \ndata: a\n\n", b"event: x\rdata: a\n\n",
              b"event: x\ndata: a\ndata: b\n\n", b"event: x\ndata: a\rb\n\n", b"event: x\ndata: a\r\n\r\n"]


@pytest.mark.parametrize("chunk", LOOKALIKES)
def test_reads_that_look_like_the_fast_paths_follow_the_rules(chunk):
    # a parser past the stream's start with nothing held tries its fast paths on the next read
    for head, alone in ((b":\n\n", True), (b"data: 0\n\n", False)):
        p = SSEParser()
        got = p.feed(0, head) + p.feed(1, chunk) if alone else p.feed(0, head + chunk)
        assert [(d, ty, i) for _, d, ty, i in got] == oracle(head + chunk)[0]


# --- the client end to end against a FAKE server ------------------------------------------------

def awkward_writes(events) -> list[bytes]:
    """A stream with a BOM split across writes, events ending in turn with CRLF, lone CR and LF, and
    every CRLF split between two writes."""
    s, _ = render(events, iter([b"\r\n", b"\r", b"\n"][i // 2 % 3] for i in range(10_000)), bom=True)
    writes, start = [s[:1]], 1
    for m in re.finditer(rb"\r\n", s):
        writes.append(s[start:m.start() + 1])
        start = m.start() + 1
    return writes + [s[start:]]


async def _serve(writes: list[bytes]):
    """A FAKE OpenAI/Anthropic server (aiohttp): every POST gets ``writes``, one write each, 3 ms apart."""
    from aiohttp import web

    async def handler(request):
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for w in writes:
            await resp.write(w)
            await asyncio.sleep(0.003)
        await resp.write_eof()
        return resp

    app = web.Application()
    for path in client_mod.PATHS.values():
        app.router.add_post(path, handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, runner.addresses[0][1]


@pytest.mark.parametrize("api", sorted(STREAMS))
def test_client_gets_every_token_through_bom_split_crlf_and_lone_cr(api, monkeypatch):
    seen: list[bytes] = []

    class Recording(SSEParser):
        def feed(self, t_ns, chunk):
            seen.append(chunk)
            return super().feed(t_ns, chunk)

    monkeypatch.setattr(client_mod, "SSEParser", Recording)
    writes = awkward_writes(STREAMS[api]())
    reasoning = {"completions": [], "chat": [" Think", "ing", " é"], "messages": ["Let me", " see"]}[api]
    texts = {"completions": TOKENS, "chat": TOKENS[:6], "messages": TOKENS[:5]}[api]

    async def main():
        runner, port = await _serve(writes)
        client = OpenAIClient(f"http://127.0.0.1:{port}", "m", api=api, read_timeout_s=10)
        try:
            return [ev async for ev in client.stream(GenerationRequest(request_id=f"sse-{api}", prompt="p"))]
        finally:
            await client.aclose()
            await runner.cleanup()

    evs = asyncio.run(main())  # ending without [DONE] / message_stop would raise transport-distortion
    got = [(ev.kind, ev.text) for ev in evs if ev.text]
    assert got == [("reasoning", r) for r in reasoning] + [("text", t) for t in texts]
    assert evs[-1].usage is not None and evs[-1].usage.completion_tokens == len(reasoning) + len(texts)
    assert [ev.t_ns for ev in evs] == sorted(ev.t_ns for ev in evs)
    # what this test claims reached the parser: a lone BOM byte first, CR and LF of a pair apart, lone CRs
    assert seen[0] == b"\xef" and len(seen) >= len(writes) - 2
    assert any(a.endswith(b"\r") and b.startswith(b"\n") for a, b in zip(seen, seen[1:]))
    assert re.search(rb"\r[^\n]", b"".join(seen))
