"""optimum-ort backend: ``optimum-cli export onnx`` (cached, inspected), then ``ORTModelForCausalLM`` in a worker.

``start()`` runs :func:`adapters.optimum_onnx_export.export` (export problems surface as
``EngineFailure``: ``unsupported-architecture``, ``export-defect`` naming the node,
``load-failure``), writes the result to ``<workdir>/export.json``, then launches
:mod:`backends.optimum_ort.worker` in the ``optimum-onnx`` environment.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from adapters.optimum_onnx_export import OptimumOnnxOptions, OptimumOnnxResult, env_spec, export
from backends._hosting.threads import option_or_default
from backends._export_worker import ExportWorkerBackend
from backends.optimum_ort.preflight import rule as _onnx_rule
from bakeoff.api.specs import BackendInfo
from bakeoff.host import envs


class OptimumOrtOptions(OptimumOnnxOptions):
    """``--backend-opt`` keys: the export's (``precision`` fp32|int8, ``opset``) and these.

    Attributes:
        provider: the ONNX Runtime execution provider (``CUDAExecutionProvider`` needs
            onnxruntime-gpu in the environment: ``BAKEOFF_ENVS=preinstalled``).
        intra_op_num_threads: ORT intra-op threads; unset: on the CPU provider bakeoff's default,
            the usable CPUs less one for the worker's HTTP side and the client
            (:func:`backends._hosting.threads.default_threads`), stated in the run's notes; on
            CUDA ORT's default.
        batching: ``static`` (the default): the greedy requests waiting when one begins share its
            ``generate`` as one left-padded batch of up to ``max_batch_size`` (optimum-onnx has no
            continuous batching; a batched ``generate`` is how it serves several prompts at once;
            ``backends/transformers/static.py``: a young batch restarts to take in the rest of a
            wave). On the 2-core host (2026-12-03, fixture, 64 tokens x 4 requests per session)
            5,390 tok/s at 8 sessions against one ``generate`` at a time's ~480, and 0.89 (0.76-0.91)
            of a bare batched ``generate`` per turn; ``none``: one ``generate`` at a time.
        max_batch_size: static batching: most requests per batch.
        stream_interval_ms: batching period of dense streams, as the ort-genai backend's option
            (:class:`backends._hosting.engine_frames.Out`); 0 sends every token at once.
        reuse_export: reuse a cached export of the same checkpoint and options.
        export_timeout_s: exporter deadline in seconds.
    """

    provider: Literal["CPUExecutionProvider", "CUDAExecutionProvider"] = "CPUExecutionProvider"
    intra_op_num_threads: int | None = Field(None, ge=1)
    stream_interval_ms: float = Field(2.0, ge=0, le=100)
    batching: Literal["static", "none"] = "static"
    max_batch_size: int = Field(16, ge=1)
    reuse_export: bool = True
    export_timeout_s: float = Field(3600.0, gt=0)

    def export_options(self) -> OptimumOnnxOptions:
        return OptimumOnnxOptions(**self.model_dump(include=set(OptimumOnnxOptions.model_fields)))


class OptimumOrtBackend(ExportWorkerBackend):
    """ONNX Runtime through optimum's ``ORTModelForCausalLM``: static batches of the requests waiting."""

    preflight_rule = staticmethod(_onnx_rule)  # optimum-onnx's exporter (backends/optimum_ort/preflight.py)

    name = "optimum-ort"
    Options = OptimumOrtOptions
    export_fn = staticmethod(export)
    worker_module = "backends.optimum_ort.worker"
    # bare ORTModelForCausalLM.generate, 2026-12-05: 22.5-24.4 -> 29-31 tok/s at 1 session, 123 -> 132 at 8
    huge_pages = True
    engine_env = staticmethod(env_spec)
    export_result: OptimumOnnxResult | None

    def threads(self) -> tuple[int | None, str]:
        """ORT's intra-op threads the worker's session gets, and why (None: ORT's default)."""
        if self.options.provider == "CPUExecutionProvider" or self.options.intra_op_num_threads is not None:
            return option_or_default(self.options.intra_op_num_threads, "intra_op_num_threads")
        return None, "ORT's default (one per physical core)"

    def engine_options(self) -> dict:
        return {"provider": self.options.provider, "intra_op_num_threads": self.threads()[0],
                "onnx_file": self.export_result.onnx_file, "stream_interval_ms": self.options.stream_interval_ms,
                "batching": self.options.batching, "max_batch_size": self.options.max_batch_size}

    def describe(self, startup_s: float) -> BackendInfo:
        info = self.ready_payload.get("info", {})
        notes = {**self.export_result.notes(), "provider": str(info.get("provider")),
                 "providers_active": str(info.get("providers_active")), "onnxruntime": str(info.get("onnxruntime_version")),
                 "transformers": str(info.get("transformers_version")), "environment": envs.describe(self.env_python),
                 "intra_op_num_threads": f"{info.get('intra_op_num_threads', 'ORT default')} ({self.threads()[1]}; "
                                         f"torch's threads in generate: {info.get('torch_num_threads')})",
                 "scheduling": (f"static batching: the greedy requests waiting when one begins share its "
                                f"ORTModelForCausalLM.generate (left-padded, up to {self.options.max_batch_size}; "
                                "backends/transformers/static.py)" if info.get("batching") == "static"
                                else "one request at a time (ORTModelForCausalLM.generate)")}
        return BackendInfo(
            backend=self.name, engine="optimum-onnx", engine_version=info.get("engine_version"),
            device=info.get("device", "cpu"), max_model_len=info.get("max_model_len"),
            launch_command=self.launch_cmd, base_url=self.base_url, served_model=self.config.model,
            startup_s=startup_s, notes=notes,
            concurrent_requests=self.options.max_batch_size if info.get("batching") == "static" else 1)
