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
import signal
import sys
from typing import Any

from backends._hosting.engine_proxy import PipeEngineProxy
from backends._hosting.engine_process import EngineExited
from backends._hosting.worker_server import serve


class OpenVinoProxy(PipeEngineProxy):
    """The :class:`backends._hosting.worker_server.WorkerEngine` of this worker.

    Args:
        model_dir: the IR folder (``adapters.openvino_export``).
        options: passed to :class:`backends.openvino.engine.OpenVinoEngine` unchanged.

    Where the engine process dies of a signal at load under bakeoff's default thread count
    (``inference_num_threads_is_default``), it starts once more with the plugin's default and
    says so in ``inference_num_threads_fallback``.

    Raises:
        RuntimeError: the engine process failed to load the pipeline (its exception's words).
    """

    def __init__(self, model_dir: str, options: dict[str, Any]):
        interval_s = float(options.get("stream_interval_ms") or 0) / 1000 or 0.002
        threads = options.get("inference_num_threads")
        try:
            super().__init__(self._argv(model_dir, options), interval_s)
            fallback = None
        except EngineExited as exc:
            if exc.returncode >= 0 or not threads or not options.get("inference_num_threads_is_default"):
                raise
            # bakeoff's thread default must not be what fails an engine: openvino 2026.4.1's
            # ContinuousBatchingPipeline died of SIGFPE at load with INFERENCE_NUM_THREADS=1 on an
            # AMX host (bf16 inference, the 42 M-parameter qwen3-small IR), and loaded with 2 or
            # with the plugin's default (2026-12-04)
            try:
                name = signal.Signals(-exc.returncode).name
            except ValueError:
                name = f"signal {-exc.returncode}"
            print(f"openvino: the engine process died of {name} at load with INFERENCE_NUM_THREADS={threads}; "
                  "starting it again with the plugin's default", file=sys.stderr, flush=True)
            super().__init__(self._argv(model_dir, {**options, "inference_num_threads": None}), interval_s)
            fallback = (f"the engine process died of {name} at load with INFERENCE_NUM_THREADS={threads} "
                        "(bakeoff's default, usable CPUs less one): the CPU plugin's default thread count instead")
        if fallback:
            self._info["inference_num_threads_fallback"] = fallback
        self.stats.update({"max_running_requests": 0})

    @staticmethod
    def _argv(model_dir: str, options: dict[str, Any]) -> list[str]:
        return [sys.executable, "-m", "backends.openvino.engine", "--model", model_dir, "--options", json.dumps(options)]


def main() -> None:
    serve(lambda args: OpenVinoProxy(args.model, args.options))


if __name__ == "__main__":
    main()
