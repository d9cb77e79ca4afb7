"""Run ``optimum-cli export onnx`` on a checkpoint (int8: then optimum's quantizer), inspect, cache.

The exporter, the quantizer and the graph inspection
(:mod:`adapters.ort_genai_export._inspect_child`, without its ``og.Model`` stage) run in the
``optimum-onnx`` environment as subprocesses; this module imports no engine.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

from adapters import _optimum
from adapters.optimum_onnx_export.env import env_spec
from adapters.optimum_onnx_export.specs import OptimumOnnxOptions, OptimumOnnxResult
from adapters.ort_genai_export.cache import folder_size
from adapters.ort_genai_export.export import inspect_graph, raise_for_problems
from bakeoff.api.errors import EngineFailure
from bakeoff.host import envs
from bakeoff.host.procs import tail

TOOL = "optimum-cli export onnx"
VERSIONED = {"optimum", "optimum-onnx", "onnx", "onnxruntime", "transformers", "torch"}


def inspect(export_dir: str | Path, options: OptimumOnnxOptions, python: str | Path | None = None):
    """The shared graph inspection of an optimum export (no ``og.Model`` stage); problems listed, not raised."""
    python = python or envs.ensure(env_spec())
    return inspect_graph(export_dir, {"onnx_file": options.onnx_file, "og_load": False}, python=python)


def _precision_problems(graph, options: OptimumOnnxOptions) -> list[dict]:
    """int8 asked: the quantizer's dynamic int8 MatMuls (``MatMulInteger``) must be in the graph."""
    if options.precision == "int8" and not graph.op_counts.get("MatMulInteger"):
        return [{"failure_class": "export-defect", "stage": "precision", "node": None, "op_type": None,
                 "message": f"requested int8 but the graph has no MatMulInteger (MatMul: {graph.op_counts.get('MatMul', 0)})"}]
    return []


def export(model_path: str | Path, options: OptimumOnnxOptions | None = None, log: Callable[[str], None] = print,
           timeout_s: float = 3600, use_cache: bool = True) -> OptimumOnnxResult:
    """Export a Hugging Face checkpoint with optimum's ONNX exporter (cached), inspected.

    Raises:
        EngineFailure: ``unavailable`` (environment), ``unsupported-architecture`` (naming the
            ``model_type``), ``config-rejected``, ``export-defect`` (exporter or quantizer crash;
            checker, shape inference or forward-step problems naming node and op),
            ``load-failure`` (ORT cannot create a session), ``hang``.
    """
    options = options or OptimumOnnxOptions()
    src, arch, model_type, source_hash, key, final, python, cached = _optimum.prepare(
        "optimum-onnx", model_path, options, options.precision, env_spec(), OptimumOnnxResult, log, use_cache)
    if cached is not None:
        return cached
    with _optimum.building(final) as tmp:
        out_dir = tmp / "model"
        log_path = final.parent / f"{final.name}.export.log"
        cmd = [str(python), "-m", _optimum.CLI_MODULE, "export", "onnx", "--model", str(src), *options.cli_args(),
               str(out_dir)]
        log(f"exporting {src.name} ({model_type}) with {TOOL}: {options.precision}")
        rc, duration_s = _optimum.run_cli(cmd, log_path, timeout_s)
        if rc != 0 or not (out_dir / "model.onnx").is_file():
            raise _optimum.classify_failure(TOOL, rc, log_path, cmd, timeout_s, arch, model_type)
        qcmd: list[str] = []
        if options.precision == "int8":
            qcmd = [str(python), "-m", "adapters.optimum_onnx_export._quantize", str(out_dir)]
            qlog = final.parent / f"{final.name}.quantize.log"
            rc, q_s = _optimum.run_cli(qcmd, qlog, timeout_s)
            duration_s = round(duration_s + q_s, 2)
            if rc != 0 or not (out_dir / options.onnx_file).is_file():
                raise EngineFailure("export-defect", f"optimum ORTQuantizer failed (exit {rc}): "
                                    f"{_optimum.last_error(tail(qlog, 200))}",
                                    {"quantize.log.tail": tail(qlog, 120), "command.txt": " ".join(qcmd)})
        graph = inspect(out_dir, options, python)
        extra = _precision_problems(graph, options)
        if extra:
            graph = graph.model_validate({**graph.model_dump(), "problems": extra + [p.model_dump() for p in graph.problems]})
        raise_for_problems(graph, {"export.log.tail": tail(log_path, 60), "command.txt": " ".join(cmd)})
        (out_dir / "export.log").write_text(tail(log_path, 100_000))
        size, files = folder_size(out_dir)
        res = OptimumOnnxResult(
            source=str(src), source_hash=source_hash, architecture=arch, model_type=model_type, options=options,
            cache_key=key, output_dir=str(final / "model"), onnx_file=options.onnx_file, command=cmd,
            quantize_command=qcmd, versions=_optimum.versions(python, VERSIONED), duration_s=duration_s,
            output_bytes=size, files=files, graph=graph, created_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        (tmp / _optimum.RESULT_FILE).write_text(res.model_dump_json(indent=1))
    log(f"exported in {duration_s} s, {size / 1e6:.2f} MB: {graph.summary()}")
    return res
