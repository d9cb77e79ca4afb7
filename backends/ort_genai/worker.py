"""Worker process: ONNX Runtime GenAI behind the OpenAI completions API.

Runs in the ``ort-genai`` environment (``adapters.ort_genai_export.env``) as ``python -m
backends.ort_genai.worker --model EXPORT_DIR --port P --ready-file F --options JSON``. This
process serves HTTP (:mod:`backends._hosting.worker_server`); the model runs in a child process,
:mod:`backends.ort_genai.engine`, and the two exchange :mod:`backends._hosting.worker_pipe` frames.
Two processes because an engine thread and the HTTP loop in one interpreter share the GIL:
there the worker kept 64-106% of a bare ``og.Generator`` loop's tokens/s on a tiny model,
varying with every event written (``benchmarks/bench_ort_genai.py``). The engine process
sends token ids; this process detokenizes them (``tokenizers.DecodeStream``) when the engine
found that decoder agrees with its own, as vLLM's frontend does for its engine core. The
child is in the worker's process group, so stopping the backend stops both; the child also
exits when this process closes its pipe. A client that disconnects cancels its request in
the engine; an engine process that dies fails the open requests with its exit code, later
ones at once, and ``/health`` answers 503.
"""

from __future__ import annotations

import array
import asyncio
import itertools
import json
import os
import sys
from typing import Any

from backends._hosting.worker_pipe import EngineProcess
from backends._hosting.worker_server import PROMPT_TOKENS_KEY, TokenChannel


class OrtGenaiProxy:
    """The :class:`backends._hosting.worker_server.WorkerEngine` of this worker: requests go to the engine process.

    Args:
        model_dir: export folder.
        options: passed to :class:`backends.ort_genai.engine.OrtGenaiEngine` unchanged.

    Raises:
        RuntimeError: the engine process failed to load the model (its exception's words).
    """

    def __init__(self, model_dir: str, options: dict[str, Any]):
        argv = [sys.executable, "-m", "backends.ort_genai.engine", "--model", model_dir,
                "--options", json.dumps(options)]
        interval_s = float(options.get("stream_interval_ms") or 0) / 1000
        self.proc = EngineProcess(argv, env=dict(os.environ), poll_interval_s=interval_s or 0.002)
        self._info = self.proc.wait_ready()
        self.hf_tokenizer = None
        if self._info.get("tokenizer_json"):
            from tokenizers import Tokenizer

            self.hf_tokenizer = Tokenizer.from_file(self._info["tokenizer_json"])
        self.ids = itertools.count()
        self.n_generated = 0
        self.n_requests = 0
        self.stats: dict[str, Any] = {"max_running_requests": 0, "engine_seeds_honoured": 1}

    def info(self) -> dict[str, Any]:
        return self._info

    def metrics(self) -> dict[str, float]:
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

    async def tokenize(self, prompt: str) -> list[int]:
        """The ids the engine process feeds the model for ``prompt``: its own tokenizer, the one
        its generations use (og.Tokenizer, or the ``tokenizer.json`` fallback it chose at load;
        ``engine.py`` ``OrtGenaiEngine.encode``), never this process's detokenizer.

        Raises:
            RuntimeError: the engine failed to encode, or its process is gone.
        """
        rid = next(self.ids)
        chan = TokenChannel(asyncio.get_running_loop())
        self.proc.open(rid, chan)
        try:
            self.proc.send(("tokenize", rid, prompt))
            while True:
                for msg in await chan.get_batch():
                    if isinstance(msg, BaseException):
                        raise msg
                    if msg[0] == "ids":
                        return array.array("i", msg[2]).tolist()
                    if msg[0] == "err":
                        raise RuntimeError(msg[2])
        finally:
            self.proc.close(rid)

    async def generate(self, body: dict[str, Any]):
        rid = next(self.ids)  # frames are routed on the loop serve() attached
        chan = TokenChannel(asyncio.get_running_loop())
        self.proc.open(rid, chan)
        self.n_requests += 1
        done = False
        decode = None
        if self.hf_tokenizer is not None:  # the engine sends ids only; text is made here
            from tokenizers.decoders import DecodeStream

            stream, hf = DecodeStream(skip_special_tokens=True), self.hf_tokenizer
            decode = lambda ids: "".join(stream.step(hf, t) or "" for t in ids)
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


def main() -> None:
    from backends._hosting.worker_server import serve

    serve(lambda args: OrtGenaiProxy(args.model, args.options))


if __name__ == "__main__":
    main()
