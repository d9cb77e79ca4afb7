"""An incremental server-sent events (SSE) parser for the streaming client.

The rules are the WHATWG HTML standard's "event stream interpretation"
(https://html.spec.whatwg.org/multipage/server-sent-events.html#event-stream-interpretation),
the rules browsers' ``EventSource`` follow, which OpenAI- and Anthropic-compatible servers assume:

- one UTF-8 byte order mark (EF BB BF) at the very start of the stream is dropped; a second one,
  or one later in the stream, is data (it makes the next field name unknown);
- a line ends with CRLF, a lone CR or a lone LF; any of them may be split anywhere across reads;
- a blank line dispatches the event: its ``data`` lines joined by LF (the final LF removed), its
  type from the last ``event:`` line (``"message"`` when none or empty); an event whose data
  buffer is empty (no ``data`` line) is not dispatched; both buffers are then cleared;
- ``field: value``: the field name is up to the first colon, one leading space of the value is
  removed; a line without a colon is a field name with an empty value; a line starting with a
  colon is a comment; unknown fields are ignored; field names are case-sensitive;
- ``id``: sets the last event id unless the value contains NUL; it is kept across events;
- ``retry``: the reconnection time in ms, only when the value is ASCII digits;
- an event not ended by a blank line when the stream ends is never dispatched.

Timing: an event carries the ``t_ns`` of the network chunk that held the terminator of the blank
line that dispatched it. A chunk ending in CR dispatches what that CR completes at once (the
standard ends a line at CR); the parser only remembers that one LF at the start of the next
chunk belongs to that CR and is dropped. Waiting for the next chunk instead would stamp every
event of a lone-CR server with the next event's arrival (one ITL late), and its last event
(``[DONE]``) would never be dispatched.

Cost: this runs for every token of hundreds of concurrent streams on one event loop, so the work is
done with bytes operations, never a per-character loop. Fast paths, taken when nothing is held from
earlier reads and the read is exactly one event: one ``data: `` line then a blank line (what
OpenAI-compatible servers such as vLLM write per token), with LF, CRLF or CR line ends, or
Anthropic's ``event:`` line then ``data:`` line with LF ends: a few ``find`` calls, one slice, one
decode (cheaper than the inline code this replaced, which split and then sliced). Otherwise CR line
ends are rewritten to LF with two ``bytes.replace`` calls, the bytes are split on LF LF, the same
two event shapes are recognised per block, and any other event (multi-line data, comments,
``id``/``retry``, a leading blank line) goes through a per-line loop. Bytes of an unfinished event
are kept and searched again only from where the last search stopped.
"""

from __future__ import annotations

__all__ = ["SSEParser", "Event"]

_BOM = b"\xef\xbb\xbf"
_NONE: tuple = ()
Event = tuple  # (t_ns, data, event_type, last_event_id): plain tuples, the cheapest to build and unpack


