"""The HTTP side of a worker whose engine runs in its own process (ORT GenAI, OpenVINO GenAI).

:class:`PipeEngineProxy` is the :class:`backends._hosting.worker_server.WorkerEngine` of such a
worker: it starts the engine process (:class:`backends._hosting.engine_process.EngineProcess`), sends
it each request as a command and turns its frames (:mod:`backends._hosting.engine_frames`) into
the server's stream items. Two processes because an engine loop and the HTTP loop in one
interpreter share the GIL: a Python ``og.Generator`` loop beside the HTTP loop kept 64-106% of a
bare loop's tokens/s (``benchmarks/bench_ort_genai.py``), and OpenVINO GenAI's
``ContinuousBatchingPipeline.step()`` holds the GIL for the whole step (its binding releases
none), so the HTTP loop ran only when Python's switch interval (5 ms) forced a switch: streams
reached the client in bursts, whole 64-token streams at once (TPOT p50 0.01 ms, TTFT 38 ms against
the bare pipeline's 1.4 ms; issue 28).

The engine process sends token ids; this process detokenizes them (``tokenizers.DecodeStream``
over the ``tokenizer.json`` the engine names in its ready info, ``tokenizer_json``) when the
engine found that decoder agrees with its own, as vLLM's frontend does for its engine core;
otherwise the frames carry text. The child is in the worker's process group, so stopping the
backend stops both; the child also exits when this process closes its pipe. A client that
disconnects cancels its request in the engine; an engine process that dies fails the open
requests with its exit code, later ones at once, and ``/health`` answers 503.
"""

from __future__ import annotations

import array
import asyncio
import itertools
import os
from typing import Any

from backends._hosting.engine_process import EngineProcess
from backends._hosting.worker_server import PROMPT_TOKENS_KEY, TokenChannel


class PipeEngineProxy:
    """Requests to an engine process, its frames back as stream items.

    Args:
        argv: the engine process's command line (``--cmd-fd/--out-fd/--bell-fd`` are appended).
        poll_interval_s: how often the worker drains frames the engine did not mark urgent.
        env: the engine process's environment (default: this one's).

    Raises:
        RuntimeError: the engine process failed to load the model (its exception's words).
    """

    def __init__(self, argv: list[str], poll_interval_s: float, env: dict[str, str] | None = None):
        self.proc = EngineProcess(argv, env=dict(os.environ) if env is None else env, poll_interval_s=poll_interval_s)
        self._info = self.proc.wait_ready()
        self.hf_tokenizer = None
        if self._info.get("tokenizer_json"):
            from tokenizers import Tokenizer

            self.hf_tokenizer = Tokenizer.from_file(self._info["tokenizer_json"])
        self.ids = itertools.count()
        self.n_generated = 0
        self.n_requests = 0
        self.stats: dict[str, Any] = {}

    def info(self) -> dict[str, Any]:
        return self._info

    def metrics(self) -> dict[str, float]:
        """This process's counts and the engine's counters as its last ``end`` frame gave them."""
        return {"generated_tokens": self.n_generated, "requests": self.n_requests, **self.stats}

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Watch the engine process from the server's loop (its death shows before any request)."""
        self.proc.attach(loop)

    def healthy(self) -> str | None:
        """Why this worker cannot serve (the engine process died), or None."""
        return self.proc.dead

    def prompt_tokens(self, prompt: str) -> int:
        """Only for requests that failed before the engine counted their prompt."""
        return 0

    async def call(self, kind: str, payload: Any) -> Any:
        """One command answered by one frame: ``(kind, rid, payload)`` to the engine, the payload of
        its ``ids`` or ``ans`` frame back.

        Raises:
            RuntimeError: the engine's ``err`` frame (its words), or its process is gone.
        """
        rid = next(self.ids)
        chan = TokenChannel(asyncio.get_running_loop())
        self.proc.open(rid, chan)
        try:
            self.proc.send((kind, rid, payload))
            while True:
                for msg in await chan.get_batch():
                    if isinstance(msg, BaseException):
                        raise msg
                    if msg[0] in ("ids", "ans"):
                        return msg[2]
                    if msg[0] == "err":
                        raise RuntimeError(msg[2])
        finally:
            self.proc.close(rid)

    async def tokenize(self, prompt: str) -> list[int]:
        """The ids the engine process feeds the model for ``prompt``: its own tokenizer, the one
        its generations use, never this process's detokenizer.

        Raises:
            RuntimeError: the engine failed to encode, or its process is gone.
        """
        return array.array("i", await self.call("tokenize", prompt)).tolist()

    def make_decoder(self):
        """``ids -> text delta`` for one request, or None when the engine's frames carry text:
        ``tokenizers.DecodeStream`` over the ``tokenizer.json`` the engine named."""
        if self.hf_tokenizer is None:
            return None
        from tokenizers.decoders import DecodeStream

        stream, hf = DecodeStream(skip_special_tokens=True), self.hf_tokenizer
        return lambda ids: "".join(stream.step(hf, t) or "" for t in ids)

    async def generate(self, body: dict[str, Any]):
        rid = next(self.ids)  # frames are routed on the loop serve() attached
        chan = TokenChannel(asyncio.get_running_loop())
        self.proc.open(rid, chan)
        self.n_requests += 1
        done = False
        decode = self.make_decoder()  # None: the engine's frames carry the text
        try:
            self.proc.send(("gen", rid, body))
            while True:
                # Frames that arrived while the previous event was written go out as one
                # SSE event, token_ids listing each token; counts stay exact.
                ids: list[int] = []
                text = ""
                lps: list = []
                for msg in await chan.get_batch():
                    if isinstance(msg, BaseException):
                        raise msg
                    kind = msg[0]
                    if kind == "tok":
                        new = array.array("i", msg[2]).tolist()  # raw int32 token ids
                        ids += new
                        text += msg[3] if msg[3] is not None else decode(new)
                        self.n_generated += len(new)
                        if len(msg) > 4:
                            lps += msg[4]
                    elif kind == "start":
                        body[PROMPT_TOKENS_KEY] = msg[2]
                    elif kind == "end":
                        done = True
                        self.stats.update(msg[3])
                        if ids:
                            yield (ids, text, None, lps) if lps else (ids, text, None)
                        yield ([], "", msg[2])
                        return
                    elif kind == "err":
                        done = True
                        if ids:  # what was generated before the failure still goes out
                            yield (ids, text, None)
                        raise RuntimeError(msg[2])
                if ids:
                    yield (ids, text, None, lps) if lps else (ids, text, None)
        finally:
            self.proc.close(rid)
            if not done and not self.proc.dead:  # the client went away: stop generating for it
                try:
                    self.proc.send(("cancel", rid))
                except RuntimeError:
                    pass
