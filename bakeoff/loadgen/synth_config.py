"""The synthetic server's schedule and faults as pydantic specs (``--config`` JSON and the
per-request ``"synth"`` field; bakeoff/loadgen/synth_server.py describes each)."""

from __future__ import annotations

import random
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class Dist(BaseModel):
    """A delay distribution in milliseconds.

    Attributes:
        kind: ``constant`` (always ``ms``), ``normal`` (mean ``ms``, sd ``std_ms``, clipped at 0)
            or ``exponential`` (mean ``ms``).
        ms: the constant or mean, ms.
        std_ms: standard deviation for ``normal``, ms.
    """

    model_config = ConfigDict(extra="forbid")
    kind: Literal["constant", "normal", "exponential"] = "constant"
    ms: float = Field(10.0, ge=0)
    std_ms: float = Field(0.0, ge=0)

    def sample_ns(self, rng: random.Random) -> int:
        if self.kind == "constant":
            v = self.ms
        elif self.kind == "normal":
            v = max(0.0, rng.gauss(self.ms, self.std_ms))
        else:
            v = rng.expovariate(1.0 / self.ms) if self.ms > 0 else 0.0
        return int(v * 1e6)


class SynthConfig(BaseModel):
    """What the synthetic server sends (pydantic, unknown keys rejected).

    Attributes:
        model: served model name (``GET /v1/models``).
        max_model_len: the context length its ``GET /v1/models`` entry states, as vLLM's does
            (None: not stated).
        ttft: delay from request received to the first token, ms.
        itl: delay between consecutive tokens, ms (per token; a chunk of k tokens is sent
            when its last token is due).
        seed: seed of the per-request random streams (request serial is mixed in).
        output_tokens: tokens per response; None: the request's ``max_tokens``.
        tokens_per_chunk: tokens carried by one SSE event.
        reasoning_tokens: the first N tokens are reasoning (``reasoning_content`` in chat,
            ``thinking_delta`` in messages; plain text in completions).
        token_ids: send ``token_ids`` per choice (vLLM's ``return_token_ids``); ``auto``:
            when the request asks with ``return_token_ids``.
        usage: ``auto`` (chat/completions when ``stream_options.include_usage``; always in
            messages), ``always`` or ``never``.
        keepalive_ms: send an SSE comment ``: keep-alive`` this often while the first token
            is pending.
        slow_first_byte_ms: hold the response headers back this long (counts in TTFT).
        cut_after_s: close the connection this long after the request arrived (mid-event).
        cut_after_tokens: close the connection after this many tokens were sent (mid-event).
        error_rate: fraction of requests answered with ``error_status`` (seeded).
        error_status: HTTP status of those errors.
        malformed_at_token: the event carrying this token index has broken JSON.
        missing_done: end the stream without ``[DONE]`` / ``message_stop``.
        usage_delta: usage reports this many tokens more than were sent (a server whose
            accounting disagrees with its stream).
        usage_factor: usage reports the tokens sent times this (2.0: a server counting each
            token twice), before ``usage_delta`` is added.
        record: keep per-event send times (for ``/_sent`` and the log).
    """

    model_config = ConfigDict(extra="forbid")
    model: str = "synth"
    max_model_len: int | None = Field(None, ge=1)
    ttft: Dist = Field(default_factory=lambda: Dist(ms=50.0))
    itl: Dist = Field(default_factory=lambda: Dist(ms=10.0))
    seed: int = 0
    output_tokens: int | None = Field(None, ge=1)
    tokens_per_chunk: int = Field(1, ge=1)
    reasoning_tokens: int = Field(0, ge=0)
    token_ids: Literal["auto", "always", "never"] = "auto"
    usage: Literal["auto", "always", "never"] = "auto"
    keepalive_ms: float | None = Field(None, gt=0)
    slow_first_byte_ms: float = Field(0.0, ge=0)
    cut_after_s: float | None = Field(None, ge=0)
    cut_after_tokens: int | None = Field(None, ge=0)
    error_rate: float = Field(0.0, ge=0, le=1)
    error_status: int = Field(500, ge=400, le=599)
    malformed_at_token: int | None = Field(None, ge=0)
    missing_done: bool = False
    usage_delta: int = 0
    usage_factor: float = Field(1.0, ge=0)
    record: bool = True
