"""An engine process's frames to its worker: the protocol and one request's output (:class:`Out`).

Shared by the engine processes of :mod:`backends.ort_genai.engine` and
:mod:`backends.openvino.engine`, whose HTTP side is :class:`backends._hosting.engine_proxy.PipeEngineProxy`;
frames travel over :mod:`backends._hosting.worker_pipe`.

Commands (worker to engine): ``("gen", rid, body)`` (the completions request body),
``("cancel", rid)``, ``("tokenize", rid, text)`` (answered ``("ids", rid, int32 id bytes)`` with
generation's own tokenizer). Frames (engine to worker): ``("start", rid, n_prompt_tokens)``,
``("tok", rid, int32 token id bytes, text)`` (text None when the worker detokenizes), ``("end",
rid, finish_reason, stats)`` (stats: the engine's counters, merged into the worker's ``/metrics``),
``("err", rid, message)``; a request that asks for ``logprobs`` gets ``"tok"`` frames with a fifth
item, ``[(logprob, [(id, logprob), ...top k])]`` per id.

Standard library only (it runs in the engines' environments).
"""

from __future__ import annotations

import array
import os
import queue
import sys
import threading
import time
from typing import Any


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
    ``interval_s`` not marked urgent: the pipe rings for one when no bell rang in the last
    ``LAZY_BELL_S`` and the worker checks again soon after any drain that found frames
    (:mod:`backends._hosting.worker_pipe`), so they reach the client within about two
    intervals, each listed in ``token_ids``. ``interval_s`` 0: every token rings. An engine
    loop that serves many streams sends a step's frames inside ``ChildPipe.batch()``: one
    write, one doorbell.
    """

    __slots__ = ("send", "rid", "interval_s", "decoder", "pending", "last_flush", "last_token", "last_id")

    def __init__(self, send, rid: Any, interval_s: float, decoder: Any = None):  # decoder: .push(id) -> text
        self.send, self.rid, self.interval_s, self.decoder = send, rid, interval_s, decoder
        self.pending: list = []
        self.last_flush = self.last_token = float("-inf")
        self.last_id: int | None = None

    def start(self, n_prompt: int) -> None:
        self.send(("start", self.rid, n_prompt), False)

    def due(self, now: float) -> bool:
        """After appending a token to :attr:`pending`: flush if its time has come; True if flushed."""
        prev, self.last_token = self.last_token, now
        urgent = now - prev >= self.interval_s
        if not urgent and now - self.last_flush < self.interval_s:
            return False
        pending = self.pending
        if pending and self.decoder is None:  # flush + send_ids inlined: this runs per token per step
            raw, last = array.array("i", pending).tobytes(), pending[-1]
            pending.clear()
            self.send(("tok", self.rid, raw, None), urgent)
            self.last_flush, self.last_id = now, last
        else:
            self.flush(now, urgent)
        return True

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


class StepFramer:
    """Frames of an engine's steps made on a thread of their own, beside the engine's next step.

    For an engine loop whose step call releases the GIL (``og.Engine.run`` does: a Python
    thread spinning beside it on this project's CPU host ran 21 M loops in 100 steps). The
    decode thread only reads each step's events into ``(out, token)`` pairs and ends, and hands
    them over with :meth:`put`; this thread appends and flushes them (:meth:`Out.due`) and writes
    the step's frames as one (``batch()``) while the engine computes the next step. On the H200
    (Qwen3-1.7B shape, 32 streams, ~3.3 ms per step) framing on the decode thread cost ~0.25 ms of
    each step: bakeoff 0.90 of the bare og.Engine loop's tokens/s (2026-12-04).

    Per stream the order holds: a stream's tokens of a step are handed over before its end, its
    ``start`` frame was written at admission, before any step produced a token for it.

    Args:
        batch: the pipe's ``batch`` context manager (:meth:`backends._hosting.worker_pipe.ChildPipe.batch`).
    """

    def __init__(self, batch) -> None:
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.batch = batch
        threading.Thread(target=self._run, daemon=True, name="engine-frames").start()

    def put(self, now: float, tokens: list, ends: list, stats: dict[str, Any] | None) -> None:
        """One step's output: ``tokens`` ``[(out, id)]`` at ``now``, then ``ends``
        ``[(out, finish_reason or None, exception or None)]`` with ``stats`` for the end frames."""
        self.queue.put((now, tokens, ends, stats))

    def _run(self) -> None:
        get, batch = self.queue.get, self.batch
        while True:
            item = get()
            try:
                with batch():
                    emit(*item)
            except BrokenPipeError:  # the worker is gone: so is this process (as the decode thread's)
                os._exit(0)
            except Exception as exc:  # noqa: BLE001 - the step's streams end with the error, the engine goes on
                print(f"engine frames: {exc!r}", file=sys.stderr, flush=True)
                self._fail_streams(item, exc)

    @staticmethod
    def _fail_streams(item: tuple, exc: BaseException) -> None:
        """End every stream of a step whose frames could not be made with an error frame (its
        client gets a failed request with the reason, not a stream that stops without an end)."""
        _now, tokens, ends, _stats = item
        outs = {id(o): o for o, _t in tokens} | {id(o): o for o, _r, _e in ends}
        for out in outs.values():
            try:
                out.fail(RuntimeError(f"the engine process could not frame this stream's tokens: {exc!r}"))
            except Exception:  # noqa: BLE001 - the pipe itself is broken: the worker sees the process end
                pass


def emit(now: float, tokens: list, ends: list, stats: dict[str, Any] | None) -> None:
    """Send one step's output (:meth:`StepFramer.put`'s arguments) from the calling thread."""
    for out, token in tokens:
        out.pending.append(token)
        out.due(now)
    for out, reason, exc in ends:
        if exc is not None:
            out.fail(exc)
        else:
            out.finish(reason, stats)


# A command body that asks for the engine's ids of a text (``body[TOKENIZE]``), not a generation.
TOKENIZE = "_bakeoff_tokenize"


def answer_tokenize(engine: Any, send, rid: Any, text: str) -> None:
    """Send ``("ids", rid, int32 id bytes)``: ``engine.encode(text)``, the ids its generations
    start from, or ``("err", rid, message)``."""
    try:
        send(("ids", rid, array.array("i", engine.encode(text)).tobytes()))
    except Exception as exc:  # noqa: BLE001 - the worker answers it as an engine error
        send(("err", rid, f"{type(exc).__name__}: {exc}"))
