"""What the streaming client (:meth:`bakeoff.loadgen.client.OpenAIClient.stream`) checks of an answer
around its events: its headers before them (an event stream, not one JSON body, not compressed by a
hop), its bounds (the failure past them: :func:`over_bounds`), how it ended (every event JSON,
``[DONE]`` reached), and the bounded drain of what a server still sends after ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import json
import time

from bakeoff.api.errors import EngineFailure
from bakeoff.loadgen.http import TransportError

# token events a stream of max_tokens may carry: one a token, plus a role event, an empty first
# event, a finish event and usage (OpenAI-compatible servers send at most these few extra). Past
# it the server is not stopping at max_tokens: cut at once, not at the byte or time bound (an
# endless stream of small events took ~40 s a request to reach those: 10 min for 240 probes).
STREAM_EVENT_SLACK = 16
DRAIN_MAX_S, DRAIN_MAX_BYTES = 10.0, 16 << 20  # what is read after [DONE] to keep a connection, at most


async def check_event_stream(resp, path: str, timeout_s: float) -> None:
    """Raise for an answer to stream=true that is no event stream: one JSON body (``protocol-violation``,
    its first bytes read), a body a hop compressed (``transport-distortion``), another Content-Type
    (``protocol-violation``)."""
    ctype = resp.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype == "application/json":  # one JSON body where an event stream was asked for
        head = b""
        async for _, piece in resp.chunks(timeout_s):
            head += piece
            if len(head) >= 8192:  # enough to show; the rest is not read
                break
        resp.release()
        text = head.decode("utf-8", "replace")[:2000]
        raise EngineFailure("protocol-violation", f"{path} answered one JSON body (Content-Type application/json), "
                            f"not an event stream: the server ignored stream=true; first bytes: "
                            f"{text.strip()[:200]!r}", {"response.txt": text})
    coding = resp.headers.get("content-encoding", "identity").strip().lower()
    if coding not in ("identity", "", "gzip", "x-gzip", "deflate"):  # http.py inflates gzip/deflate
        raise EngineFailure("transport-distortion", f"the event stream arrived Content-Encoding: {coding} "
                            "although the client asked for identity: a hop between client and server "
                            "compressed it; measure without that hop or turn its compression off")
    if ctype and ctype != "text/event-stream":  # what an SSE client (a browser's EventSource) requires
        resp.release()
        raise EngineFailure("protocol-violation", f"{path} answered stream=true with Content-Type {ctype}, not "
                            "text/event-stream: an event-stream client may refuse it (a server or a hop between "
                            "mislabels the stream)")


def end_failure(malformed: list[str], done: bool, nbytes: int, elapsed: float) -> EngineFailure | None:
    """How a stream read to its end failed, if it did: malformed JSON events, else no ``[DONE]``
    (both ``transport-distortion``)."""
    if malformed:
        return EngineFailure("transport-distortion", f"{len(malformed)} malformed JSON SSE event(s) in "
                             f"{nbytes} bytes: {malformed[0][:120]!r}", {"events.txt": "\n".join(malformed)})
    if not done:
        return EngineFailure("transport-distortion", f"stream ended without [DONE] after {nbytes} bytes "
                             f"and {elapsed:.3f} s", {"cut.json": json.dumps({"bytes": nbytes,
                                                                              "elapsed_s": elapsed})})
    return None


def finish(resp, timeout_s: float) -> None:
    """Release the connection; drain a body still open after ``[DONE]`` in the background."""
    if resp.complete or resp.conn is None or resp.conn.eof:
        resp.release()
        return

    async def drain() -> None:  # bounded: a server that goes on sending after the end is cut off
        end = time.monotonic() + DRAIN_MAX_S
        try:
            async for _ in resp.chunks(min(timeout_s, 5.0)):
                if resp.nbytes > DRAIN_MAX_BYTES or time.monotonic() > end:
                    break
        except (TransportError, asyncio.CancelledError):
            pass
        resp.release()

    try:
        asyncio.get_running_loop().create_task(drain())
    except RuntimeError:
        resp.release()


def over_bounds(path: str, nbytes: int, elapsed_s: float, max_bytes: int, max_s: float, max_tokens: int,
                events: int | None = None) -> EngineFailure:
    """A stream past :func:`~bakeoff.loadgen.client.stream_bounds` or :data:`STREAM_EVENT_SLACK`: ``protocol-violation`` with the figures."""
    if events is not None:
        what = (f"{events:,} events, past the {max(1, int(max_tokens or 1)) + STREAM_EVENT_SLACK:,} a stream of max_tokens {max_tokens} "
                "may carry: the server does not stop at max_tokens")
    elif nbytes > max_bytes:
        what = f"{nbytes:,} bytes, past the {max_bytes:,} a stream of max_tokens {max_tokens} may take"
    else:
        what = f"still streaming after {elapsed_s:.0f} s, past the {max_s:.0f} s a stream of max_tokens {max_tokens} may take"
    return EngineFailure("protocol-violation", f"POST {path}: {what}; cut there (bakeoff's bound, client.stream_bounds)",
                         {"bounds.json": json.dumps({"bytes": nbytes, "elapsed_s": round(elapsed_s, 3), "events": events,
                                                     "max_bytes": max_bytes, "max_s": max_s, "max_tokens": max_tokens})})
