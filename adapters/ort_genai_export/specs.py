"""Pydantic specs of the ONNX Runtime GenAI export adapter (no engine import, no side effects)."""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ExportOptions(_Spec):
    """What the onnxruntime-genai model builder is asked to produce.

    Maps onto ``python -m onnxruntime_genai.models.builder -p PRECISION -e EP
    --extra_options k=v ...`` (builder source, onnxruntime-genai 0.18.0).

    Attributes:
        precision: weights precision; ``int4``/``int8`` quantize linears to ``MatMulNBits``.
        execution_provider: the ORT execution provider the graph is built for.
        block_size: INT4/INT8 ``MatMulNBits`` block size in weights (builder ``block_size``:
            16, 32, 64, 128 or 256; builder default 32).
        accuracy_level: ``MatMulNBits`` compute precision (builder ``accuracy_level``:
            1 fp32, 2 fp16, 3 bf16, 4 int8; builder default 4 on CPU, 0 elsewhere).
        int4_algo: weight-only quantization algorithm (builder ``algo_config``: ``default``,
            ``rtn``, ``k_quant``, or the compound ``rtn_last``, ``k_quant_last``,
            ``k_quant_mixed``, ``k_quant_linear``). There is no AWQ in the builder.
        moe_quant_type: MoE expert weights precision in ``QMoE`` (builder default int4;
            mxfp4/nvfp4 are CUDA only).
        qmoe_block_size: block size of ``QMoE`` expert quantization (<= 0 = per channel;
            CPU supports 32/64/128).
        paged_attention: build with ``PagedAttention`` (builder ``use_paged_attention=true``):
            1-D packed ``input_ids``, paged KV blocks and ``genai_config.json``
            ``engine.dynamic_batching``, which makes ``og.Engine`` batch continuously. The
            0.18.0 builder builds it only for CUDA with fp16/bf16 activations or WebGPU with
            fp16 ("PagedAttention (use_paged_attention=true) requires CUDA with FP16/BF16 or
            WebGPU with FP16, not (cpu, FLOAT).", ``onnxruntime_genai/models/builders/base.py``
            ``make_attention_init``); default false, as the builder's.
        cuda_graph: CUDA graph capture (builder ``enable_cuda_graph=true``: the CUDA provider
            option ``enable_cuda_graph`` in ``genai_config.json``); ``og.Engine``'s paged path
            captures pure decode steps and runs prefill eagerly (``docs/paged_attention_engine.md``
            "CUDA graph capture", onnxruntime-genai). Default false, as the builder's.
        extra_options: further builder ``--extra_options`` keys, passed verbatim.
    """

    precision: Literal["fp32", "fp16", "bf16", "int8", "int4"] = "int4"
    execution_provider: Literal["cpu", "cuda", "dml", "webgpu", "NvTensorRtRtx"] = "cpu"
    block_size: int | None = Field(None, gt=0)
    accuracy_level: int | None = Field(None, ge=0, le=4)
    int4_algo: Literal["default", "rtn", "k_quant", "rtn_last", "k_quant_last", "k_quant_mixed",
                       "k_quant_linear"] | None = None
    moe_quant_type: Literal["int2", "int4", "int8", "mxfp4", "nvfp4"] | None = None
    qmoe_block_size: int | None = None
    paged_attention: bool = False
    cuda_graph: bool = False
    extra_options: dict[str, str] = Field(default_factory=dict)

    def builder_extra_options(self) -> dict[str, str]:
        """The ``--extra_options`` mapping for the builder (bakeoff names -> builder keys)."""
        out: dict[str, str] = {}
        if self.block_size is not None:
            out["block_size"] = str(self.block_size)
        if self.accuracy_level is not None:
            out["accuracy_level"] = str(self.accuracy_level)
        if self.int4_algo is not None:
            out["algo_config"] = self.int4_algo
        if self.moe_quant_type is not None:
            out["moe_quant_type"] = self.moe_quant_type
        if self.qmoe_block_size is not None:
            out["qmoe_block_size"] = str(self.qmoe_block_size)
        if self.paged_attention:
            out["use_paged_attention"] = "true"
        if self.cuda_graph:
            out["enable_cuda_graph"] = "true"
        out.update(self.extra_options)
        return out


class GraphProblem(_Spec):
    """One problem found in an exported graph.

    Attributes:
        failure_class: ``export-defect`` or ``load-failure``.
        stage: ``builder`` | ``graph`` | ``precision`` | ``checker`` | ``shape-inference`` |
            ``session`` | ``forward`` | ``og-load``.
        node: the node the tool named, when it named one.
        op_type: that node's op type, when known.
        message: the tool's own words (first lines).
    """

    failure_class: Literal["export-defect", "load-failure"]
    stage: str
    node: str | None = None
    op_type: str | None = None
    message: str


