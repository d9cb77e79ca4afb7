"""Worker process: OpenVINO GenAI behind the OpenAI completions API.

Runs in the ``openvino`` environment (``adapters.openvino_export.env``) as ``python -m
backends.openvino.worker --model IR_DIR --port P --ready-file F --options JSON``. This process
serves HTTP (:mod:`backends._hosting.worker_server`); the pipeline runs in a child process,
:mod:`backends.openvino.engine` (modes, tokenization, why its own process), and the two exchange
:mod:`backends._hosting.engine_frames` frames (:class:`backends._hosting.engine_proxy.PipeEngineProxy`:
detokenizing here with ``tokenizers.DecodeStream`` over the export's ``tokenizer.json``,
cancellation, a dead engine process).
"""

from __future__ import annotations

import json
import sys
from typing import Any

from backends._hosting.engine_proxy import PipeEngineProxy


class OpenVinoProxy(PipeEngineProxy):
    """The :class:`backends._hosting.worker_server.WorkerEngine` of this worker.

    Args:
        model_dir: the IR folder (``adapters.openvino_export``).
        options: passed to :class:`backends.openvino.engine.OpenVinoEngine` unchanged.

    Raises:
        RuntimeError: the engine process failed to load the pipeline (its exception's words).
    """

    def __init__(self, model_dir: str, options: dict[str, Any]):
        argv = [sys.executable, "-m", "backends.openvino.engine", "--model", model_dir, "--options", json.dumps(options)]
        interval_s = float(options.get("stream_interval_ms") or 0) / 1000
        super().__init__(argv, interval_s or 0.002)
        self.stats.update({"max_running_requests": 0})


def main() -> None:
    from backends._hosting.worker_server import serve

    serve(lambda args: OpenVinoProxy(args.model, args.options))


if __name__ == "__main__":
    main()
