"""Per-request output of the ORT GenAI engine process: the detokenizer used there.

Split from :mod:`backends.ort_genai.engine`. The frames and commands between the engine process
and the worker, and one request's :class:`Out`, are shared with OpenVINO's engine process:
:mod:`backends._hosting.engine_frames` (re-exported here). A request that asks for ``logprobs``
runs on ``og.Generator`` (:mod:`backends.ort_genai.generator_batch`; for a paged export, the
graph session).
"""

from __future__ import annotations

from typing import Any

from backends._hosting.engine_frames import TOKENIZE, Out, answer_tokenize  # noqa: F401 - re-exported


class Decoder:
    """Incremental detokenizer: ``og.TokenizerStream`` or a cumulative ``tokenizers`` decode."""

    def __init__(self, owner: Any):  # an OrtGenaiEngine
        self.owner = owner
        self.stream = owner.tokenizer.create_stream() if owner.og_tokenizer else None
        self.ids: list[int] = []
        self.text = ""

    def push(self, token: int) -> str:
        if token in self.owner.eos_ids:
            return ""
        if self.stream is not None:
            return self.stream.decode(token)
        self.ids.append(token)
        text = self.owner.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # incomplete multi-byte character: wait for more
            return ""
        delta, self.text = text[len(self.text):], text
        return delta


def finish_name(og, reason) -> str:
    """The OpenAI ``finish_reason`` for an ``og.FinishReason``."""
    names = {og.FinishReason.EOS: "stop", og.FinishReason.STOP_STRING: "stop",
             og.FinishReason.MAX_GENERATED_TOKENS: "length", og.FinishReason.MAX_SESSION_TOKENS: "length",
             og.FinishReason.CANCELLED: "abort"}
    return names.get(reason, str(reason.name).lower())
