"""Per-request output of the ORT GenAI engine process: frames, and the detokenizer used there.

Split from :mod:`backends.ort_genai.engine`.

Commands (worker to engine): ``("gen", rid, body)``, ``("cancel", rid)``, ``("tokenize", rid, text)``
(answered ``("ids", rid, int32 id bytes)`` by the main thread, with generation's tokenizer). Frames (engine to
worker): ``("start", rid, n_prompt_tokens)``, ``("tok", rid, int32 token id bytes, text)``,
``("end", rid, finish_reason, stats)``, ``("err", rid, message)``; a request that asks for
``logprobs`` runs alone on ``og.Generator`` and its ``"tok"`` frames carry a fifth item,
``[(logprob, [(id, logprob), ...top k])]`` per id.
"""

from __future__ import annotations

import array
import time
from typing import Any


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


class Out:
    """One request's frames to the worker.

    The engine loop only appends each step's token id and calls :meth:`due`; the generator
    loop only counts its steps and, when a frame is due, slices the new ids out of
    ``get_sequence(0)`` for :meth:`send_ids`. Framing (and detokenizing, where the worker
    process does not) happens once per frame, for all its tokens at once. Python run between
    two ~0.4 ms og steps runs on cold caches, several times slower than a hot microbenchmark
    of the same calls: with a token list, a method call and a detokenizer step per token the
    generator loop spent 19-21 us/step of its own on the 2-core host (the bare loop: 1 us);
    laid out like this, 1.7 us/step more than the bare loop on the H200 host's CPU
    (``benchmarks/bench_ort_genai.py``, in-run split).

    A flush rings the worker's doorbell when its token is the stream's first (TTFT is never
    held) or follows the previous token by at least ``interval_s`` (a sparse stream: each
    token is an event of its own). Tokens of a dense stream leave in one frame per
    ``interval_s`` without a doorbell; the worker's timer, same period, picks them up, so they
    reach the client within two intervals, each listed in ``token_ids``. ``interval_s`` 0:
    every token rings.
    """

    __slots__ = ("send", "rid", "interval_s", "decoder", "pending", "last_flush", "last_token", "last_id")

    def __init__(self, send, rid: Any, interval_s: float, decoder: Decoder | None = None):
        self.send, self.rid, self.interval_s, self.decoder = send, rid, interval_s, decoder
        self.pending: list = []
        self.last_flush = self.last_token = float("-inf")
        self.last_id: int | None = None

    def start(self, n_prompt: int) -> None:
        self.send(("start", self.rid, n_prompt), False)

    def due(self, now: float) -> bool:
        """After appending a token to :attr:`pending`: flush if its time has come; True if flushed."""
        prev, self.last_token = self.last_token, now
        if now - prev >= self.interval_s:
            self.flush(now, True)
            return True
        if now - self.last_flush >= self.interval_s:
            self.flush(now, False)
            return True
        return False

    def flush(self, now: float, urgent: bool) -> None:
        """Send the pending token ids (``og.Engine`` events' ints)."""
        if self.pending:
            raw = array.array("i", self.pending).tobytes()
            self.pending.clear()
            self.send_ids(raw, now, urgent)

    def send_ids(self, raw: bytes, now: float, urgent: bool, logprobs: list | None = None) -> None:
        """Send token ids given as raw int32 bytes (cheaper to pickle than a list of ints),
        with ``(logprob, [(id, logprob)...])`` per id when the request asked for logprobs."""
        text = None
        if self.decoder is not None:
            text = "".join(map(self.decoder.push, array.array("i", raw)))
        self.send(("tok", self.rid, raw, text) if logprobs is None else ("tok", self.rid, raw, text, logprobs), urgent)
        self.last_flush, self.last_id = now, int.from_bytes(raw[-4:], "little", signed=True)

    def finish(self, reason: str, stats: dict[str, Any]) -> None:
        self.flush(time.perf_counter(), False)
        self.send(("end", self.rid, reason, stats))

    def fail(self, exc: BaseException) -> None:
        self.flush(time.perf_counter(), False)
        self.send(("err", self.rid, f"{type(exc).__name__}: {exc}"))


# A command body that asks for the engine's ids of a text (``body[TOKENIZE]``), not a generation.
TOKENIZE = "_bakeoff_tokenize"


def answer_tokenize(engine: Any, send, rid: Any, text: str) -> None:
    """Send ``("ids", rid, int32 id bytes)``: ``engine.encode(text)``, the ids its generations
    start from (og.Tokenizer, or the ``tokenizer.json`` fallback the engine chose at load), or
    ``("err", rid, message)``."""
    try:
        send(("ids", rid, array.array("i", engine.encode(text)).tobytes()))
    except Exception as exc:  # noqa: BLE001 - the worker answers it as an engine error
        send(("err", rid, f"{type(exc).__name__}: {exc}"))


class Collect:
    """A sink that keeps what a request produced (the Engine warm-up)."""

    def __init__(self) -> None:
        self.result: str | BaseException | None = None
        self.pending: list = []

    def start(self, n_prompt: int) -> None:
        pass

    def due(self, now: float) -> bool:
        self.pending.clear()
        return False

    def finish(self, reason: str, stats: dict[str, Any]) -> None:
        self.result = reason

    def fail(self, exc: BaseException) -> None:
        self.result = exc


def finish_name(og, reason) -> str:
    """The OpenAI ``finish_reason`` for an ``og.FinishReason``."""
    names = {og.FinishReason.EOS: "stop", og.FinishReason.STOP_STRING: "stop",
             og.FinishReason.MAX_GENERATED_TOKENS: "length", og.FinishReason.MAX_SESSION_TOKENS: "length",
             og.FinishReason.CANCELLED: "abort"}
    return names.get(reason, str(reason.name).lower())
