"""Worker process: TensorRT-LLM's LLM API behind the OpenAI completions API.

Runs in TensorRT-LLM's environment. The engine is TensorRT-LLM's own scheduler (in-flight
batching): requests are submitted concurrently with ``LLM.generate_async``.

API facts (read from TensorRT-LLM's source, ``tensorrt_llm/llmapi/llm.py`` and
``tensorrt_llm/executor/result.py``):
- ``LLM(model=..., backend="pytorch", tensor_parallel_size=..., max_batch_size=...,
  max_num_tokens=..., max_seq_len=..., kv_cache_config=KvCacheConfig(free_gpu_memory_fraction=...,
  enable_block_reuse=...), trust_remote_code=...)``;
- ``llm.generate_async(prompt, sampling_params=SamplingParams(max_tokens=..., temperature=...,
  top_p=..., top_k=..., seed=..., ignore_eos=..., stop=...), streaming=True)`` returns a
  ``RequestOutput`` iterated with ``async for``; each item's ``outputs[0]`` is CUMULATIVE
  (``text``, ``token_ids``); the new part since the previous item is ``text_diff`` /
  ``token_ids_diff``; ``finished`` and ``outputs[0].finish_reason`` at the end;
- ``llm.tokenizer.encode(text)`` (what the input processor calls for a text prompt, with
  ``add_special_tokens`` from the sampling params, default True); ``llm.shutdown()``.

Run as ``python -m backends.trtllm.worker --model M --port P --ready-file F --options JSON``.
"""

from __future__ import annotations

import atexit
from typing import Any

from backends._hosting.worker_server import serve

# LLM(...) keyword arguments taken from the options when set.
LLM_KEYS = ("max_batch_size", "max_num_tokens", "max_seq_len", "trust_remote_code")


def llm_kwargs(model_path: str, options: dict[str, Any], kv_cache_config: Any) -> dict[str, Any]:
    """The ``LLM(...)`` keyword arguments for the options (see ``TrtllmOptions``)."""
    kwargs: dict[str, Any] = {"model": model_path, "tensor_parallel_size": int(options.get("tp_size") or 1),
                              "kv_cache_config": kv_cache_config}
    if options.get("backend", "pytorch") == "pytorch":
        kwargs["backend"] = "pytorch"
    for key in LLM_KEYS:
        if options.get(key) is not None:
            kwargs[key] = options[key]
    extra = options.get("extra_llm_api_options")
    if extra:  # the same YAML file trtllm-serve takes; YAML parser ships with TensorRT-LLM
        import yaml

        with open(extra) as fh:
            kwargs.update(yaml.safe_load(fh) or {})
    return kwargs


def sampling_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    """``SamplingParams(...)`` keyword arguments for an OpenAI completions body."""
    temperature = float(body.get("temperature") or 0.0)
    kw: dict[str, Any] = {"max_tokens": int(body.get("max_tokens") or 16), "ignore_eos": bool(body.get("ignore_eos"))}
    if temperature > 0:
        kw.update(temperature=temperature, top_p=float(body.get("top_p") or 1.0))
        if body.get("seed") is not None:
            kw["seed"] = int(body["seed"])
    else:  # greedy
        kw.update(temperature=0.0, top_k=1)
    if body.get("stop"):
        kw["stop"] = body["stop"] if isinstance(body["stop"], list) else [body["stop"]]
    return kw


class TrtllmEngine:
    """TensorRT-LLM's ``LLM`` with streaming ``generate_async``.

    Args:
        model_path: checkpoint folder, hub id or engine folder.
        options: ``TrtllmOptions`` as a dict.
    """

    def __init__(self, model_path: str, options: dict[str, Any]):
        import tensorrt_llm
        from tensorrt_llm import SamplingParams
        from tensorrt_llm.llmapi import KvCacheConfig

        if options.get("backend", "pytorch") == "tensorrt":
            from tensorrt_llm._tensorrt_engine import LLM  # the engine-building LLM of TRT-LLM 1.x
        else:
            from tensorrt_llm import LLM

        kv_kwargs: dict[str, Any] = {"free_gpu_memory_fraction": float(options.get("kv_cache_free_gpu_memory_fraction", 0.9))}
        if options.get("enable_block_reuse") is not None:
            kv_kwargs["enable_block_reuse"] = bool(options["enable_block_reuse"])
        self.SamplingParams = SamplingParams
        self.llm = LLM(**llm_kwargs(model_path, options, KvCacheConfig(**kv_kwargs)))
        atexit.register(self.close)
        self.n_generated = 0
        self.n_requests = 0
        self._info = {"engine": "tensorrt-llm", "engine_version": getattr(tensorrt_llm, "__version__", None),
                      "device": _device(), "backend": options.get("backend", "pytorch"),
                      "max_model_len": options.get("max_seq_len"), "kv_cache_config": kv_kwargs}

    def info(self) -> dict[str, Any]:
        return self._info

    def metrics(self) -> dict[str, float]:
        return {"generated_tokens": self.n_generated, "requests": self.n_requests}

    def prompt_tokens(self, prompt: str) -> int:
        return len(self.tokenize(prompt))

    def tokenize(self, prompt: str) -> list[int]:
        """The ids ``generate_async`` feeds the model for a text prompt: TensorRT-LLM's input
        processor encodes it with ``llm.tokenizer`` and ``SamplingParams.add_special_tokens``
        (default True, as here)."""
        return [int(t) for t in self.llm.tokenizer.encode(prompt)]

    async def generate(self, body: dict[str, Any]):
        """Yield ``(token_ids, text_delta, finish_reason)``: the diffs of cumulative outputs."""
        self.n_requests += 1
        sp = self.SamplingParams(**sampling_kwargs(body))
        finish = None
        async for out in self.llm.generate_async(body.get("prompt", ""), sampling_params=sp, streaming=True):
            comp = out.outputs[0]
            ids = [int(t) for t in comp.token_ids_diff]
            self.n_generated += len(ids)
            if getattr(out, "finished", False):
                finish = comp.finish_reason or "stop"
            yield ids, comp.text_diff, finish
            if finish:
                return
        yield [], "", finish or "stop"

    def close(self) -> None:
        try:
            self.llm.shutdown()
        except Exception:  # best effort at exit
            pass


def _device() -> str:
    try:
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    except Exception:
        return "unknown"


def main() -> None:
    serve(lambda args: TrtllmEngine(args.model, args.options))


if __name__ == "__main__":  # TensorRT-LLM spawns MPI workers: keep the entry point guarded
    main()
