"""What an attached OpenAI-compatible server says about itself, read for ``OpenAIBackend.start``.

Its ``GET /v1/models`` listing (ids, the first entry's ``owned_by``, the ``max_model_len`` an
entry states), its ``GET /version`` and the notes of the :class:`~bakeoff.api.specs.BackendInfo`
it is described by. Each takes an ``Answer`` (:class:`backends.openai.backend.Answer`), one GET
of the server.
"""

from __future__ import annotations

import json
from typing import Any


def models_listing(models) -> tuple[list, list[str], str | None]:
    """The entries of a 200 ``GET /v1/models``, their ids and the first entry's ``owned_by``;
    what was read before an unreadable part, else empty and None."""
    data: list = []
    listed: list[str] = []
    owned_by = None
    if models.status == 200:
        try:
            data = json.loads(models.body).get("data") or []
            listed = [d.get("id") for d in data if d.get("id")]
            owned_by = data[0].get("owned_by") if data else None
        except (ValueError, AttributeError):
            pass
    return data, listed, owned_by


def stated_max_len(data: list, model: str | None) -> int | None:
    """The context length the ``/v1/models`` entry of ``model`` states (vLLM and SGLang do), where
    it is an int in (0, 2**31); else None."""
    stated = next((d.get("max_model_len") for d in data if isinstance(d, dict) and d.get("id") == model), None)
    return stated if isinstance(stated, int) and not isinstance(stated, bool) and 0 < stated < 1 << 31 else None


def served_version(answer) -> str | None:
    """The ``version`` a 200 ``GET /version`` states, else None (a server without the route)."""
    if answer.status != 200:
        return None
    try:
        return json.loads(answer.body).get("version")
    except (ValueError, AttributeError):
        return None


def server_header(health, models) -> str | None:
    """The ``Server`` header of the probe's answer that was 200 (``/health`` first)."""
    headers = health.headers if health.status == 200 else models.headers
    return headers.get("server") or headers.get("Server")


def info_notes(options, server: str | None, listed: list[str], greedy: dict[str, Any], greedy_why: str,
               progress_note: str, max_len: int | None, version_answer) -> dict[str, str]:
    """``BackendInfo.notes`` of an attached server: the API, what it said of itself, the greedy
    fields, the hang rule and where the context length came from; empty notes left out."""
    notes = {"api": options.api, "server_header": server, "listed_models": ",".join(listed[:10]),
             "greedy_body": f"{json.dumps(greedy, sort_keys=True)} in every request at temperature 0 ({greedy_why})",
             "api_key_env": options.api_key_env, "progress": progress_note,
             "max_model_len": (None if max_len is None else "--backend-opt max_model_len"
                               if options.max_model_len else "GET /v1/models"),
             "version": None if version_answer.status != 0 else f"GET /version: {version_answer.body[:120]}"}
    return {k: v for k, v in notes.items() if v}
