"""The optimum-ort engine process: ``ORTModelForCausalLM`` and the transformers engine loop.

Started by :mod:`backends.optimum_ort.worker` as ``python -m backends.optimum_ort.engine --model
EXPORT_DIR --options JSON --cmd-fd N --out-fd M --bell-fd B``. ``ORTModelForCausalLM`` is a
transformers ``GenerationMixin`` model, so generation, streaming (token ids), logprobs, scoring and
tokenization are the transformers engine's (:class:`backends.transformers.engine.TransformersEngine`,
its process loop and why it is a process of its own): one ``generate`` at a time, on ONNX Runtime's
CPU execution provider (``provider`` option: ``CUDAExecutionProvider`` for users with
onnxruntime-gpu). ``intra_op_num_threads`` sets the session's threads and, on CPU, torch's
(``generate`` runs its logits processing and cache bookkeeping in torch).
"""

from __future__ import annotations

from importlib import metadata
from typing import Any

from backends.transformers.engine import TransformersEngine, run, threads_in_new_thread


class OptimumOrtEngine(TransformersEngine):
    """``ORTModelForCausalLM.from_pretrained(export_dir, provider=..., file_name=...)``."""

    def __init__(self, model_path: str, options: dict[str, Any]):  # noqa: D107 - replaces the parent's loading
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
            if provider == "CPUExecutionProvider":
                torch.set_num_threads(int(options["intra_op_num_threads"]))
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        # the exported graph takes no token_type_ids (generate() refuses unused model kwargs)
        self.tokenizer.model_input_names = [n for n in self.tokenizer.model_input_names if n != "token_type_ids"]
        self.model = ORTModelForCausalLM.from_pretrained(model_path, provider=provider, use_cache=True,
                                                         file_name=options.get("onnx_file") or "model.onnx",
                                                         session_options=session_options)
        self.device = "cpu"
        self.held: list = []
        self._info = {
            "engine": "optimum-onnx", "engine_version": metadata.version("optimum-onnx"),
            "onnxruntime_version": onnxruntime.__version__, "transformers_version": transformers.__version__,
            "device": "cpu" if provider == "CPUExecutionProvider" else provider, "provider": provider,
            "providers_active": self.model.providers if hasattr(self.model, "providers") else None,
            "max_model_len": getattr(self.model.config, "max_position_embeddings", None),
            # what the session itself runs with (read back from ONNX Runtime, 0: its default)
            "intra_op_num_threads": session_threads(self.model),
            "torch_num_threads": threads_in_new_thread(torch), "tokenizer_path": model_path,
        }
        self.setup({**options, "batching": options.get("batching") or "static"})


def session_threads(model) -> int | None:
    """The intra-op thread count ONNX Runtime's session holds (``SessionOptions`` read back)."""
    try:
        return int(model.session.get_session_options().intra_op_num_threads)
    except AttributeError:
        return None


if __name__ == "__main__":
    run(OptimumOrtEngine)
