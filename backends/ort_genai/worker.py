"""Worker process: ONNX Runtime GenAI behind the OpenAI completions API.

Runs in the ``ort-genai`` environment (``adapters.ort_genai_export.env``) as ``python -m
backends.ort_genai.worker --model EXPORT_DIR --port P --ready-file F --options JSON``. This
process serves HTTP (:mod:`backends._hosting.worker_server`); the model runs in a child process,
:mod:`backends.ort_genai.engine`, and the two exchange :mod:`backends._hosting.worker_pipe` frames
(:class:`backends._hosting.engine_proxy.PipeEngineProxy`: why two processes, detokenizing here,
cancellation and a dead engine process). Measured with one process: the worker kept 64-106% of a
bare ``og.Generator`` loop's tokens/s on a tiny model, varying with every event written
(``benchmarks/bench_ort_genai.py``).
"""

from __future__ import annotations

import json
import sys
from typing import Any

from backends._hosting.engine_proxy import PipeEngineProxy
from backends._hosting.worker_server import serve


class OrtGenaiProxy(PipeEngineProxy):
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
        super().__init__(argv, interval_s or 0.002)
        self.stats.update({"max_running_requests": 0, "engine_seeds_honoured": 1})


def main() -> None:
    serve(lambda args: OrtGenaiProxy(args.model, args.options))


if __name__ == "__main__":
    main()
