"""Worker process: optimum's ``ORTModelForCausalLM`` behind the OpenAI completions API.

Runs in the ``optimum-onnx`` environment as ``python -m backends.optimum_ort.worker --model
EXPORT_DIR --port P --ready-file F --options JSON``. ``ORTModelForCausalLM`` is a transformers
``GenerationMixin`` model, so generation, streaming (token ids), logprobs and tokenization are
the transformers reference worker's (:class:`backends.transformers.worker.TransformersEngine`):
one ``generate`` at a time, on ONNX Runtime's CPU execution provider (``provider`` option:
``CUDAExecutionProvider`` for users with onnxruntime-gpu).
"""

from __future__ import annotations

import threading
from typing import Any

from backends.transformers.worker import TransformersEngine


class OptimumOrtEngine(TransformersEngine):
    """``ORTModelForCausalLM.from_pretrained(export_dir, provider=..., file_name=...)``."""

    def __init__(self, model_path: str, options: dict[str, Any]):  # noqa: D107 - replaces the parent's loading
        from importlib import metadata

        import onnxruntime
        import torch
        import transformers
        from optimum.onnxruntime import ORTModelForCausalLM
        from transformers import AutoTokenizer

        self.torch = torch
        provider = options.get("provider") or "CPUExecutionProvider"
        session_options = onnxruntime.SessionOptions()
        if options.get("intra_op_num_threads"):
            session_options.intra_op_num_threads = int(options["intra_op_num_threads"])
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        # the exported graph takes no token_type_ids (generate() refuses unused model kwargs)
        self.tokenizer.model_input_names = [n for n in self.tokenizer.model_input_names if n != "token_type_ids"]
        self.model = ORTModelForCausalLM.from_pretrained(model_path, provider=provider, use_cache=True,
                                                         file_name=options.get("onnx_file") or "model.onnx",
                                                         session_options=session_options)
        self.device = "cpu"
        self.lock = threading.Lock()
        self.held: list = []
        self.batcher = None
        self.n_generated = 0
        self._info = {
            "engine": "optimum-onnx", "engine_version": metadata.version("optimum-onnx"),
            "onnxruntime_version": onnxruntime.__version__, "transformers_version": transformers.__version__,
            "device": "cpu" if provider == "CPUExecutionProvider" else provider, "provider": provider,
            "providers_active": self.model.providers if hasattr(self.model, "providers") else None,
            "max_model_len": getattr(self.model.config, "max_position_embeddings", None), "batching": "none",
        }


def main() -> None:
    from backends._hosting.worker_server import serve

    serve(lambda args: OptimumOrtEngine(args.model, args.options))


if __name__ == "__main__":
    main()
