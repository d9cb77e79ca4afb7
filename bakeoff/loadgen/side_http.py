"""Bounded side requests (``/health``, ``/v1/models``, ``/metrics``, ``/version``, ``/tokenize``).

urllib, with what its defaults leave open closed:

- **No redirect is followed.** urllib's default handler re-sends every header of a request,
  ``Authorization`` included, to wherever a 3xx ``Location`` points (another port, host or
  scheme). Here a 3xx comes back as an ``HTTPError`` with its code, and its text names the
  ``Location`` that was not followed (:func:`redirect_text`), so the verdict's evidence says so.
- **The body is bounded in size and in time.** A socket timeout bounds one read only: a server
  that trickles a byte a second, or streams without end, is never cut by it. Bodies are read in
  pieces up to :data:`MAX_BODY_BYTES` and within a whole-request deadline (default
  :data:`DEADLINE_FACTOR` read timeouts); past either the read ends with :class:`BodyTooLarge`
  (an ``OSError``) or :class:`BodyDeadline` (a ``TimeoutError``, so callers that class a
  timeout as ``hang`` do so here too), each naming the figure.
"""

from __future__ import annotations

import http.client
import time
import urllib.error
import urllib.request
from typing import Any

MAX_BODY_BYTES = 8 * 1024 * 1024  # a /metrics page of a large server is ~100 KB; a model list less
DEADLINE_FACTOR = 3.0  # a whole side request may take this many read timeouts
PIECE = 65536


class BodyTooLarge(OSError):
    """A response body over the size bound (bytes read so far in the message)."""


class BodyDeadline(TimeoutError):
    """A response body still arriving at the whole-request deadline."""


class BodyCut(OSError):
    """A response body that ended before its own framing said (``Content-Length`` not reached, a
    chunked body without its last chunk): ``http.client.IncompleteRead`` as an ``OSError``, so
    every caller that handles a failed side request handles it (issue 36: a server closing
    mid-body ended checks ``error`` with a traceback)."""


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: D102 - urllib's hook
        return None  # urllib then raises HTTPError(code): nothing is re-sent anywhere


def redirect_sentence(code: int, location: str | None) -> str:
    """``HTTP 302: redirect to LOCATION not followed ...``: the side routes' and the streams' words."""
    return (f"HTTP {code}: redirect to {location or '?'} not followed (bakeoff sends no request, and no credential, "
            "past the origin it was given; point base_url at the final address)")


def redirect_text(exc: urllib.error.HTTPError) -> str | None:
    """For a 3xx answer: ``redirect to LOCATION not followed ...``; None for any other code."""
    if not 300 <= exc.code < 400:
        return None
    return redirect_sentence(exc.code, (exc.headers or {}).get("Location") if exc.headers is not None else None)


def read_bounded(resp: Any, timeout_s: float, deadline_s: float | None = None,
                 max_bytes: int = MAX_BODY_BYTES, t0: float | None = None, cut: bool = False) -> bytes:
    """The body of ``resp`` (an ``http.client.HTTPResponse`` or an ``HTTPError``), read in pieces.

    Args:
        resp: the response.
        timeout_s: the read timeout (the socket's); the deadline defaults to
            :data:`DEADLINE_FACTOR` times it.
        deadline_s: seconds from ``t0`` the whole body may take.
        max_bytes: the size bound.
        t0: ``time.monotonic()`` when the request was sent (default: now).
        cut: return the first ``max_bytes`` instead of raising (an error answer's text).

    Raises:
        BodyTooLarge: over ``max_bytes``.
        BodyDeadline: the deadline passed with the body still arriving.
    """
    start = time.monotonic() if t0 is None else t0
    limit = start + (deadline_s if deadline_s is not None else DEADLINE_FACTOR * timeout_s)
    read = getattr(resp, "read1", None) or resp.read
    buf = bytearray()
    while True:
        if time.monotonic() > limit:
            raise BodyDeadline(f"the body was still arriving after {time.monotonic() - start:.1f} s "
                               f"({len(buf):,} bytes; the deadline is {limit - start:.0f} s)")
        try:
            piece = read(PIECE)
        except http.client.IncompleteRead as exc:
            raise BodyCut(f"the body was cut after {len(buf) + len(exc.partial):,} bytes: the server closed the "
                          "connection before the length its headers announced") from None
        except http.client.HTTPException as exc:  # a chunk size that is not one, a bad chunk end
            raise BodyCut(f"the body's framing is broken after {len(buf):,} bytes: {type(exc).__name__}") from None
        if not piece:
            left = getattr(resp, "length", None)  # http.client: what Content-Length still promised
            if isinstance(left, int) and not isinstance(left, bool) and left > 0 and not cut:
                raise BodyCut(f"the body was cut after {len(buf):,} bytes: the server closed the connection "
                              f"with {left:,} of the length its headers announced still to come")
            return bytes(buf)
        buf += piece
        if len(buf) > max_bytes and cut:
            return bytes(buf[:max_bytes])
        if len(buf) > max_bytes:
            raise BodyTooLarge(f"the body passed {max_bytes:,} bytes (bakeoff's bound for a side request)")


def open_bounded(req: urllib.request.Request | str, timeout_s: float, deadline_s: float | None = None,
                 max_bytes: int = MAX_BODY_BYTES) -> tuple[int, bytes, dict[str, str]]:
    """``(status, body, headers)`` of a request, no redirect followed, the body bounded.

    Raises:
        urllib.error.HTTPError: a status of 300 or more (3xx: :func:`redirect_text`); read its
            body with :func:`read_bounded`.
        urllib.error.URLError, OSError, TimeoutError: as ``urlopen`` does, and
            :class:`BodyTooLarge` / :class:`BodyDeadline`.
    """
    t0 = time.monotonic()
    opener = urllib.request.build_opener(_NoRedirect)
    try:
        with opener.open(req, timeout=timeout_s) as resp:
            body = read_bounded(resp, timeout_s, deadline_s, max_bytes, t0)
            return resp.status, body, dict(resp.headers)
    except http.client.HTTPException as exc:  # an answer that is not HTTP (over 100 headers, a bad status line)
        if isinstance(exc, OSError):  # RemoteDisconnected: a dropped connection, as callers already read it
            raise
        raise urllib.error.URLError(f"the server's answer is not well-formed HTTP: {type(exc).__name__}: {exc}") from None


def error_body(exc: urllib.error.HTTPError, timeout_s: float, limit: int = 2000) -> str:
    """The first ``limit`` characters of an error answer's body (bounded; '' when unreadable), or,
    for a redirect, the sentence saying it was not followed."""
    text = redirect_text(exc)
    if text is not None:
        return text
    try:
        return read_bounded(exc, timeout_s, max_bytes=limit * 4, cut=True).decode("utf-8", "replace")[:limit]
    except (OSError, TimeoutError, ValueError):
        return ""