class SSEParser:
    """Feed ``(t_ns, bytes)`` pieces of one response body; get the events they complete.

    Attributes:
        last_event_id: the last event id as of the latest dispatch point (blank line).
        retry_ms: the reconnection time the stream asked for, ms (None until a valid ``retry``).

    Example::

        parser = SSEParser()
        async for t_ns, piece in resp.chunks(timeout_s):
            for t_ns, data, event_type, last_event_id in parser.feed(t_ns, piece):
                ...
    """

    __slots__ = ("_pend", "_start", "_cr", "_idle", "_id", "last_event_id", "retry_ms")

    def __init__(self) -> None:
        self._pend = b""  # bytes of the unfinished event, from a line start, LF line ends only
        self._start = True  # the BOM is still undecided (fewer than 3 bytes seen, all a BOM prefix)
        self._cr = False  # the last piece ended in CR: an LF first in the next piece belongs to it
        self._idle = False  # nothing held and past the start: the next read may take a fast path
        self._id = ""  # the last event id buffer
        self.last_event_id = ""
        self.retry_ms: int | None = None

    @property
    def pending(self) -> bytes:
        """Bytes of an event not yet ended by a blank line (never dispatched if the stream ends)."""
        return self._pend

    def feed(self, t_ns: int, chunk: bytes) -> list[Event] | tuple:
        """Parse one network chunk.

        Args:
            t_ns: the chunk's receive time (``time.monotonic_ns()``).
            chunk: the body bytes (already de-chunked from HTTP framing).

        Returns:
            The events this chunk completed, in order, each ``(t_ns, data, event_type,
            last_event_id)`` with ``data`` and ``event_type`` decoded as UTF-8 (invalid bytes
            replaced by U+FFFD); ``()`` when none.
        """
        if self._idle:  # fast path: nothing held, the chunk is one whole event
            one = self._one_event(t_ns, chunk)
            if one is not None:
                return one
        events = self._feed(t_ns, chunk)
        if self._pend or self._start:
            self._idle = False
        else:  # nothing held: an LF next would be a blank line with nothing to send, CR flag or not
            self._idle, self._cr = True, False
        return events

    def _one_event(self, t_ns: int, chunk: bytes) -> list[Event] | None:
        """The chunk as one event when it is exactly one data line (or Anthropic's event line and
        data line) and its blank line, nothing held before it; None: the general parser's."""
        if chunk[:6] == b"data: ":
            n = len(chunk) - 2
            end = chunk[n:]
            if end == b"\n\n":
                if chunk.find(b"\n", 6) == n and chunk.find(b"\r", 6) < 0:
                    return [(t_ns, chunk[6:n].decode("utf-8", "replace"), "message", self._id)]
            elif end == b"\r\n":
                if chunk.find(b"\r", 6) == n - 2 and chunk.find(b"\n", 6) == n - 1:
                    return [(t_ns, chunk[6:n - 2].decode("utf-8", "replace"), "message", self._id)]
            elif end == b"\r\r":  # no CR flag needed: an LF next would be a blank line with nothing to send
                if chunk.find(b"\r", 6) == n and chunk.find(b"\n", 6) < 0:
                    return [(t_ns, chunk[6:n].decode("utf-8", "replace"), "message", self._id)]
        elif chunk[:7] == b"event: " and chunk[-2:] == b"\n\n":  # Anthropic's: event, data
            i = chunk.find(b"\n", 7)
            if chunk[i + 1:i + 7] == b"data: " and chunk.find(b"\n", i + 7) == len(chunk) - 2 \
                    and chunk.find(b"\r", 7) < 0:
                return [(t_ns, chunk[i + 7:-2].decode("utf-8", "replace"),
                         chunk[7:i].decode("utf-8", "replace") or "message", self._id)]
        return None

    def _feed(self, t_ns: int, chunk: bytes) -> list[Event] | tuple:
        if self._cr:
            self._cr = False
            if chunk[:1] == b"\n":
                chunk = chunk[1:]
        pend = self._pend
        buf = pend + chunk if pend else chunk
        if self._start:
            if len(buf) < 3 and _BOM.startswith(buf):
                self._pend = buf
                return _NONE
            self._start = False
            if buf[:3] == _BOM:
                buf = buf[3:]
            pend = b""  # a held BOM prefix is not LF-free data to skip in the search below
        if b"\r" in chunk:
            if chunk[-1:] == b"\r":
                self._cr = True
            buf = buf.replace(b"\r\n", b"\n")
            if b"\r" in buf:
                buf = buf.replace(b"\r", b"\n")
        # the unfinished event held no blank line: only its last byte can start one with the chunk
        if buf.find(b"\n\n", len(pend) - 1 if pend else 0) < 0:
            self._pend = buf
            return _NONE
        *blocks, self._pend = buf.split(b"\n\n")
        out = self._dispatch(t_ns, blocks)
        self.last_event_id = self._id
        return out

    def _dispatch(self, t_ns: int, blocks: list[bytes]) -> list[Event]:
        """The events of whole blocks (the text between blank lines), in order."""
        out: list[Event] = []
        for block in blocks:
            if block[:6] == b"data: " and block.find(b"\n", 6) < 0:  # the common event: one data line
                out.append((t_ns, block[6:].decode("utf-8", "replace"), "message", self._id))
            elif block[:7] == b"event: " and block[(i := block.find(b"\n", 7)) + 1:i + 7] == b"data: " \
                    and i > 0 and block.find(b"\n", i + 7) < 0:  # Anthropic's: an event line, a data line
                out.append((t_ns, block[i + 7:].decode("utf-8", "replace"),
                            block[7:i].decode("utf-8", "replace") or "message", self._id))
            elif block:
                self._block(t_ns, block, out)
            # an empty block is a blank line after a dispatch: nothing to dispatch
        return out

    def _block(self, t_ns: int, block: bytes, out: list) -> None:
        """Interpret the lines of one event (no LF LF inside; a leading LF is a blank line)."""
        data: list[bytes] = []
        etype = b""
        for line in block.split(b"\n"):
            if not line:  # a blank line: only at the block's start, after an earlier dispatch
                if data:
                    out.append((t_ns, b"\n".join(data).decode("utf-8", "replace"),
                                etype.decode("utf-8", "replace") if etype else "message", self._id))
                data, etype = [], b""
                continue
            colon = line.find(b":")
            if colon == 0:
                continue  # comment
            if colon < 0:
                name, value = line, b""
            else:
                name, value = line[:colon], line[colon + 1:]
                if value[:1] == b" ":
                    value = value[1:]
            if name == b"data":
                data.append(value)
            elif name == b"event":
                etype = value
            elif name == b"id":
                if b"\x00" not in value:
                    self._id = value.decode("utf-8", "replace")
            elif name == b"retry":
                if value.isdigit():  # bytes.isdigit: ASCII digits only, False when empty
                    self.retry_ms = int(value)
        if data:
            out.append((t_ns, b"\n".join(data).decode("utf-8", "replace"),
                        etype.decode("utf-8", "replace") if etype else "message", self._id))
