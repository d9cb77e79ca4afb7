"""Run ``optimum-cli export openvino`` on a checkpoint, read the IR back, cache the result.

The exporter (optimum-intel, with NNCF for int8/int4 weights) and the IR reader
(:mod:`adapters.openvino_export._inspect_ir`) run in the ``openvino`` environment as
subprocesses; this module imports no engine. A refusal or crash is an
:class:`bakeoff.api.errors.EngineFailure` with its class and the exporter's own message
(:func:`adapters._optimum.classify_failure`).
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path
from typing import Callable

from adapters import _optimum
from adapters.openvino_export.env import env_spec
from adapters.openvino_export.specs import OpenVinoExportOptions, OpenVinoExportResult
from adapters.ort_genai_export.cache import folder_size
from bakeoff.api.errors import EngineFailure
from bakeoff.host import envs
from bakeoff.host.procs import tail

TOOL = "optimum-cli export openvino"
VERSIONED = {"openvino", "openvino-genai", "openvino-tokenizers", "optimum", "optimum-intel", "nncf", "transformers",
             "torch"}
# NNCF's table (nncf/quantization/algorithms/weight_compression/algorithm.py, printed through its logger)
_ROW = re.compile(r"^[│|]\s*(?P<mode>[^│|]+?)\s*[│|]\s*(?P<all>[^│|]+?)\s*[│|]\s*(?P<ratio>[^│|]+?)\s*[│|]\s*$")


def compression_report(log_text: str) -> dict:
    """NNCF's "Statistics of the bitwidth distribution" table from the exporter's log:
    ``{"report": the table as printed, "modes": {mode: "% all parameters (layers)"}}``, or {}."""
    lines = log_text.splitlines()
    start = next((i for i, ln in enumerate(lines) if "Statistics of the bitwidth distribution" in ln), None)
    if start is None:
        return {}
    table: list[str] = []
    for ln in lines[start:start + 40]:
        table.append(ln)
        if ln.startswith(("┕", "+-")) and len(table) > 3:
            break
    modes = {m.group("mode"): m.group("all") for ln in table if (m := _ROW.match(ln.strip()))
             and not m.group("mode").startswith(("Weight compression", "Num bits"))}
    return {"report": "\n".join(table), "modes": modes}


def inspect_ir(python: Path, ir_dir: Path, timeout_s: float = 600) -> dict:
    """Op counts, weight element types and tokenizer IR presence of an export (in the env)."""
    out = ir_dir / ".bakeoff-ir.json"
    cmd = [str(python), "-m", "adapters.openvino_export._inspect_ir", str(ir_dir), "--out", str(out)]
    proc = _run(cmd, timeout_s)
    if not out.is_file():
        raise EngineFailure("load-failure", f"OpenVINO could not read the exported IR: "
                            f"{_optimum.last_error(proc)}", {"inspect.log": proc[-8000:], "command.txt": " ".join(cmd)})
    data = json.loads(out.read_text())
    out.unlink()
    return data


def _run(cmd: list[str], timeout_s: float) -> str:
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=envs.child_env())
    except subprocess.TimeoutExpired as exc:
        raise EngineFailure("hang", f"{cmd[2]} exceeded {timeout_s:.0f} s", {"log": str(exc.stdout or "")[-8000:]}) from None
    return p.stdout + p.stderr


def export(model_path: str | Path, options: OpenVinoExportOptions | None = None, log: Callable[[str], None] = print,
           timeout_s: float = 3600, use_cache: bool = True) -> OpenVinoExportResult:
    """Export a Hugging Face checkpoint to OpenVINO IR with optimum-intel (cached).

    Args:
        model_path: local checkpoint folder.
        options: weight format and compression options.
        log: progress sink.
        timeout_s: exporter deadline in seconds.
        use_cache: reuse an earlier identical export (checkpoint hash + options + pins).

    Returns:
        The export with its compression report and IR op counts.

    Raises:
        EngineFailure: ``unavailable`` (environment), ``unsupported-architecture`` (naming the
            ``model_type``), ``config-rejected``, ``export-defect`` (exporter crash; an IR
            without the tokenizer OpenVINO GenAI needs), ``load-failure`` (the IR cannot be
            read), ``hang``. Evidence: the exporter's log tail and command.
    """
    options = options or OpenVinoExportOptions()
    src, arch, model_type, source_hash, key, final, python, cached = _optimum.prepare(
        "openvino", model_path, options, options.weight_format, env_spec(), OpenVinoExportResult, log, use_cache)
    if cached is not None:
        return cached
    with _optimum.building(final) as tmp:
        out_dir = tmp / "model"
        log_path = final.parent / f"{final.name}.export.log"
        cmd = [str(python), "-m", _optimum.CLI_MODULE, "export", "openvino", "--model", str(src),
               *options.cli_args(), str(out_dir)]
        log(f"exporting {src.name} ({model_type}) to OpenVINO IR: {options.weight_format}")
        rc, duration_s = _optimum.run_cli(cmd, log_path, timeout_s)
        if rc != 0 or not (out_dir / "openvino_model.xml").is_file():
            raise _optimum.classify_failure(TOOL, rc, log_path, cmd, timeout_s, arch, model_type)
        ir = inspect_ir(python, out_dir)
        if not ir.get("tokenizer_ir"):
            raise EngineFailure("export-defect", f"{TOOL} wrote no openvino_tokenizer.xml/openvino_detokenizer.xml: "
                                "OpenVINO GenAI cannot load the export without them",
                                {"export.log.tail": tail(log_path, 120), "command.txt": " ".join(cmd)})
        compression = compression_report(tail(log_path, 100_000))
        compression["ir_weight_types"] = ir.get("weight_types", {})
        (out_dir / "export.log").write_text(tail(log_path, 100_000))
        size, files = folder_size(out_dir)
        res = OpenVinoExportResult(
            source=str(src), source_hash=source_hash, architecture=arch, model_type=model_type, options=options,
            cache_key=key, output_dir=str(final / "model"), command=cmd, versions=_optimum.versions(python, VERSIONED),
            duration_s=duration_s, output_bytes=size, files=files, compression=compression,
            ir_ops=ir.get("op_counts", {}), created_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        (tmp / _optimum.RESULT_FILE).write_text(res.model_dump_json(indent=1))
    log(f"exported in {duration_s} s, {size / 1e6:.2f} MB; weights: {compression['ir_weight_types']}")
    return res
