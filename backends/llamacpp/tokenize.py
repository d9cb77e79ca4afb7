"""llama-server's own token ids: ``POST /tokenize`` in llama.cpp's shape.

llama.cpp's server (``tools/server``) answers ``{"content": text, "add_special": bool}`` with
``{"tokens": [ids]}`` (not vLLM's ``prompt``/``count`` shape of :mod:`backends._tokenize`). A
chat prompt is rendered first by ``POST /apply-template`` (``{"messages": [...]}`` ->
``{"prompt": text}``: the chat template the server applies to a chat request, with the
generation prompt), then tokenized without added special tokens (the template carries its own).
"""

from __future__ import annotations

import json

from backends._tokenize import _post
from bakeoff.api.errors import EngineFailure


def _answer(root: str, path: str, body: dict, timeout_s: float) -> tuple[dict | None, str]:
    status, text = _post(root + path, body, {}, timeout_s)
    if status == 0 or status >= 500:
        raise EngineFailure("runtime-crash", f"POST {root}{path} failed: {'HTTP ' + str(status) if status else ''} "
                            f"{text[:300]}".strip(), {"tokenize_request.json": json.dumps(body, indent=1)})
    if status != 200:
        return None, f"llama-server's {path} refused the request (HTTP {status}: {' '.join(text.split())[:200]})"
    try:
        data = json.loads(text)
    except ValueError:
        data = None
    return (data, "") if isinstance(data, dict) else (None, f"llama-server's {path} answered no JSON object")


def server_tokenize_llamacpp(base_url: str | None, texts: list[str], chat: bool = False,
                             timeout_s: float = 30.0) -> tuple[list[list[int]] | None, str]:
    """``(ids per text, '')`` or ``(None, why)``.

    Raises:
        EngineFailure: ``runtime-crash`` when the server fails (HTTP 5xx, unreachable); ``hang``
            when no byte came within ``timeout_s``.
    """
    if not base_url:
        return None, "llama-server is not started"
    root, out = base_url.rstrip("/"), []
    for text in texts:
        if chat:
            data, why = _answer(root, "/apply-template", {"messages": [{"role": "user", "content": text}]}, timeout_s)
            if data is None or not isinstance(data.get("prompt"), str):
                return None, why or "llama-server's /apply-template answered without a prompt"
            text = data["prompt"]
        data, why = _answer(root, "/tokenize", {"content": text, "add_special": not chat, "parse_special": True},
                            timeout_s)
        ids = data.get("tokens") if data is not None else None
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids) \
                or (text and not ids):
            return None, why or f"llama-server's /tokenize answered another shape: {str(data)[:200]}"
        out.append(ids)
    return out, ""
