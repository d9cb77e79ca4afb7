"""``--backend-opt`` keys of the ``openai`` backend (:class:`OpenAIOptions`), each checked when
given: a reachable address, no request field bakeoff sets itself, a key variable that is set, a
tokenizer that loads."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator

from bakeoff.api.errors import EngineFailure
from bakeoff.loadgen.accounting import TokenCounter
from bakeoff.loadgen.client import REQUEST_KEYS
from bakeoff.api.specs import Spec


class OpenAIOptions(Spec):
    """``--backend-opt`` keys of the ``openai`` backend.

    Attributes:
        base_url: server root, e.g. ``http://127.0.0.1:8000`` (a trailing ``/v1`` is accepted).
        api: ``completions``, ``chat`` or ``messages`` (Anthropic).
        model: served model name; default: the first id of ``GET /v1/models``.
        api_key_env: NAME of the environment variable holding the API key (never the key).
        tokenizer: path to a tokenizer (``tokenizer.json`` or its folder) for client
            re-tokenization, the last resort of token accounting.
        extra_body: JSON fields added to every request (e.g. ``{"return_token_ids": true}``
            for vLLM, so token counts come from ids).
        read_timeout_s: no byte within this many seconds ends a request as ``hang`` (where the
            server's ``/metrics`` shows token counters, only when they did not advance); at least 1 s
            (a smaller one called a healthy server hung).
        max_model_len: the server's context length in tokens, which the long-context checks size
            their prompts within; default: the ``max_model_len`` its ``GET /v1/models`` entry
            states (vLLM and SGLang do), else unknown (and the checks use the model's own).
        greedy_body: JSON fields sent in every request at temperature 0, the server's sampling
            options that change a greedy choice set neutral; default: by the dialect its
            ``/v1/models`` ``owned_by`` names (:func:`greedy_fields`), ``{}`` sends none (a server
            that refuses fields it lacks). ``extra_body`` is applied after it.
    """

    base_url: str
    api: Literal["completions", "chat", "messages"] = "completions"
    model: str | None = None
    api_key_env: str | None = None
    tokenizer: str | None = None
    extra_body: dict[str, Any] = Field(default_factory=dict)
    read_timeout_s: float = Field(120.0, ge=1.0)
    max_model_len: int | None = Field(None, gt=0)
    greedy_body: dict[str, Any] | None = None

    @field_validator("extra_body", "greedy_body")
    @classmethod
    def _extra_body_sets_no_request_field(cls, v: dict[str, Any] | None, info) -> dict[str, Any] | None:
        """Fields bakeoff sets per request are not the user's to override (issue 36's census: ``stream:
        false`` read as a server ignoring stream=true; ``max_tokens: 1`` capped every output and blamed
        the engine)."""
        taken = sorted(k for k in v or {} if k in REQUEST_KEYS)
        if taken:
            raise ValueError(f"{info.field_name} may not set {', '.join(taken)}: bakeoff sets them for each request; "
                             "pass other fields only (e.g. return_token_ids, chat_template_kwargs)")
        return v

    @field_validator("base_url")
    @classmethod
    def _base_url_is_http(cls, v: str) -> str:
        """An address bakeoff can reach a server at: ``http`` or ``https`` with a host (issue 36's
        census: an empty value, ``not a url`` and ``file:///etc`` were accepted and ended
        ``load-failure``, the user's typo charged to a server; urllib read ``file:`` from disk)."""
        try:
            parts = urlsplit(v.strip())
            host = parts.hostname
        except ValueError:
            host, parts = None, None
        if parts is None or parts.scheme not in ("http", "https") or not host:
            raise ValueError(f"base_url={v!r} is not an http:// or https:// address with a host, "
                             "e.g. base_url=http://127.0.0.1:8000")
        return v.strip()

    @field_validator("api_key_env")
    @classmethod
    def _key_is_set(cls, v: str | None) -> str | None:
        """The variable must hold a key here (census: an unset one sent every request without a key,
        and the server's 401s read as its failure). Its value is never shown."""
        if v is not None and not os.environ.get(v):
            raise ValueError(f"api_key_env={v!r} names an environment variable that is not set (or empty); "
                             f"export {v}=... or drop the option")
        return v

    @field_validator("tokenizer")
    @classmethod
    def _tokenizer_loads(cls, v: str | None) -> str | None:
        """A tokenizer that cannot be loaded is the user's input to fix, told before anything is
        built or written (not a ``config-rejected`` load failure charged to the server). It
        reads the file, nothing more."""
        if v is not None:
            p = Path(v.strip())
            target = p / "tokenizer.json" if p.is_dir() else p
            if not v.strip() or (target.exists() and not target.is_file()):
                raise ValueError(f"tokenizer={v!r} is not a tokenizer.json file or a folder holding one")
            if target.is_file() and target.stat().st_size > 512 * 2**20:
                raise ValueError(f"tokenizer={v!r} is {target.stat().st_size / 2**20:.0f} MiB: not a tokenizer.json")
            try:
                TokenCounter(v)
            except EngineFailure as exc:
                raise ValueError(f"{exc.message}; pass a tokenizer.json or the folder that holds one") from None
        return v
