"""Run the onnxruntime-genai model builder on a checkpoint, inspect the graph, cache the result.

Everything engine-side runs in the ``ort-genai`` environment as a subprocess
(``python -m onnxruntime_genai.models.builder ...`` and
``python -m adapters.ort_genai_export._inspect_child``); this module imports no engine.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Callable

from adapters.ort_genai_export import cache
from adapters.ort_genai_export.env import ORT_GENAI_VERSION, env_spec
from adapters.ort_genai_export.specs import ExportOptions, ExportResult, GraphReport
from bakeoff.host import envs
from bakeoff.api.errors import EngineFailure
from bakeoff.host.procs import tail

UNSUPPORTED = re.compile(r"NotImplementedError: (The .* model is not currently supported\.?)")
PAGED_REFUSED = re.compile(r"NotImplementedError: PagedAttention \(use_paged_attention=true\) requires")
# Stage order used to pick the headline problem of a report.
STAGE_ORDER = ("read", "builder", "graph", "precision", "paged", "checker", "shape-inference", "session", "forward", "og-load")


def _architecture(model_path: Path) -> str | None:
    try:
        return (json.loads((model_path / "config.json").read_text()).get("architectures") or [None])[0]
    except (OSError, ValueError):
        return None


def _last_error(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if re.match(r"^[\w.]*(Error|Exception)\b", ln) or "Error:" in ln:
            return ln[:500]
    return lines[-1][:500] if lines else "(no output)"


VERSIONED = {"onnxruntime-genai", "onnxruntime", "onnx", "onnx-ir", "onnxscript", "torch", "transformers", "numpy"}


def _versions(python: str | Path) -> dict[str, str]:
    return {k: v for k, v in envs.freeze(python).items() if k.lower().replace("_", "-") in VERSIONED}


def inspect_graph(onnx_dir: str | Path, expect: ExportOptions | dict | None = None, timeout_s: float = 1800,
                  log: Callable[[str], None] = lambda s: None, python: str | Path | None = None) -> GraphReport:
    """Inspect an export folder in the ORT environment (op counts, checker, shape inference, forward).

    Args:
        onnx_dir: folder with ``genai_config.json`` and the ONNX model.
        expect: the options it was exported with (precision checks), or the inspector's own
            keys as a dict (``onnx_file``, ``og_load``: other exporters); None checks none.
        timeout_s: deadline for the inspection subprocess in seconds.
        log: progress sink.
        python: the interpreter to inspect with (default: the ort-genai environment's).

    Returns:
        The report; problems are listed in it, never raised.

    Raises:
        EngineFailure: ``unavailable`` when the environment cannot be created, ``hang`` on
            timeout, ``runtime-crash`` when the inspector itself dies.
    """
    python = python or envs.ensure(env_spec(), log)
    out = Path(onnx_dir) / f".bakeoff-report-{os.getpid()}.json"
    expect_json = json.dumps(expect.model_dump(mode="json") if isinstance(expect, ExportOptions) else expect or {})
    # run as a file, not ``-m``: the package's __init__ needs pydantic, which other exporters'
    # environments (optimum-onnx) lack; the inspector itself imports only the standard library
    cmd = [str(python), str(Path(__file__).with_name("_inspect_child.py")), str(onnx_dir), "--expect", expect_json,
           "--out", str(out)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=envs.child_env())
    except subprocess.TimeoutExpired as exc:
        raise EngineFailure("hang", f"graph inspection of {onnx_dir} exceeded {timeout_s:.0f} s",
                            {"inspect.log": str(exc.stdout or "")[-8000:]}) from None
    if not out.is_file():
        log_text = (proc.stdout + proc.stderr)[-8000:]
        raise EngineFailure("runtime-crash", f"graph inspector exited {proc.returncode}: {_last_error(log_text)}",
                            {"inspect.log": log_text, "command.txt": " ".join(cmd)})
    data = json.loads(out.read_text())
    out.unlink()
    data.pop("traceback", None)
    return GraphReport.model_validate(data)


def raise_for_problems(report: GraphReport, evidence: dict[str, str] | None = None) -> None:
    """Raise the report's headline problem as an :class:`EngineFailure`, if it has any.

    The failure class is the first problem's in pipeline order (graph, precision, checker,
    shape inference, session, forward, og load); the message names node and op; every
    problem goes to ``graph_problems.json``.
    """
    if not report.problems:
        return
    ordered = sorted(report.problems, key=lambda p: STAGE_ORDER.index(p.stage) if p.stage in STAGE_ORDER else 99)
    head = ordered[0]
    where = f" at node {head.node}" + (f" (op {head.op_type})" if head.op_type else "") if head.node else ""
    first_line = head.message.splitlines()[0] if head.message else ""
    more = f" (+{len(ordered) - 1} more problem(s))" if len(ordered) > 1 else ""
    ev = dict(evidence or {})
    ev["graph_problems.json"] = json.dumps([p.model_dump() for p in ordered], indent=1)
    ev["graph_report.json"] = report.model_dump_json(indent=1)
    raise EngineFailure(head.failure_class, f"{head.stage}{where}: {first_line}{more}", ev)


def builder_command(python: str | Path, model_path: Path, out_dir: Path, options: ExportOptions) -> list[str]:
    """The builder CLI (builder.py ``get_args`` in 0.18.0; its ``--help`` crashes, so not parsed)."""
    cmd = [str(python), "-m", "onnxruntime_genai.models.builder", "-i", str(model_path), "-o", str(out_dir),
           "-p", options.precision, "-e", options.execution_provider, "-c", str(out_dir.parent / "hf-cache")]
    extra = options.builder_extra_options()
    if extra:
        cmd += ["--extra_options", *[f"{k}={v}" for k, v in extra.items()]]
    return cmd


def _run_builder(cmd: list[str], log_path: Path, timeout_s: float) -> tuple[int, float]:
    t0 = time.monotonic()
    with open(log_path, "wb") as fh:
        fh.write(("$ " + " ".join(cmd) + "\n").encode())
        fh.flush()
        try:
            rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, timeout=timeout_s,
                                env=envs.child_env({"TOKENIZERS_PARALLELISM": "false"})).returncode
        except subprocess.TimeoutExpired:
            rc = -999
    return rc, round(time.monotonic() - t0, 2)


def _classify_builder_failure(rc: int, log_path: Path, cmd: list[str], timeout_s: float, arch: str | None) -> EngineFailure:
    text = tail(log_path, 400)
    ev = {"builder.log.tail": tail(log_path, 120), "command.txt": " ".join(cmd)}
    if rc == -999:
        return EngineFailure("hang", f"model builder did not finish within {timeout_s:.0f} s", ev)
    m = UNSUPPORTED.search(text)
    if m:
        return EngineFailure("unsupported-architecture",
                             f"onnxruntime-genai {ORT_GENAI_VERSION} builder refuses {arch}: {m.group(1)}", ev)
    line = _last_error(text)
    # an option the builder refuses for this model / provider / precision, in its own words
    # (0.18.0: "NotImplementedError: PagedAttention (use_paged_attention=true) requires CUDA ...")
    klass = ("config-rejected" if line.startswith(("ValueError", "AssertionError")) or PAGED_REFUSED.search(line)
             else "export-defect")
    return EngineFailure(klass, f"model builder failed (exit {rc}) on {arch}: {line}", ev)


def _builder_findings(log_path: Path) -> list[dict]:
    """Problems the builder's own log reveals (0.18.0 prints one 'Reading LM head' per LM head it takes)."""
    n = tail(log_path, 100_000).count("Reading LM head")
    if n <= 1:
        return []
    return [{"failure_class": "export-defect", "stage": "builder", "node": "/lm_head/MatMul", "op_type": "MatMul",
             "message": (f"the builder read an LM head {n} times: it takes every Linear with out_features == "
                         "vocab_size for the LM head (onnxruntime_genai/models/builders/base.py has_lm_head), "
                         "so an in-layer projection replaced the real one")}]