class GraphReport(_Spec):
    """What :func:`inspect_graph` found in an export folder.

    Attributes:
        onnx_file: the model file inspected (``genai_config.json``'s ``filename``).
        n_nodes: nodes in the main graph.
        op_counts: ``{op_type: count}`` (domain-qualified for non-default domains, e.g.
            ``com.microsoft.MatMulNBits``), sorted by count.
        precision_observed: what the graph holds: ``int4`` (MatMulNBits bits=4), ``int8``,
            ``float``; plus ``moe``/``qmoe`` flags below.
        matmulnbits_bits: ``{bits: count}`` over ``MatMulNBits`` nodes.
        has_moe: float ``MoE`` nodes present.
        has_qmoe: ``QMoE`` nodes present.
        checker_ok: ``onnx.checker.check_model(full_check=True)`` passed.
        shape_inference_ok: ``onnx.shape_inference.infer_shapes_path(strict_mode=True)`` passed.
        forward_ok: one ``onnxruntime.InferenceSession.run`` over a short prompt passed.
        og_load_ok: ``onnxruntime_genai.Model`` loaded it and produced one token.
        logits_shape: shape of the forward step's logits.
        timings_s: seconds per stage.
        versions: onnx / onnxruntime / onnxruntime-genai versions used to inspect.
        problems: every problem found (empty = clean).
        warnings: findings that do not invalidate the graph (builder value_info hints that
            disagree with inferred shapes; ORT ignores them).
        checker_registered_ops: ORT ops in the ONNX domain that onnx does not know (e.g.
            ``SimplifiedLayerNormalization``), given permissive schemas for the checker.
        input_shapes: the decoder graph's inputs as declared, ``{name: [int or dim name]}``.
        paged_attention: the graph has ``PagedAttention`` nodes and ``genai_config.json`` an
            ``engine.dynamic_batching`` section (og.Engine's continuous path).
        dynamic_batching: that section as the builder wrote it (block_size, max_batch_size,
            gpu_utilization_factor), None without one.
        og_engine_capabilities: ``og.Engine.get_capabilities()`` where the og stage ran through
            the Engine (paged exports): configured_max_batch_size, max_request_length,
            max_scheduled_tokens.
    """

    onnx_file: str
    n_nodes: int = 0
    op_counts: dict[str, int] = Field(default_factory=dict)
    precision_observed: str = "float"
    matmulnbits_bits: dict[str, int] = Field(default_factory=dict)
    has_moe: bool = False
    has_qmoe: bool = False
    checker_ok: bool | None = None
    shape_inference_ok: bool | None = None
    forward_ok: bool | None = None
    og_load_ok: bool | None = None
    logits_shape: list[int] | None = None
    timings_s: dict[str, float] = Field(default_factory=dict)
    versions: dict[str, str] = Field(default_factory=dict)
    problems: list[GraphProblem] = Field(default_factory=list)
    warnings: list[str] = Field(default_factory=list)
    checker_registered_ops: list[str] = Field(default_factory=list)
    input_shapes: dict[str, list[int | str]] = Field(default_factory=dict)
    paged_attention: bool = False
    dynamic_batching: dict[str, float | int | bool] | None = None
    og_engine_capabilities: dict[str, int] = Field(default_factory=dict)

    def summary(self, top: int = 8) -> str:
        """One line: nodes and the most frequent ops, e.g. ``212 nodes: MatMulNBits=14, ...``."""
        ops = ", ".join(f"{k}={v}" for k, v in list(self.op_counts.items())[:top])
        return f"{self.n_nodes} nodes: {ops}"


class ExportResult(_Spec):
    """One export of a checkpoint with the model builder, and its inspection.

    Attributes:
        source: the source checkpoint folder.
        source_hash: fingerprint of the checkpoint (config + weight files), sha256 hex.
        architecture: ``config.architectures[0]``.
        options: what was asked.
        cache_key: sha256 of source hash + options + builder version + the metadata's schema version.
        output_dir: the export folder (``genai_config.json``, ``model.onnx``, tokenizer).
        command: the exact builder command line.
        versions: package versions of the export environment.
        duration_s: builder wall time in seconds (of the original export when cached).
        output_bytes: total size of the export folder in bytes.
        files: ``{file name: bytes}`` of the export folder.
        cached: True when this call reused an earlier export.
        graph: the inspection report.
        created_at: UTC time of the export.
    """

    source: str
    source_hash: str
    architecture: str | None = None
    options: ExportOptions
    cache_key: str
    output_dir: str
    command: list[str]
    versions: dict[str, str] = Field(default_factory=dict)
    duration_s: float
    output_bytes: int
    files: dict[str, int] = Field(default_factory=dict)
    cached: bool = False
    graph: GraphReport
    created_at: str

    def notes(self) -> dict[str, str]:
        """Flat ``BackendInfo.notes`` entries (command, op counts, size) for the verdict."""
        return {
            "export_command": " ".join(self.command),
            "export_precision": f"{self.options.precision} (observed: {self.graph.precision_observed})",
            "export_paged_attention": (f"true: PagedAttention graph, genai_config.json engine.dynamic_batching "
                                       f"{json.dumps(self.graph.dynamic_batching, sort_keys=True)}"
                                       if self.graph.paged_attention else "false"),
            "export_ops": self.graph.summary(),
            "export_size_bytes": str(self.output_bytes),
            "export_duration_s": str(self.duration_s),
            "export_cached": str(self.cached),
            "export_dir": self.output_dir,
            "source_hash": self.source_hash[:16],
        }
