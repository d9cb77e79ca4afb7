"""The transformers reference backend: ``generate`` in a worker process."""

from __future__ import annotations

import json
import sys
from typing import Literal

from pydantic import Field

from backends.transformers.preflight import rule as preflight_rule
from backends._hosting.threads import default_threads
from backends._server import ChildServerBackend
from bakeoff.host.cpu_dtype import default_dtype
from bakeoff.host.envs import child_env, has_cuda
from bakeoff.api.specs import BackendInfo, Spec


class TransformersOptions(Spec):
    """``--backend-opt`` keys of the transformers backend.

    Attributes:
        device: ``auto`` picks CUDA when present, else CPU.
        dtype: weights dtype; ``auto`` keeps the checkpoint's.
        trust_remote_code: off unless the user turns it on (recorded in the verdict).
        batching: how concurrent requests share the model; unset: ``continuous`` on an
            accelerator, on CPU ``continuous`` when one decode step of the model takes at least
            ``CONTINUOUS_MIN_STEP_MS`` (10 ms, measured at start: SmolLM2-135M's 49 ms, where the
            manager served 108 tok/s at 8 sessions against 96.5 for a batched ``generate``) and
            ``static`` for a faster one (the fixture's 2 ms, below), stated in the run's notes with
            the measured step (``batching_default``).
            ``static``: the greedy requests waiting when one begins share one left-padded
            ``generate`` (``backends/transformers/static.py``); ``continuous``: transformers'
            ContinuousBatchingManager (paged KV cache; with the manager paused, greedy requests with
            logprobs run in static batches, a sampled one and a lone one, ``lone_request``, on
            ``generate``); ``none``:
            one ``generate`` at a time, how the suite's reference runs (``evaluations/reference.py``
            pins it). Measured on the 2-core host (2026-12-03, fixture, 64 tokens x 4 requests per
            session, bare loops): at 8 sessions a batched ``generate`` per wave 2,630 tok/s, the
            manager 1,890, one at a time 608 (at 1 session 607 / 450 / 607); the continuous worker
            2.96x (2.10-3.45) the one-at-a-time worker's tokens/s at 8 sessions. When the manager is
            unavailable or fails its warm-up the worker falls back to ``none`` and records why
            (``fallbacks["batching"]``).
        max_batch_size: static batching: most requests per batch.
        kv_memory_fraction: continuous batching: share of free device memory for the paged KV
            cache (transformers' ``max_memory_percent``; default its own, 0.9, on GPU).
        kv_cache_gib: continuous batching on CPU: the paged KV cache's size in GiB (default 1;
            transformers would take 90% of the host's free RAM), ignored when
            ``kv_memory_fraction`` is set.
        gpu_headroom_gib: testing: once the model is loaded, the worker holds all free GPU
            memory but this many GiB (emulates a co-tenant; ``0`` provokes CUDA out-of-memory
            while serving). Ignored on CPU.
        num_threads: torch's intra-op threads (``torch.set_num_threads``) when the model runs on
            CPU; unset: bakeoff's default, the usable CPUs less one for the worker's HTTP side and
            the client (:func:`backends._hosting.threads.default_threads`); with torch's own
            default (one per core) a 2-core host beside the client swung 20x with the host's load.
            Stated in the run's notes as torch reports it in the generating thread.
        lone_request: continuous batching: a greedy request that finds the engine idle and no
            other within ``lone_wait_ms`` runs on ``generate`` with the manager paused (``generate``,
            the default: one sequence decodes faster there, 1.5x the manager's tokens/s at 1 session
            on the 2-core host) or joins the manager's batch (``batch``).
        lone_wait_ms: how long such a request waits for company, in ms (about one decode step of
            a small CPU model; at 1 session it is added to each request's TTFT).
        stream_interval_ms: batching period of dense streams, as the ort-genai backend's option
            (:class:`backends._hosting.engine_frames.Out`): a stream's first token and any token
            after a longer gap go out at once, the tokens of a dense stream in one frame per
            interval, each still counted; 0 sends every token at once.
    """

    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    trust_remote_code: bool = False
    batching: Literal["none", "static", "continuous"] | None = None
    max_batch_size: int = Field(16, ge=1)
    kv_memory_fraction: float | None = Field(None, gt=0, le=0.95)
    kv_cache_gib: float | None = Field(None, gt=0)
    gpu_headroom_gib: float | None = Field(None, ge=0)
    num_threads: int | None = Field(None, ge=1)
    stream_interval_ms: float = Field(2.0, ge=0, le=100)
    lone_request: Literal["generate", "batch"] = "generate"
    lone_wait_ms: float = Field(2.0, ge=0, le=100)


