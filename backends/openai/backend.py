"""``openai`` backend: any running OpenAI-compatible (or Anthropic Messages) server, by URL.

Nothing is launched and nothing is stopped: ``probe()`` checks that the server answers as an
OpenAI-compatible API (``GET /health``, else ``GET /v1/models``; an HTML page is not one),
``start()`` learns the served model name; ``stop()`` leaves the remote server alone. Every
request (generations, ``/v1/models``, ``/health``, ``/tokenize``, ``/metrics``) honours
``read_timeout_s``: a stall is ``hang`` with the elapsed time, except a generation while the server's
``/metrics`` token counters advance, where it has them (slow, not hung: docs/design.md "Failure classes";
``BackendInfo.notes["progress"]`` says which rule applies). Streaming goes through
:class:`bakeoff.loadgen.client.OpenAIClient` (per-event arrival stamps, reasoning/thinking deltas counted
apart from text).

The API key is read from the environment variable *named* by ``api_key_env`` at request
time; the key itself is never written to a spec, a log or an artifact.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from backends.base import Backend
from bakeoff.loadgen.side_http import error_body, open_bounded
from bakeoff.api.errors import EngineFailure
from bakeoff.loadgen.accounting import TokenCounter
from bakeoff.loadgen.client import NEUTRAL_ANY, NEUTRAL_LLAMACPP, NEUTRAL_VLLM, OpenAIClient
from bakeoff.loadgen.progress import Progress
from bakeoff.api.specs import BackendInfo, GenerationRequest, TokenEvent
from backends._server import parse_prometheus
from backends.openai import served
from backends.openai.options import OpenAIOptions
from backends._tokenize import server_tokenize, timed_out


# Counters on a server's /metrics that advance while its engine works (prefill, decode, steps):
# vLLM's names (counters end in _total on the wire; the step histogram's _count), which SGLang and
# TensorRT-LLM reuse under their own prefixes.
PROGRESS_COUNTERS = (":prompt_tokens_total", ":generation_tokens_total", ":iteration_tokens_total_count")


# A server that answers 5xx other than 503 on both probe routes this long is up and failing, not starting
# (a starting server refuses connections, or answers 503 while it loads, as llama.cpp's server does: those
# wait for the start deadline).
PROBE_5XX_S = 30.0


class OpenAIBackend(Backend):
    """A running server reached over HTTP; see the module docstring."""

    name = "openai"
    Options = OpenAIOptions
    attaches = True  # nothing launched: the reference is computed when a check asks for it

    def __init__(self, config):
        super().__init__(config)
        self.client: OpenAIClient | None = None
        # the client-side token count of --backend-opt tokenizer=DIR (bakeoff/loadgen/accounting.py)
        self.count_tokens: Callable[[str], int] | None = None
        self.api = self.options.api
        self._probed: tuple[Answer, Answer] | None = None  # (GET /health, GET /v1/models) of probe()
        self._metrics_hung: EngineFailure | None = None  # GET /metrics got no byte within the read timeout
        self.base_url = self.options.base_url.rstrip("/")
        if self.base_url.endswith("/v1"):
            self.base_url = self.base_url[:-3]

    def _get(self, path: str, timeout_s: float | None = None) -> Answer:
        """GET ``path`` with no longer than ``read_timeout_s`` (``timeout_s`` only shortens it)."""
        timeout_s = min(timeout_s or self.options.read_timeout_s, self.options.read_timeout_s)
        req = urllib.request.Request(self.base_url + path, headers=self._auth())
        t0 = time.monotonic()
        try:  # no redirect followed (the key stays with its origin), the body bounded (side_http)
            status, body, headers = open_bounded(req, timeout_s)
            return Answer(path, status, body.decode("utf-8", "replace"), headers, time.monotonic() - t0)
        except urllib.error.HTTPError as exc:
            return Answer(path, exc.code, error_body(exc, timeout_s), dict(exc.headers or {}), time.monotonic() - t0)
        except (urllib.error.URLError, OSError, TimeoutError) as exc:
            return Answer(path, 0, f"{type(exc).__name__}: {getattr(exc, 'reason', None) or exc}", {},
                          time.monotonic() - t0, timed_out(exc), timeout_s)

    def _auth(self) -> dict[str, str]:
        key = os.environ.get(self.options.api_key_env) if self.options.api_key_env else None
        if not key:
            return {}
        return {"x-api-key": key, "anthropic-version": "2023-06-01"} if self.options.api == "messages" \
            else {"Authorization": f"Bearer {key}"}

    def probe(self) -> None:
        """Whether a server answers at ``base_url`` as an OpenAI-compatible one: ``GET /health``
        and ``GET /v1/models``, each within ``read_timeout_s`` (at most 10 s), retried until
        one answers 200 or the start deadline passes. Cheap: the evaluations run it before any
        reference work, so that a dead port is told at once.

        Raises:
            EngineFailure: ``load-failure`` when nothing listens (connection refused for 2 s)
                or when the server answers HTML, not JSON (a login page, a web application on
                the port; the first bytes in ``probe.txt``); ``hang`` when it accepts connections
                but sends no byte on either route within the read timeout; ``load-failure``
                when neither answers 200 before the start deadline.
        """
        t0 = time.monotonic()
        deadline = t0 + self.config.start_timeout_s
        while True:
            health, models = self._get("/health", 10), self._get("/v1/models", 10)
            evidence = {"probe.txt": f"{health.describe()}\n\n{models.describe()}"}
            html = self._html_failure(health, models, evidence)
            if html is not None:
                raise html
            if health.status == 200 or models.status == 200:
                self._probed = (health, models)
                return
            failure = self._probe_failure(health, models, time.monotonic() - t0, evidence)
            if failure is not None:
                raise failure
            if time.monotonic() > deadline:
                raise EngineFailure("load-failure", f"server at {self.base_url} does not answer: /health "
                                    f"{health.status or health.body}, /v1/models {models.status or models.body}", evidence)
            time.sleep(0.5)

    def _html_failure(self, health, models, evidence: dict) -> EngineFailure | None:
        """``load-failure`` when the server answered HTML where JSON was asked (:meth:`probe`)."""
        # HTML where JSON was asked, and no route answered 200 in anything else (a server whose
        # /v1/models is a proxy's HTML 404 beside a JSON /health is still an API)
        html = next((a for a in (models, health) if a.is_html()), None)
        if html is not None and not any(a.status == 200 and not a.is_html() for a in (health, models)):
            return EngineFailure("load-failure", f"the server at {self.base_url} answered HTML, not JSON (Content-Type "
                                 f"{html.content_type() or 'none'}) on GET {html.path}: {html.first_bytes(80)!r}; "
                                 "it is not an OpenAI-compatible API (a login page or a web application?): "
                                 "check --backend-opt base_url", evidence)
        return None

    def _probe_failure(self, health, models, probed_s: float, evidence: dict) -> EngineFailure | None:
        """Why a probe that got no 200 ends now (a redirect, a server up and failing, one that sends
        nothing, nothing listening), or None to probe again (:meth:`probe`)."""
        if all(300 <= a.status < 400 for a in (health, models)):  # a redirect never turns into an answer
            return EngineFailure("config-rejected", f"the server at {self.base_url} redirects: GET /health: "
                                 f"{health.body[:200]}; GET /v1/models: {models.body[:200]}", evidence)
        failing = all(a.status >= 500 and a.status != 503 for a in (health, models))  # 503: loading, say llama.cpp
        if failing and probed_s > PROBE_5XX_S:
            return EngineFailure("load-failure", f"the server at {self.base_url} answered GET /health "
                                 f"{health.status} and GET /v1/models {models.status} for {PROBE_5XX_S:g} s: it "
                                 f"is up and failing (/health: {health.body[:200]!r})", evidence)
        if health.timed_out and models.timed_out:
            return EngineFailure("hang", f"the server at {self.base_url} accepts connections but sent no byte on "
                                 f"GET /health nor GET /v1/models within {health.timeout_s:g} s (read_timeout_s); "
                                 f"probed for {probed_s:.1f} s", evidence)
        refused = health.status == 0 and models.status == 0  # nothing listens: an attached server should
        if refused and probed_s > 2:
            return EngineFailure("load-failure", f"nothing answers at {self.base_url}: the server does not answer "
                                 f"GET /health nor GET /v1/models ({health.body}) for 2 s; start it, or fix "
                                 "--backend-opt base_url", evidence)
        return None

    def start(self) -> BackendInfo:
        """Check the server answers (:meth:`probe`, unless done) and learn its model name.

        Raises:
            EngineFailure: what :meth:`probe` raises; ``config-rejected`` when no model name
                is given and ``/v1/models`` lists none.
        """
        t0 = time.monotonic()
        if self._probed is None:
            self.probe()
        health, models = self._probed
        models = self._models_once_more(models)
        data, listed, owned_by = served.models_listing(models)
        model = self.options.model or (listed[0] if listed else None)
        max_len = self.options.max_model_len or served.stated_max_len(data, model)
        if model is None:
            raise EngineFailure("config-rejected", f"no model name given and GET {self.base_url}/v1/models lists none "
                                f"(status {models.status}); pass --backend-opt model=NAME",
                                {"models.txt": models.body[:2000]})
        if self.options.tokenizer:
            self.count_tokens = load_token_counter(self.options.tokenizer)
        progress, progress_note = self._metrics_progress()
        timeout_s = self.options.read_timeout_s
        greedy, greedy_why = self._greedy(owned_by)
        self.client = OpenAIClient(self.base_url, model, api=self.options.api, api_key_env=self.options.api_key_env,
                                   extra_body=self.options.extra_body, read_timeout_s=timeout_s, progress=progress,
                                   deadline_s=self.config.request_deadline_factor * timeout_s, greedy_body=greedy)
        version_answer = self._get("/version", 5)  # optional: a server without it (or stalling on it) has no version
        version = served.served_version(version_answer)
        self.info = BackendInfo(
            backend=self.name, engine=owned_by or "openai-compatible", engine_version=version, device="remote",
            base_url=self.base_url, served_model=model, startup_s=round(time.monotonic() - t0, 3), max_model_len=max_len,
            notes=served.info_notes(self.options, served.server_header(health, models), listed, greedy, greedy_why,
                                    progress_note, max_len, version_answer))
        return self.info

    def _models_once_more(self, models: Answer) -> Answer:
        """The probe's ``GET /v1/models``, asked once more when it got no answer (a dropped
        connection) and no model name is given.

        Raises:
            EngineFailure: ``hang`` (no byte within the read timeout) or ``load-failure`` when
                the second GET gets no answer either.
        """
        if models.status != 0 or self.options.model:
            return models
        models = self._get("/v1/models", 10)
        if models.status == 0:
            raise EngineFailure("hang" if models.timed_out else "load-failure",
                                f"GET {self.base_url}/v1/models got no answer twice ({models.body}): "
                                "the model name cannot be learned; pass --backend-opt model=NAME or fix the server",
                                {"models.txt": models.body[:2000]})
        return models

    def _greedy(self, owned_by: str | None) -> tuple[dict[str, Any], str]:
        """The neutral fields of a greedy request and why: the user's ``greedy_body``, else by dialect."""
        if self.options.greedy_body is not None:
            return self.options.greedy_body, "--backend-opt greedy_body"
        return greedy_fields(owned_by)

    def _metrics_progress(self) -> tuple[Progress | None, str]:
        """The hang rule's reading of a server bakeoff did not launch (no process group to read):
        the sum of its engine's token and step counters on ``GET /metrics`` (:data:`PROGRESS_COUNTERS`;
        vLLM's, and SGLang's or TensorRT-LLM's of the same names), any advance counting as progress,
        where the server exposes them; else None: a request with no byte for ``read_timeout_s`` is a
        ``hang`` as before. Returns the reading and a note saying which."""
        timeout_s = min(5.0, self.options.read_timeout_s)

        def read() -> float | None:
            answer = self._get("/metrics", timeout_s)
            if answer.status != 200:
                return None
            found = [v for k, v in parse_prometheus(answer.body).items() if k.split("{")[0].endswith(PROGRESS_COUNTERS)]
            return sum(found) if found else None

        if read() is None:
            return None, ("none: GET /metrics shows no token counters, so a request with no byte for read_timeout_s "
                          "is a hang (not checked against the engine's progress)")
        return (Progress(read, "tokens", 0.0, f"GET {self.base_url}/metrics token and step counters"),
                "GET /metrics token and step counters: a silent request waits while they advance")

    def stream(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        """The client's own event stream (no extra generator layer on the per-event path).
        Once a stream got no byte within ``read_timeout_s``, later requests fail at once as
        ``hang`` naming it (the server is wedged: each would wait the timeout again); once one
        was still sending at its time bound (:func:`bakeoff.loadgen.client.stream_bounds`), as
        ``protocol-violation`` naming it (a trickle of 240 probes took 10 min of bounds)."""
        if self.client is None:
            return _failing(EngineFailure("load-failure", "openai backend is not started"))
        if self.client.hung is not None:
            return _failing(EngineFailure("hang", f"engine hung earlier: {self.client.hung.message}",
                                          dict(self.client.hung.evidence)))
        if self.client.overran is not None:  # each later stream would take the whole bound again
            return _failing(EngineFailure("protocol-violation", f"not sent: an earlier stream ran past its time bound: "
                                          f"{self.client.overran.message}", dict(self.client.overran.evidence)))
        return self.client.stream(request)

    async def aclose(self) -> None:
        if self.client is not None:
            await self.client.aclose()

    def metrics(self) -> dict[str, Any]:
        """Prometheus counters from ``GET /metrics`` where the server exposes them.

        Raises:
            EngineFailure: ``hang`` when the server sends no byte within ``read_timeout_s``, and
                at once when it did so before on ``/metrics`` or on a generation.
        """
        earlier = self._metrics_hung or (self.client.hung if self.client is not None else None)
        if earlier is not None:  # a wedged server: each read would wait the timeout again
            raise EngineFailure("hang", f"engine hung earlier: {earlier.message}", dict(earlier.evidence))
        answer = self._get("/metrics")
        if answer.timed_out:
            self._metrics_hung = EngineFailure(
                "hang", f"GET {self.base_url}/metrics: no byte for {answer.timeout_s:g} s (read_timeout_s); the request "
                f"was open {answer.elapsed_s:.1f} s", {"hang.json": json.dumps({
                    "request": "GET /metrics", "elapsed_s": round(answer.elapsed_s, 3), "read_timeout_s": answer.timeout_s})})
            raise self._metrics_hung
        return parse_prometheus(answer.body) if answer.status == 200 else {}

    def tokenize(self, texts: list[str], chat: bool = False) -> list[list[int]] | None:
        """The server's own ids through its ``/tokenize`` route where it has one in vLLM's or
        SGLang's shape (:mod:`backends._tokenize`), with this backend's authorization; None,
        with the reason in ``tokenize_note``, where it has none (a hosted API, llama.cpp's
        other shape)."""

        model = self.info.served_model if self.info is not None else self.options.model
        ids, self.tokenize_note = server_tokenize(self.base_url, texts, chat=chat, model=model, headers=self._auth(),
                                                  timeout_s=self.options.read_timeout_s)
        return ids

    def stop(self) -> None:
        """Nothing to stop: the server is not ours (connections close with their event loop)."""


async def _failing(exc: EngineFailure) -> AsyncIterator[TokenEvent]:
    raise exc
    yield  # pragma: no cover - makes this an async generator


@dataclass
class Answer:
    """One GET of the server: ``status`` 0 when it could not be read (``timed_out``: no byte
    within ``timeout_s``), ``elapsed_s`` how long it took."""

    path: str
    status: int
    body: str
    headers: dict[str, str]
    elapsed_s: float
    timed_out: bool = False
    timeout_s: float | None = None

    def content_type(self) -> str:
        return next((v for k, v in self.headers.items() if k.lower() == "content-type"), "").split(";")[0].strip()

    def first_bytes(self, n: int) -> str:
        return self.body[:n]

    def is_html(self) -> bool:
        """An HTML page where JSON (or an empty ``/health``) was asked for."""
        ctype = self.content_type().lower()
        return ctype in ("text/html", "application/xhtml+xml") or (
            not ctype.endswith("json") and self.body.lstrip()[:15].lower().startswith(("<!doctype html", "<html")))

    def describe(self) -> str:
        state = (f"no byte within {self.timeout_s:g} s" if self.timed_out else f"status {self.status}")
        return (f"GET {self.path}: {state} after {self.elapsed_s:.2f} s, Content-Type {self.content_type() or 'none'}\n"
                f"first bytes: {self.body[:500]!r}")


def greedy_fields(owned_by: str | None) -> tuple[dict[str, Any], str]:
    """The neutral sampling fields a greedy request carries to a server whose ``/v1/models`` entry
    is ``owned_by`` it, and why: vLLM's and SGLang's dialect, llama.cpp's (llama-server says
    ``llamacpp``), or both for any other (llama-cpp-python's server says ``me``; a server ignores
    fields it lacks, and its default repeat_penalty of 1.1 is what a greedy probe must not get)."""
    owner = (owned_by or "").lower()
    if owner in ("vllm", "sglang"):
        return dict(NEUTRAL_VLLM), f"{owned_by}'s dialect, from GET /v1/models owned_by"
    if owner == "llamacpp":
        return dict(NEUTRAL_LLAMACPP), "llama.cpp's dialect, from GET /v1/models owned_by"
    return dict(NEUTRAL_ANY), (f"every dialect's: GET /v1/models owned_by {owned_by!r} names none bakeoff knows"
                               if owned_by else "every dialect's: GET /v1/models names no owner")


def load_token_counter(path: str) -> TokenCounter:
    """``text -> token count`` from a ``tokenizer.json`` (file or folder).

    Raises:
        EngineFailure: ``config-rejected`` when the file is missing or unreadable.
    """
    return TokenCounter(path)
