"""Worker process: transformers ``generate`` behind the OpenAI completions API.

Runs in bakeoff's own environment (torch + transformers) as ``python -m backends.transformers.worker
--model M --port P --ready-file F [--options JSON]``. This process serves HTTP
(:mod:`backends._hosting.worker_server`); the model runs in a child process,
:mod:`backends.transformers.engine` (why, and its two modes: one ``generate`` at a time, the
reference, or transformers' continuous batching manager), and the two exchange
:mod:`backends._hosting.engine_frames` frames (:class:`backends._hosting.engine_proxy.PipeEngineProxy`).
Text is made here from the engine's ids, as the reference always made it
(:class:`CumulativeText`); ``/v1/score`` goes to the engine process.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from backends._hosting.engine_proxy import PipeEngineProxy
from backends._hosting.worker_server import serve


class CumulativeText:
    """Text deltas of one stream: ``tokenizer.decode`` of every id so far (special tokens skipped),
    less what was already sent; held back while the text ends in U+FFFD (an incomplete
    multi-byte character)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.ids, self.text = tokenizer, [], ""

    def __call__(self, new: list[int]) -> str:
        self.ids.extend(new)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return ""
        delta, self.text = text[len(self.text):], text
        return delta


class TransformersProxy(PipeEngineProxy):
    """The :class:`backends._hosting.worker_server.WorkerEngine` of this worker.

    Args:
        model_path: checkpoint folder or hub id (its tokenizer decodes here).
        options: passed to the engine process unchanged.
        engine_module: the engine process's module (optimum-ort's runs ``backends.optimum_ort.engine``).

    Raises:
        RuntimeError: the engine process failed to load the model (its exception's words).
    """

    def __init__(self, model_path: str, options: dict[str, Any], engine_module: str = "backends.transformers.engine"):
        from transformers import AutoTokenizer

        argv = [sys.executable, "-m", engine_module, "--model", model_path, "--options", json.dumps(options)]
        interval_s = float(options.get("stream_interval_ms") or 0) / 1000
        super().__init__(argv, interval_s or 0.002)
        self.decoder_tokenizer = AutoTokenizer.from_pretrained(
            self._info.get("tokenizer_path") or model_path, trust_remote_code=bool(options.get("trust_remote_code")))

    def make_decoder(self):
        return CumulativeText(self.decoder_tokenizer)

    async def score(self, body: dict[str, Any]) -> dict[str, Any]:
        """Teacher-forced log-probabilities, computed in the engine process
        (:meth:`backends.transformers.engine.TransformersEngine.score`)."""
        return await self.call("score", body)


def main() -> None:
    serve(lambda args: TransformersProxy(args.model, args.options))


if __name__ == "__main__":
    main()