class TransformersBackend(ChildServerBackend):
    """Hugging Face transformers: batched by default (continuous batching on an accelerator and, on CPU,
    for a model whose decode step takes 10 ms or more; static batches for a faster one), ``generate``
    one request at a time with ``batching=none`` (the suite's reference,
    ``evaluations/reference.py``).

    Runs in bakeoff's own environment (it already holds torch and transformers for the
    fixture builder).
    """

    preflight_rule = staticmethod(preflight_rule)

    name = "transformers"
    Options = TransformersOptions
    ready_mode = "file"
    bakeoff_worker = True

    def threads(self) -> tuple[int | None, str]:
        """torch's intra-op threads for a CPU model, and why (None on CUDA: torch's default)."""
        if self.options.num_threads is not None:
            return self.options.num_threads, "num_threads option"
        if self.options.device == "cuda":
            return None, "torch's default (the model runs on CUDA)"
        return default_threads()

    def dtype(self) -> tuple[str, str | None]:
        """The worker's ``dtype`` and, when bakeoff chose it, why: ``auto`` on a CPU is the
        checkpoint's dtype where the CPU computes it natively, else float32
        (:func:`bakeoff.host.cpu_dtype.default_dtype`)."""
        if self.options.dtype != "auto":
            return self.options.dtype, None
        if self.options.device == "cuda" or (self.options.device == "auto" and has_cuda()):
            return "auto", None
        choice = default_dtype(self.config.model)
        return choice.dtype or "auto", f"bakeoff's default (dtype=auto on CPU): {choice.note}"

    def worker_options(self) -> dict:
        """The worker's options: the backend's, ``num_threads`` resolved (:meth:`threads`; the worker
        applies it only where the model runs on CPU) and ``dtype`` (:meth:`dtype`)."""
        return {**self.options.model_dump(), "num_threads": self.threads()[0], "dtype": self.dtype()[0]}

    def command(self, port: int) -> tuple[list[str], dict[str, str]]:
        cmd = [sys.executable, "-m", "backends.transformers.worker", "--model", self.config.model,
               "--port", str(port), "--ready-file", str(self.ready_file),
               "--options", json.dumps(self.worker_options())]
        return cmd, child_env({"TOKENIZERS_PARALLELISM": "false"}, huge_pages=self.huge_pages)

    def describe(self, startup_s: float) -> BackendInfo:
        info = self.ready_payload.get("info", {})
        return BackendInfo(
            backend=self.name, engine="transformers", engine_version=info.get("engine_version"),
            device=info.get("device", "cpu"), max_model_len=info.get("max_model_len"),
            launch_command=self.launch_cmd, base_url=self.base_url, served_model=self.config.model,
            startup_s=startup_s,
            kv_cache_tokens=info.get("kv_cache_tokens"),
            concurrent_requests=(None if info.get("batching") == "continuous" else
                                 self.options.max_batch_size if info.get("batching") == "static" else 1),
            fallbacks={"batching": str(info["batching_fallback"])} if info.get("batching_fallback") else {},
            notes={"dtype": str(info.get("dtype")), **({"dtype_choice": self.dtype()[1]} if self.dtype()[1] else {}),
                   "torch": str(info.get("torch_version")),
                   "trust_remote_code": str(info.get("trust_remote_code")),
                   "scheduling": ("continuous batching (transformers ContinuousBatchingManager, paged KV cache; "
                                  + str(info.get("paused_path")) + ")"
                                  if info.get("batching") == "continuous"
                                  else f"static batching: the greedy requests waiting when one begins share its generate "
                                       f"(left-padded, up to {self.options.max_batch_size}; backends/transformers/static.py)"
                                  if info.get("batching") == "static"
                                  else "one request at a time (reference, not a batching server)"),
                   **({"batching_default": str(info["batching_default"])} if info.get("batching_default") else {}),
                   **{k: str(info[k]) for k in ("batching", "attn_implementation", "gpu_headroom_held_gib",
                                                "stream_interval_ms") if info.get(k) is not None},
                   "num_threads": (f"{info.get('num_threads')} ({self.threads()[1]})" if info.get("device") == "cpu"
                                   else f"{info.get('num_threads')} (torch's default: the model runs on CUDA)")},
        )