def export(model_path: str | Path, options: ExportOptions | None = None, log: Callable[[str], None] = print,
           timeout_s: float = 3600, use_cache: bool = True) -> ExportResult:
    """Export a Hugging Face checkpoint with the onnxruntime-genai model builder (cached).

    Args:
        model_path: local checkpoint folder (``config.json`` + safetensors + tokenizer).
        options: precision, execution provider, INT4 and MoE options.
        log: progress sink, one line per call.
        timeout_s: builder deadline in seconds.
        use_cache: reuse an earlier identical export (key: checkpoint hash + options + version +
            the metadata's schema version, ``cache.schema_version``).

    Returns:
        The export, with its graph report (clean: no problems).

    Raises:
        EngineFailure: ``unavailable`` (environment), ``unsupported-architecture`` (builder
            refuses ``config.architectures[0]``), ``config-rejected`` (builder ValueError on an
            option), ``export-defect`` (builder crash, checker/shape inference/precision/dead
            node problems, naming node and op), ``load-failure`` (ORT session or ``og.Model``
            cannot load it), ``hang`` (deadline). Evidence: builder log tail, command, report.
    """
    options = options or ExportOptions()
    src = Path(model_path).resolve()
    if not (src / "config.json").is_file():
        raise EngineFailure("load-failure", f"{src} is not a Hugging Face checkpoint folder (no config.json)")
    arch = _architecture(src)
    source_hash = cache.checkpoint_hash(src)
    key = cache.cache_key(source_hash, options, ORT_GENAI_VERSION)
    final = cache.export_dir(src, options, key)
    result_path = final / cache.RESULT_FILE
    python = envs.ensure(env_spec(), log)
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(final.parent / f".{final.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        res = cache.read_result(result_path, ExportResult, log) if use_cache else None
        if res is not None:
            log(f"ort-genai export reused from cache: {final}")
            # the same content may sit in another folder than the one first exported (a copy, a
            # moved checkpoint): the tokenizer fallback reads the source, so it is this folder
            return res.model_copy(update={"cached": True, "source": str(src)})
        tmp = final.parent / f".tmp-{final.name}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        out_dir = tmp / "model"
        log_path = final.parent / f"{final.name}.builder.log"
        cmd = builder_command(python, src, out_dir, options)
        log(f"exporting {src.name} ({arch}) with onnxruntime-genai {ORT_GENAI_VERSION}: {options.precision} "
            f"{options.execution_provider}")
        try:
            rc, duration_s = _run_builder(cmd, log_path, timeout_s)
            if rc != 0 or not (out_dir / "genai_config.json").is_file():
                raise _classify_builder_failure(rc, log_path, cmd, timeout_s, arch)
            shutil.rmtree(tmp / "hf-cache", ignore_errors=True)
            report = inspect_graph(out_dir, options, log=log)
            builder_problems = _builder_findings(log_path)
            if builder_problems:
                report = GraphReport.model_validate(
                    {**report.model_dump(), "problems": builder_problems + [p.model_dump() for p in report.problems]})
            raise_for_problems(report, {"builder.log.tail": tail(log_path, 60), "command.txt": " ".join(cmd)})
            shutil.copy(log_path, out_dir / "builder.log")
            size, files = cache.folder_size(out_dir)
            res = ExportResult(
                source=str(src), source_hash=source_hash, architecture=arch, options=options, cache_key=key,
                output_dir=str(final / "model"), command=cmd, versions=_versions(python),
                duration_s=duration_s, output_bytes=size, files=files, graph=report,
                created_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
            (tmp / cache.RESULT_FILE).write_text(res.model_dump_json(indent=1))
            if final.exists():
                shutil.rmtree(final)
            os.rename(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        log(f"exported in {duration_s} s, {size / 1e6:.2f} MB: {report.summary()}")
        return res
