"""``openai`` backend: any running OpenAI-compatible (or Anthropic Messages) server, by URL.

Nothing is launched and nothing is stopped: ``start()`` only checks that the server answers
(``GET /health``, else ``GET /v1/models``) and learns the served model name; ``stop()`` leaves
the remote server alone. Streaming goes through :class:`bakeoff.loadgen.client.OpenAIClient`
(per-event arrival stamps, reasoning/thinking deltas counted apart from text).

The API key is read from the environment variable *named* by ``api_key_env`` at request
time; the key itself is never written to a spec, a log or an artifact.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from typing import Any, AsyncIterator, Callable, Literal

from pydantic import Field, field_validator

from backends.base import Backend
from bakeoff.api.errors import EngineFailure
from bakeoff.loadgen.accounting import TokenCounter
from bakeoff.loadgen.client import OpenAIClient
from bakeoff.api.specs import BackendInfo, GenerationRequest, Spec, TokenEvent
from backends._server import parse_prometheus
from backends._tokenize import server_tokenize


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
        read_timeout_s: no byte within this many seconds ends a request as ``hang``.
    """

    base_url: str
    api: Literal["completions", "chat", "messages"] = "completions"
    model: str | None = None
    api_key_env: str | None = None
    tokenizer: str | None = None
    extra_body: dict[str, Any] = Field(default_factory=dict)
    read_timeout_s: float = Field(120.0, gt=0)

    @field_validator("tokenizer")
    @classmethod
    def _tokenizer_loads(cls, v: str | None) -> str | None:
        """A tokenizer that cannot be loaded is the user's input to fix, told before anything is
        built or written (not a ``config-rejected`` load failure charged to the server). It
        reads the file, nothing more."""
        if v is not None:
            from pathlib import Path

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


class OpenAIBackend(Backend):
    """A running server reached over HTTP; see the module docstring."""

    name = "openai"
    Options = OpenAIOptions

    def __init__(self, config):
        super().__init__(config)
        self.client: OpenAIClient | None = None
        # the client-side token count of --backend-opt tokenizer=DIR (bakeoff/loadgen/accounting.py)
        self.count_tokens: Callable[[str], int] | None = None
        self.api = self.options.api
        self.base_url = self.options.base_url.rstrip("/")
        if self.base_url.endswith("/v1"):
            self.base_url = self.base_url[:-3]

    def _get(self, path: str, timeout_s: float = 10.0) -> tuple[int, str, dict[str, str]]:
        req = urllib.request.Request(self.base_url + path, headers=self._auth())
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as resp:
                return resp.status, resp.read().decode("utf-8", "replace"), dict(resp.headers)
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode("utf-8", "replace")[:2000], dict(exc.headers or {})
        except (urllib.error.URLError, OSError, TimeoutError) as exc:
            return 0, f"{type(exc).__name__}: {exc}", {}

    def _auth(self) -> dict[str, str]:
        key = os.environ.get(self.options.api_key_env) if self.options.api_key_env else None
        if not key:
            return {}
        return {"x-api-key": key, "anthropic-version": "2023-06-01"} if self.options.api == "messages" \
            else {"Authorization": f"Bearer {key}"}

    def start(self) -> BackendInfo:
        """Check the server answers and learn its model name.

        Raises:
            EngineFailure: ``load-failure`` when neither ``/health`` nor ``/v1/models``
                answers 200 within the start deadline; ``config-rejected`` when no model
                name is given and ``/v1/models`` lists none.
        """
        t0 = time.monotonic()
        deadline = t0 + self.config.start_timeout_s
        while True:
            h_status, h_body, headers = self._get("/health", 5)
            m_status, m_body, m_headers = self._get("/v1/models", 5)
            if h_status == 200 or m_status == 200:
                break
            refused = h_status == 0 and m_status == 0  # nothing listens: an attached server should
            if time.monotonic() > deadline or (refused and time.monotonic() - t0 > 2):
                raise EngineFailure("load-failure", f"server at {self.base_url} does not answer: /health "
                                    f"{h_status or h_body}, /v1/models {m_status or m_body}",
                                    {"probe.txt": f"/health {h_status}: {h_body}\n/v1/models {m_status}: {m_body}"})
            time.sleep(0.5)
        listed: list[str] = []
        owned_by = None
        if m_status == 200:
            try:
                data = json.loads(m_body).get("data") or []
                listed = [d.get("id") for d in data if d.get("id")]
                owned_by = data[0].get("owned_by") if data else None
            except (ValueError, AttributeError):
                pass
        model = self.options.model or (listed[0] if listed else None)
        if model is None:
            raise EngineFailure("config-rejected", f"no model name given and GET {self.base_url}/v1/models lists none "
                                f"(status {m_status}); pass --backend-opt model=NAME", {"models.txt": m_body[:2000]})
        if self.options.tokenizer:
            self.count_tokens = load_token_counter(self.options.tokenizer)
        self.client = OpenAIClient(self.base_url, model, api=self.options.api, api_key_env=self.options.api_key_env,
                                   extra_body=self.options.extra_body, read_timeout_s=self.options.read_timeout_s)
        v_status, v_body, _ = self._get("/version", 5)
        version = None
        if v_status == 200:
            try:
                version = json.loads(v_body).get("version")
            except (ValueError, AttributeError):
                pass
        server = (headers or m_headers).get("server") or (headers or m_headers).get("Server")
        self.info = BackendInfo(
            backend=self.name, engine=owned_by or "openai-compatible", engine_version=version, device="remote",
            base_url=self.base_url, served_model=model, startup_s=round(time.monotonic() - t0, 3),
            notes={k: v for k, v in {"api": self.options.api, "server_header": server,
                                     "listed_models": ",".join(listed[:10]),
                                     "api_key_env": self.options.api_key_env}.items() if v})
        return self.info

    def stream(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        """The client's own event stream (no extra generator layer on the per-event path)."""
        if self.client is None:
            return _not_started()
        return self.client.stream(request)

    async def aclose(self) -> None:
        if self.client is not None:
            await self.client.aclose()

    def metrics(self) -> dict[str, Any]:
        """Prometheus counters from ``GET /metrics`` where the server exposes them."""
        status, body, _ = self._get("/metrics", 10)
        if status != 200:
            return {}

        return parse_prometheus(body)

    def tokenize(self, texts: list[str], chat: bool = False) -> list[list[int]] | None:
        """The server's own ids through its ``/tokenize`` route where it has one in vLLM's or
        SGLang's shape (:mod:`backends._tokenize`), with this backend's authorization; None,
        with the reason in ``tokenize_note``, where it has none (a hosted API, llama.cpp's
        other shape)."""

        model = self.info.served_model if self.info is not None else self.options.model
        ids, self.tokenize_note = server_tokenize(self.base_url, texts, chat=chat, model=model, headers=self._auth())
        return ids

    def stop(self) -> None:
        """Nothing to stop: the server is not ours (connections close with their event loop)."""


async def _not_started() -> AsyncIterator[TokenEvent]:
    raise EngineFailure("load-failure", "openai backend is not started")
    yield  # pragma: no cover - makes this an async generator


def load_token_counter(path: str) -> TokenCounter:
    """``text -> token count`` from a ``tokenizer.json`` (file or folder).

    Raises:
        EngineFailure: ``config-rejected`` when the file is missing or unreadable.
    """
    return TokenCounter(path)
