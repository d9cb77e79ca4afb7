"""ONNX Runtime GenAI backend: export with the model builder (cached), then serve in a worker.

``start()`` runs :func:`adapters.ort_genai_export.export` (or reuses its cache), writes the
:class:`ExportResult` to ``<workdir>/export.json`` and keeps it at ``self.export_result``,
then launches :mod:`backends.ort_genai.worker` in the ``ort-genai`` environment (HTTP; it
starts :mod:`backends.ort_genai.engine`, the model's own process). Export
problems surface as ``EngineFailure`` (``unsupported-architecture``, ``export-defect``,
``load-failure``) from ``start()``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from adapters.ort_genai_export import ExportOptions, ExportResult, env_spec, export
from backends.ort_genai.preflight import rule as preflight_rule
from backends._hosting.threads import option_or_default
from backends._options import OptionReport, OptionStatement, fallback_statements, read_log, rule, scan
from backends._export_worker import ExportWorkerBackend
from bakeoff.host import envs
from bakeoff.api.specs import BackendInfo


BUILDER_PY = "onnxruntime_genai/models/builder.py"
# The model builder's words (0.18.0 source) when it builds something else than asked (export's builder.log).
BUILDER_RULES = [
    rule("execution_provider", r"Setting `--execution_provider \w+` by default", "overridden",
         f"{BUILDER_PY} create_model (MoE models that only build for CUDA)"),
    rule("precision", r"Setting `--precision \w+` by default", "overridden", f"{BUILDER_PY} create_model"),
    rule("precision", r"reaches only the parts of the model the checkpoint left unquantized", "ignored",
         f"{BUILDER_PY} warn_if_checkpoint_overrides_precision (pre-quantized checkpoint)"),
    rule("extra_options", r"overrides legacy extra_options\.\w+", "overridden",
         "onnxruntime_genai/models/builder_config.py warn_structured_override"),
]
# The runtime's (libonnxruntime-genai.so strings, 0.18.0), in the worker log.
RUNTIME_RULES = [
    rule("execution_provider", r"Falling back to CPU allocations for the KV cache", "fell-back",
         "onnxruntime-genai QNN GPU shared-memory allocator"),
]
QUANT_ONLY = ("block_size", "accuracy_level", "int4_algo")  # read by the builder only when it quantizes linears
BAKEOFF_KEYS = {"reuse_export", "export_timeout_s", "stream_interval_ms", "lone_request", "max_batch_size"}  # bakeoff's caching, framing, scheduling


# W4A16 as the field ships it: INT4 linears with the lm_head left out of INT4 (AWQ and GPTQ
# checkpoints ignore lm_head, as bakeoff's own AWQ adapter does; llama.cpp keeps output.weight
# at a higher precision). The builder's own default (``default``: plain RTN on every MatMul,
# lm_head too) lost 10 of the fixture's 240 probes on an AVX-512 host (sanity.known_answers
# 95.8% vs 100%, McNemar p=0.001) while ``rtn_last`` (RTN body, last MatMul int8) and
# ``k_quant_mixed`` lost none: the 64-wide fixture's lm_head is its most sensitive weight, and
# how many probes it flips varies with the host the fixture was trained on. Pass
# ``int4_algo=default`` for the builder's own choice.
INT4_DEFAULT_ALGO = "rtn_last"


# The 0.18.0 builder's refusal on CPU (onnxruntime_genai/models/builders/base.py make_attention_init;
# tests/test_ort_genai.py runs it): bakeoff's CPU default does not ask for PagedAttention.
PAGED_REFUSAL_CPU = ("NotImplementedError: PagedAttention (use_paged_attention=true) requires CUDA with FP16/BF16 "
                     "or WebGPU with FP16, not (cpu, FLOAT).")
BASE_PY = "onnxruntime_genai/models/builders/base.py make_attention_init"


def paged_default(opts: "OrtGenaiOptions") -> tuple[bool, str]:
    """bakeoff's ``paged_attention`` when the user leaves it unset, and why, for the run's notes.

    True on CUDA unless the activations are fp32 (the 0.18.0 builder builds ``PagedAttention``
    for ``(cuda, FLOAT16)``, ``(cuda, BFLOAT16)`` and ``(webgpu, FLOAT16)`` only, :data:`BASE_PY`;
    int4/int8 weights keep fp16 activations on CUDA, ``quantization/quant_config.py``
    ``default_io_dtype``): ``genai_config.json`` then carries ``engine.dynamic_batching`` and
    ``og.Engine`` batches continuously (``docs/paged_attention_engine.md`` "How the dynamic path
    is selected", onnxruntime-genai). False on CPU, where the builder refuses it
    (:data:`PAGED_REFUSAL_CPU`), with ``batching=generator`` (og.Generator cannot feed its 1-D
    ids), and on other providers (WebGPU is built by the builder but was never run by bakeoff:
    ``paged_attention=true`` asks for it).
    """
    ep, precision = opts.execution_provider, opts.precision
    asked = opts.extra_options.get("use_paged_attention")
    if asked is not None:
        return str(asked).lower() in ("1", "true", "yes"), f"extra_options use_paged_attention={asked}"
    if opts.batching in ("generator", "static"):
        return False, f"batching={opts.batching}: og.Generator feeds 2-D input_ids, a PagedAttention decoder takes 1-D"
    if ep == "cuda" and precision != "fp32":
        return True, (f"bakeoff's CUDA default: the model builder's use_paged_attention=true ({BASE_PY}: CUDA with "
                      "FP16/BF16 activations), so that og.Engine batches continuously (genai_config.json "
                      "engine.dynamic_batching); paged_attention=false for the static GroupQueryAttention export")
    if ep == "cuda":
        return False, (f"fp32 on CUDA: the builder's PagedAttention needs FP16/BF16 activations ({BASE_PY}); "
                       "og.Engine batches statically")
    if ep == "cpu":
        return False, (f"the model builder refuses PagedAttention on CPU: \"{PAGED_REFUSAL_CPU}\" ({BASE_PY}); "
                       "og.Engine batches statically")
    return False, f"bakeoff enables PagedAttention by default on CUDA only; paged_attention=true asks the builder for {ep}"


def cuda_graph_default(opts: "OrtGenaiOptions", paged: bool) -> tuple[bool, str]:
    """bakeoff's ``cuda_graph`` when unset, and why: on for a paged CUDA export.

    The builder leaves CUDA graphs off (``enable_cuda_graph``, builder.py "Default is false");
    og.Engine's paged path captures pure decode steps and replays them
    (``docs/paged_attention_engine.md`` "CUDA graph capture", onnxruntime-genai). Seen on the
    H200 (2026-12-03, random Qwen3-1.7B fp16, 128 tokens): 171 -> 384 tok/s at 1 session, 1,399
    -> 2,672 at 8, 5,017 -> 7,788 at 32 (docs/gpu.md). Not measured on the static export: off there.
    """
    asked = opts.extra_options.get("enable_cuda_graph")
    if asked is not None:
        return str(asked).lower() in ("1", "true", "yes"), f"extra_options enable_cuda_graph={asked}"
    if paged and opts.execution_provider == "cuda":
        return True, ("bakeoff's default with PagedAttention on CUDA: the builder's enable_cuda_graph=true, og.Engine "
                      "replays pure decode steps as CUDA graphs (docs/paged_attention_engine.md 'CUDA graph capture', "
                      "onnxruntime-genai); cuda_graph=false turns it off")
    return False, "the builder's default (enable_cuda_graph false)"


class OrtGenaiOptions(ExportOptions):
    """``--backend-opt`` keys of the ort-genai backend: the export's (:class:`ExportOptions`:
    ``precision``, ``execution_provider``, ``block_size``, ``accuracy_level``, ``int4_algo``,
    ``moe_quant_type``, ``qmoe_block_size``, ``extra_options``) and these. With
    ``precision=int4`` and no ``int4_algo``, the export uses :data:`INT4_DEFAULT_ALGO`.

    Attributes:
        batching: ``engine`` (``og.Engine`` schedules several requests per step),
            ``generator`` (one ``og.Generator`` at a time) or ``static`` (the greedy requests
            waiting together as one right-padded ``og.Generator`` batch of up to
            ``max_batch_size``, restarted young to take in a wave's late arrivals:
            ``backends/ort_genai/generator_batch.py``); unset: ``engine`` for a paged export
            (served by ``og.Engine`` only: continuous batching), ``static`` otherwise (CPU):
            og.Engine's static scheduler runs at most 4 requests per batch, and 0.18.0's Engine
            fails every request of an MRoPE export (Qwen3.5-MoE) that og.Generator runs. On
            SmolLM2-135M int4 (2-core host, 8 sessions) ``static`` served 192 tok/s at TTFT p50
            0.78 s, ``engine`` 178 tok/s at 1.64 s; at 1 session 88 against 85 tok/s
            (``benchmarks/bench_fidelity.py``, 2026-12-05). Stated in the run's notes.
        max_batch_size: ``batching=static``: most rows of one og.Generator batch (also the
            batches of greedy logprobs requests, which run on og.Generator under any batching).
        paged_attention: export with ``PagedAttention`` (:class:`ExportOptions`), so that
            ``og.Engine`` batches continuously; unset: :func:`paged_default` (true on CUDA
            where the builder builds it, false on CPU, where it refuses).
        cuda_graph: CUDA graph capture (:class:`ExportOptions`); unset: on with a paged CUDA
            export (:func:`cuda_graph_default`), off otherwise.
        reuse_export: reuse a cached export of the same checkpoint and options.
        export_timeout_s: builder deadline in seconds.
        intra_op_num_threads: ONNX Runtime intra-op threads of the decoder session (genai_config
            ``session_options.intra_op_num_threads``, set through ``og.Config.overlay``); unset: on
            CPU bakeoff's default, the usable CPUs less one for the worker's HTTP side and the
            client (:func:`backends._hosting.threads.default_threads`: 1 on a 2-core host, where
            ORT's own default of 2 cost the worker 1.2-1.4x tokens/s), stated in the run's
            notes; on other providers ORT's default (one per physical core).
        stream_interval_ms: batching period of dense streams. A token that follows the
            previous one of its stream by less than this is held and leaves with the next
            frame, at most one per interval, each token still counted (``token_ids`` lists
            them); it reaches the client within two intervals. A stream's first token and any
            token after a longer gap go out at once, so TTFT and the ITL of a slower model
            (e.g. 20 ms/token on a GPU) are not touched. Why: each frame the engine process
            sends costs its decode thread (framing, a pipe write the worker reads from another
            core); on a tiny CPU model (~0.2-0.4 ms/token) a frame per token cost the decode
            loop 5-10% of its tokens/s, one per 2 ms about 1-2% (``benchmarks/bench_ort_genai.py``,
            in-run split). 0 sends every token at once.
        lone_request: with ``batching=engine`` on a static export (no PagedAttention: CPU), a request
            that finds the engine idle and none waiting runs on ``og.Generator`` (``generator``,
            the default: one sequence decodes ~10-20% faster there, and requests that arrive
            meanwhile wait for it as they would for the static batch of one it would be) or as
            an og.Engine batch of one (``engine``). Stated in the run's notes (``og_engine``).
    """

    batching: Literal["engine", "generator", "static"] | None = None
    max_batch_size: int = Field(16, ge=1)
    paged_attention: bool | None = None
    cuda_graph: bool | None = None
    reuse_export: bool = True
    export_timeout_s: float = Field(3600.0, gt=0)
    intra_op_num_threads: int | None = Field(None, ge=1)
    stream_interval_ms: float = Field(2.0, ge=0, le=100)
    lone_request: Literal["generator", "engine"] = "generator"

    @model_validator(mode="after")
    def _generator_cannot_feed_a_paged_graph(self) -> "OrtGenaiOptions":
        if self.paged_attention and self.batching in ("generator", "static"):
            raise ValueError(f"batching={self.batching} cannot serve a paged_attention export (og.Generator feeds 2-D "
                             "input_ids, a PagedAttention decoder takes 1-D packed ids): drop one of them")
        return self

    def export_options(self) -> ExportOptions:
        """The export's options: INT4 without ``int4_algo`` gets :data:`INT4_DEFAULT_ALGO`, an
        unset ``paged_attention`` gets :func:`paged_default`."""
        opts = self.model_dump(include=set(ExportOptions.model_fields))
        if opts["precision"] == "int4" and opts["int4_algo"] is None:
            opts["int4_algo"] = INT4_DEFAULT_ALGO
        opts["paged_attention"] = paged_default(self)[0] if self.paged_attention is None else self.paged_attention
        opts["cuda_graph"] = (cuda_graph_default(self, opts["paged_attention"])[0] if self.cuda_graph is None
                              else self.cuda_graph)
        return ExportOptions(**opts)


class OrtGenaiBackend(ExportWorkerBackend):
    """ONNX Runtime GenAI serving a model-builder export of the checkpoint."""

    preflight_rule = staticmethod(preflight_rule)

    name = "ort-genai"
    Options = OrtGenaiOptions
    engine_env = staticmethod(env_spec)
    export_fn = staticmethod(export)
    worker_module = "backends.ort_genai.worker"
    export_result: ExportResult | None

    def threads(self) -> tuple[int | None, str]:
        """The decoder session's intra-op threads the worker gets, and why (None: ORT's default)."""
        if self.options.execution_provider == "cpu" or self.options.intra_op_num_threads is not None:
            return option_or_default(self.options.intra_op_num_threads, "intra_op_num_threads")
        return None, "ORT's default (one per physical core)"

    def engine_options(self) -> dict:
        return {"batching": self.options.batching, "execution_provider": self.options.execution_provider,
                "source_model": self.export_result.source, "intra_op_num_threads": self.threads()[0],
                "stream_interval_ms": self.options.stream_interval_ms, "lone_request": self.options.lone_request,
                "max_batch_size": self.options.max_batch_size}

    def describe(self, startup_s: float) -> BackendInfo:
        info = self.ready_payload.get("info", {})
        notes = {**self.export_result.notes(), "batching": str(info.get("batching")),
                 "tokenizer": str(info.get("tokenizer")), "detokenizer": str(info.get("detokenizer")),
                 "intra_op_num_threads": f"{info.get('intra_op_num_threads', 'ORT default')} ({self.threads()[1]})",
                 "stream_interval_ms": str(info.get("stream_interval_ms")), "environment": envs.describe(self.env_python)}
        exported = self.options.export_options()
        if exported.int4_algo and self.options.int4_algo is None:  # bakeoff's default, stated where options are read
            notes["int4_algo"] = f"{exported.int4_algo} (bakeoff's INT4 default: lm_head out of INT4)"
        if self.options.paged_attention is None:
            value, why = paged_default(self.options)
            notes["paged_attention"] = f"{str(value).lower()} ({why})"
        if self.options.cuda_graph is None and self.options.execution_provider == "cuda":
            value, why = cuda_graph_default(self.options, exported.paged_attention)
            notes["cuda_graph"] = f"{str(value).lower()} ({why})"
        worker_notes = {k: str(v) for k, v in (info.get("notes") or {}).items()}
        # the worker's "<option>_fallback" notes travel as fallbacks, by option (one channel)
        fallbacks = {k.removesuffix("_fallback"): v for k, v in worker_notes.items() if k.endswith("_fallback")}
        notes.update({k: v for k, v in worker_notes.items() if not k.endswith("_fallback")})
        if info.get("engine_max_batch_size") is not None:
            notes["engine_max_batch_size"] = str(info["engine_max_batch_size"])
        described = BackendInfo(
            backend=self.name, engine="onnxruntime-genai", engine_version=info.get("engine_version"),
            device=info.get("device", "cpu"), max_model_len=info.get("max_model_len"),
            launch_command=self.launch_cmd, base_url=self.base_url, served_model=self.config.model,
            startup_s=startup_s, notes=notes,
            concurrent_requests={"generator": 1, "static": self.options.max_batch_size}.get(
                info.get("batching"), info.get("engine_max_batch_size")),
            fallbacks=fallbacks)
        self.info = described  # option_report() reads the export and the worker's notes through it
        rep = self.option_report()
        described.ignored_options = [st.model_dump(include={"option", "kind", "line"}) for st in rep.ignored()] if rep else []
        return described

    def option_report(self) -> OptionReport | None:
        """What the builder, the runtime and the worker said about the options the user set.

        Rules: the builder's and runtime's messages (:data:`BUILDER_RULES`, :data:`RUNTIME_RULES`)
        and the backend's ``fallbacks`` are statements; ``precision`` is verified by the
        exported graph's observed precision, ``moe_quant_type``/``qmoe_block_size`` by its
        ``QMoE`` nodes (none: ignored), ``batching`` by what the worker serves with; the
        INT4/INT8 knobs under a float precision are ignored by the builder (it reads them only
        when it quantizes); ``execution_provider=cpu`` holds by construction (the worker clears
        the providers, leaving ORT's CPU one). None before a start.
        """
        if self.info is None or self.export_result is None:
            return None
        opts = {k: v for k, v in self.config.options.items() if k not in BAKEOFF_KEYS}
        rep = OptionReport(engine="onnxruntime-genai", set_options=opts)
        graph, precision = self.export_result.graph, self.options.precision
        for opt, want in opts.items():
            self._verify_option(rep, opt, want, graph, precision)
            if opt not in rep.verified:
                rep.unverifiable[opt] = "onnxruntime-genai states no effect for it"
        builder_log = Path(self.export_result.output_dir) / "builder.log"
        for st in (scan(read_log(builder_log), BUILDER_RULES, opts, "builder.log")
                   + scan(read_log(self.log_path), RUNTIME_RULES, opts, self.log_path.name)
                   + fallback_statements(self.info.fallbacks, opts, "ort-genai")):
            rep.add(st)
        for st in rep.ignored():
            rep.unverifiable.pop(st.option, None)
        return rep

    def _verify_option(self, rep: OptionReport, opt: str, want, graph, precision: str) -> None:
        """What the export graph, its config and the worker show of one option the user set, into
        ``rep`` (verified, or a statement that it was overridden or ignored); see :meth:`option_report`."""
        if opt == "precision":
            expect = precision if precision in ("int4", "int8") else "float"
            if graph.precision_observed == expect:
                rep.verified[opt] = f"export graph: {graph.precision_observed} ({graph.summary()})"
            else:
                rep.add(OptionStatement(option=opt, kind="overridden", user_set=True, log="export.json",
                                        line=f"export_precision: {self.info.notes.get('export_precision')}",
                                        source="adapters/ort_genai_export graph inspection"))
        elif opt in ("moe_quant_type", "qmoe_block_size"):
            if graph.has_qmoe:
                rep.verified[opt] = "export graph has QMoE nodes"
            else:
                rep.add(OptionStatement(option=opt, kind="ignored", user_set=True, log="export.json",
                                        line=f"(no QMoE node in the export graph: {graph.summary()})",
                                        source="adapters/ort_genai_export graph inspection"))
        elif opt in QUANT_ONLY and precision not in ("int4", "int8"):
            rep.add(OptionStatement(option=opt, kind="ignored", user_set=True, log="(builder source)",
                                    line=f"(no log line) precision={precision}: the model builder reads {opt} only "
                                         "when it quantizes linears (int4/int8)", source=BUILDER_PY))
        elif opt == "batching" and self.info.notes.get("batching") == str(want):
            rep.verified[opt] = f"the worker serves with {want}"
        elif opt == "cuda_graph" and _cuda_graph_in_config(self.export_result.output_dir) == bool(want):
            rep.verified[opt] = f"genai_config.json: CUDA provider option enable_cuda_graph={int(bool(want))}"
        elif opt == "paged_attention" and graph.paged_attention == bool(want):
            rep.verified[opt] = (f"export graph: {'PagedAttention nodes, genai_config.json engine.dynamic_batching' if want else 'no PagedAttention'}"
                                 f"; {self.info.notes.get('og_engine', 'og.Generator')}")
        elif opt == "execution_provider" and want == "cpu":
            rep.verified[opt] = "the worker clears the providers: ORT's CPU provider runs the graph"


def _cuda_graph_in_config(export_dir: str) -> bool:
    """Whether the export's ``genai_config.json`` asks the CUDA provider for graph capture."""
    try:
        cfg = json.loads((Path(export_dir) / "genai_config.json").read_text())
    except (OSError, ValueError):
        return False
    provs = cfg.get("model", {}).get("decoder", {}).get("session_options", {}).get("provider_options", [])
    return any(str((p.get("cuda") or {}).get("enable_cuda_graph")) == "1" for p in provs if isinstance(p, dict))
