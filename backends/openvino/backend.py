"""OpenVINO GenAI backend: export with ``optimum-cli export openvino`` (cached), serve in a worker.

``start()`` runs :func:`adapters.openvino_export.export` (or reuses its cache), writes the
:class:`OpenVinoExportResult` to ``<workdir>/export.json``, then launches
:mod:`backends.openvino.worker` in the ``openvino`` environment. Export refusals surface as
``EngineFailure`` (``unsupported-architecture``, ``export-defect``, ``load-failure``) from
``start()``; a worker that dies while loading is classified by its log (``backends._server``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from adapters.openvino_export import OpenVinoExportOptions, OpenVinoExportResult, env_spec, export
from backends._hosting.threads import option_or_default
from backends._export_worker import ExportWorkerBackend
from backends.openvino.preflight import rule as preflight_rule
from bakeoff.api.specs import BackendInfo
from bakeoff.host import envs



# OpenVINO element types (the CPU plugin's ``KV_CACHE_PRECISION``) in bytes per element; u8/i8
# carry per-token scales and zero points besides, left out as vLLM's fp8 block scales are
# (bakeoff.analysis.kv_layout.KV_DTYPE_BYTES). capacity.kv_cache reads the figure from the notes.
KV_ELEMENT_BYTES = {"u8": 1, "i8": 1, "f16": 2, "bf16": 2, "f32": 4, "u4": 0.5, "i4": 0.5}

class OpenVinoOptions(OpenVinoExportOptions):
    """``--backend-opt`` keys of the openvino backend: the export's (``weight_format``,
    ``group_size``, ``ratio``, ``sym``) and these.

    Attributes:
        batching: ``continuous`` (``ContinuousBatchingPipeline``: concurrent sessions share each
            step, paged KV cache) or ``pipeline`` (``LLMPipeline``, one request at a time).
        kv_cache_gib: continuous: KV cache size in GiB (``SchedulerConfig.cache_size``).
        max_num_seqs: continuous: most sequences scheduled per step.
        enable_prefix_caching: continuous: keep KV blocks of finished prompts for reuse.
        inference_precision: the CPU plugin's ``INFERENCE_PRECISION_HINT``; None keeps its
            default (bf16 on CPUs with AVX-512 bf16, f32 elsewhere: outputs then differ by host).
        inference_num_threads: the plugin's ``INFERENCE_NUM_THREADS``; unset: on CPU bakeoff's
            default, the usable CPUs less one for the worker's HTTP side and the client
            (:func:`backends._hosting.threads.default_threads`), stated in the run's notes.
        stream_interval_ms: batching period of dense streams, as the ort-genai backend's option
            (:class:`backends._hosting.engine_frames.Out`): a stream's first token and any token
            after a longer gap go out at once, the tokens of a dense stream in one frame per
            interval, each still counted; 0 sends every token at once.
        reuse_export: reuse a cached export of the same checkpoint and options.
        export_timeout_s: exporter deadline in seconds.
    """

    batching: Literal["continuous", "pipeline"] = "continuous"
    kv_cache_gib: int = Field(1, ge=1)
    max_num_seqs: int = Field(64, ge=1)
    enable_prefix_caching: bool = True
    inference_precision: Literal["f32", "bf16", "f16"] | None = None
    inference_num_threads: int | None = Field(None, ge=1)
    stream_interval_ms: float = Field(2.0, ge=0, le=100)
    reuse_export: bool = True
    export_timeout_s: float = Field(3600.0, gt=0)

    def export_options(self) -> OpenVinoExportOptions:
        return OpenVinoExportOptions(**self.model_dump(include=set(OpenVinoExportOptions.model_fields)))


class OpenVinoBackend(ExportWorkerBackend):
    """OpenVINO GenAI serving an optimum-intel export of the checkpoint."""

    preflight_rule = staticmethod(preflight_rule)

    name = "openvino"
    Options = OpenVinoOptions
    export_fn = staticmethod(export)
    worker_module = "backends.openvino.worker"
    # bare ContinuousBatchingPipeline, 2026-12-05: 34-36 -> 44-48 tok/s at 1 session, 201-223 -> 244-282 at 8
    huge_pages = True
    engine_env = staticmethod(env_spec)
    export_result: OpenVinoExportResult | None

    def threads(self) -> tuple[int | None, str]:
        """The plugin's ``INFERENCE_NUM_THREADS`` the worker gets, and why (None: the plugin's default)."""
        return option_or_default(self.options.inference_num_threads, "inference_num_threads")

    def engine_options(self) -> dict:
        """What the engine process gets (:class:`backends.openvino.engine.OpenVinoEngine`); the bare
        loop of ``benchmarks/bench_fidelity.py`` reads the same."""
        opts = self.options.model_dump(include={"batching", "kv_cache_gib", "max_num_seqs", "enable_prefix_caching",
                                                "inference_precision", "stream_interval_ms"})
        fell_back = self.info is not None and "inference_num_threads" in self.info.fallbacks
        opts["inference_num_threads"] = None if fell_back else self.threads()[0]
        opts["inference_num_threads_is_default"] = self.options.inference_num_threads is None
        return opts

    def describe(self, startup_s: float) -> BackendInfo:
        info = self.ready_payload.get("info", {})
        continuous = info.get("batching") == "continuous"
        notes = {**self.export_result.notes(), "batching": str(info.get("batching")),
                 "openvino": str(info.get("openvino_version")), "detokenizer": str(info.get("detokenizer")),
                 "logprobs": str(info.get("logprobs")), "environment": envs.describe(self.env_python),
                 "inference_precision": str(info.get("properties", {}).get("INFERENCE_PRECISION_HINT",
                                                                           "CPU plugin default")),
                 "inference_num_threads": f"{info.get('properties', {}).get('INFERENCE_NUM_THREADS', 'plugin default')} "
                                          f"({info.get('inference_num_threads_fallback') or self.threads()[1]})",
                 "stream_interval_ms": str(info.get("stream_interval_ms")),
                 "engine_process": "the pipeline in its own process (backends/openvino/engine.py: its step() holds "
                                   "the GIL)"}
        if continuous:
            notes["scheduler"] = " ".join(str(info.get("scheduler", "")).split())
            notes["kv_cache_tokens"] = ("not stated: openvino_genai states the KV cache in bytes "
                                        "(SchedulerConfig.cache_size), not in tokens")
            precision = str(info.get("kv_cache_precision") or "")
            if precision:
                notes["kv_cache_precision"] = precision
            if precision.lower() in KV_ELEMENT_BYTES:
                notes["kv_cache_element_bytes"] = str(KV_ELEMENT_BYTES[precision.lower()])
        return BackendInfo(
            backend=self.name, engine="openvino-genai", engine_version=info.get("engine_version"),
            device=info.get("device", "cpu"), launch_command=self.launch_cmd, base_url=self.base_url,
            served_model=self.config.model, startup_s=startup_s,
            kv_cache_memory_gib=float(info["kv_cache_gib"]) if continuous else None,
            concurrent_requests=info.get("max_num_seqs") if continuous else 1, notes=notes,
            fallbacks={k.removesuffix("_fallback"): str(v) for k, v in info.items() if k.endswith("_fallback")})
