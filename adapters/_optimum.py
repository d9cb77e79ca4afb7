"""What the two optimum export adapters share: the CLI run, its failure classes, the export cache.

``optimum-cli export onnx`` (optimum-onnx) and ``optimum-cli export openvino`` (optimum-intel)
run as ``python -m optimum.commands.optimum_cli export ...`` in their environment; their
refusals read alike (both dispatch through optimum's ``TasksManager``), so one classifier names
them. Exports are cached under ``bakeoff.host.envs.cache_root()/exports/`` by checkpoint hash
(:func:`adapters.ort_genai_export.cache.checkpoint_hash`), options, tool versions and the schema
version of the result file (:func:`adapters.ort_genai_export.cache.schema_version`); a folder
counts only once its result file exists, written last, and reads as this bakeoff's result model
(:func:`adapters.ort_genai_export.cache.read_result`). This module imports no engine.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple

from adapters.ort_genai_export.cache import checkpoint_hash, read_result, schema_version
from bakeoff.api.errors import EngineFailure
from bakeoff.host import envs
from bakeoff.host.procs import tail

CLI_MODULE = "optimum.commands.optimum_cli"
RESULT_FILE = "export.json"

# optimum exporters/tasks.py (TasksManager.get_supported_tasks_for_model_type / get_exporter_config_constructor):
# "Trying to export a qwen3_5_moe model, that is a custom or unsupported architecture, ..."
# optimum exporters (export configs with MAX_TRANSFORMERS_VERSION): "ValueError: The current version of
# Transformers does not allow for the export of the model. Maximum required is 5.2.*, got: 5.5.4"
# exporters/tasks.py (TasksManager.get_exporter_config_constructor) for a task the architecture has no
# export config for: "Asked to export a qwen3_5_moe model for the task text-generation-with-past, but the
# Optimum OpenVINO exporter only supports the tasks image-text-to-text for qwen3_5_moe."
_REFUSED = (re.compile(r"Trying to export an? (?P<mt>[\w-]+) model, that is a custom or unsupported architecture"),
            re.compile(r"The current version of Transformers does not allow for the export of the model"),
            re.compile(r"Asked to export an? (?P<mt>[\w-]+) model for the task [\w-]+.*? only supports the tasks"))
# transformers configuration_auto.py: "The checkpoint you are trying to load has model type `x` but
# Transformers does not recognize this architecture", and CONFIG_MAPPING's bare KeyError: 'x'.
_UNKNOWN = (re.compile(r"model type `(?P<mt>[\w-]+)` but Transformers does not recognize this architecture"),
            re.compile(r"^KeyError: '(?P<mt>[\w-]+)'", re.M),
            re.compile(r"(?P<mt>[\w-]+) is not supported yet", re.M),
            re.compile(r"Unrecognized configuration class .*?(?P<mt>\w+Config)"))


def read_config(model_path: Path) -> tuple[str | None, str | None]:
    """``(config.architectures[0], config.model_type)`` of a checkpoint folder (Nones if unreadable)."""
    try:
        cfg = json.loads((model_path / "config.json").read_text())
    except (OSError, ValueError):
        return None, None
    return (cfg.get("architectures") or [None])[0], cfg.get("model_type")


def last_error(text: str) -> str:
    """The last line that reads like an exception (``XError: ...``), else the last line."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if re.match(r"^[\w.]*(Error|Exception)\b", ln):
            return ln[:500]
    return lines[-1][:500] if lines else "(no output)"


def run_cli(cmd: list[str], log_path: Path, timeout_s: float, extra_env: dict[str, str] | None = None) -> tuple[int, float]:
    """Run ``cmd`` with its output to ``log_path``; ``(return code or -999 on timeout, seconds)``."""
    t0 = time.monotonic()
    with open(log_path, "wb") as fh:
        fh.write(("$ " + " ".join(cmd) + "\n").encode())
        fh.flush()
        try:
            rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, timeout=timeout_s,
                                env=envs.child_env({"TOKENIZERS_PARALLELISM": "false", **(extra_env or {})})).returncode
        except subprocess.TimeoutExpired:
            rc = -999
    return rc, round(time.monotonic() - t0, 2)


def classify_failure(tool: str, rc: int, log_path: Path, cmd: list[str], timeout_s: float,
                     arch: str | None, model_type: str | None) -> EngineFailure:
    """A failed export as a failure class with the exporter's own message.

    ``unsupported-architecture`` (naming the ``model_type``) when optimum or transformers refuse
    the architecture (no export config, an unknown ``model_type``, or an export config that caps
    the transformers version: the skew between optimum's releases and transformers'); ``hang`` past the deadline; ``config-rejected`` for an option the CLI's
    argument parser refuses; else ``export-defect`` with the last error line.
    """
    text = tail(log_path, 400)
    ev = {"export.log.tail": tail(log_path, 120), "command.txt": " ".join(cmd)}
    if rc == -999:
        return EngineFailure("hang", f"{tool} did not finish within {timeout_s:.0f} s", ev)
    for pat in (*_REFUSED, *_UNKNOWN):
        m = pat.search(text)
        if m and (pat in _REFUSED or model_type is None or m.group("mt") in (model_type, f"{_camel(model_type)}Config")):
            return EngineFailure("unsupported-architecture",
                                 f"{tool} refuses model_type {model_type!r} ({arch}): {last_error(text)}", ev)
    line = last_error(text)
    if "error: argument" in text or "error: unrecognized arguments" in text:
        return EngineFailure("config-rejected", f"{tool} refused its arguments: {line}", ev)
    return EngineFailure("export-defect", f"{tool} failed (exit {rc}) on {model_type} ({arch}): {line}", ev)


def _camel(model_type: str) -> str:
    return "".join(p.capitalize() for p in re.split(r"[_-]", model_type))


def cache_key(source_hash: str, options: dict, versions: dict[str, str], schema: str) -> str:
    """sha256 hex of what determines an export's content (source, options, tool versions) and how
    its result file reads (``schema``: the result model's ``cache.schema_version``)."""
    blob = json.dumps({"source": source_hash, "options": options, "tools": versions, "schema": schema}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def export_dir(kind: str, model_path: Path, tag: str, key: str) -> Path:
    """``<cache>/exports/<kind>-<checkpoint name>-<tag>-<key12>``."""
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", model_path.resolve().name)[:48] or "model"
    return envs.cache_root() / "exports" / f"{kind}-{slug}-{tag}-{key[:12]}"


@contextmanager
def building(final: Path) -> Iterator[Path]:
    """Hold the export's lock and give a fresh temporary folder beside ``final``; on a clean exit
    the folder replaces ``final`` (the caller wrote its result file last), else it is removed."""
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(final.parent / f".{final.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        tmp = final.parent / f".tmp-{final.name}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            yield tmp
            if (tmp / RESULT_FILE).is_file():
                if final.exists():
                    shutil.rmtree(final)
                os.rename(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


@contextmanager
def locked(final: Path) -> Iterator[None]:
    """The export's lock alone (reading the cache while no one writes it)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(final.parent / f".{final.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_SH)
        yield


def versions(python: str | Path, names: set[str]) -> dict[str, str]:
    """``{distribution: version}`` of ``names`` installed in an environment."""
    return {k: v for k, v in envs.freeze(python).items() if k.lower().replace("_", "-") in names}


class Prepared(NamedTuple):
    """What :func:`prepare` found: the checkpoint, its cache entry, the tool's interpreter and, where
    the entry is complete, its result (``cached``, else None: the caller builds into ``final``)."""

    src: Path
    arch: str | None
    model_type: str | None
    source_hash: str
    key: str
    final: Path
    python: Path
    cached: Any


def prepare(kind: str, model_path: str | Path, options: Any, tag: str, spec: envs.EnvSpec, result_model: type,
            log: Callable[[str], None], use_cache: bool = True) -> Prepared:
    """The opening every cached exporter runs (optimum-onnx, openvino, gguf): a checkpoint folder, its
    hash and the cache key (options, the environment's pins, the result's schema), the environment,
    and the cached result where a complete entry exists (read under the entry's shared lock).

    Raises:
        EngineFailure: ``load-failure`` when ``model_path`` holds no ``config.json``; what
            ``envs.ensure`` raises.
    """
    src = Path(model_path).resolve()
    if not (src / "config.json").is_file():
        raise EngineFailure("load-failure", f"{src} is not a Hugging Face checkpoint folder (no config.json)")
    arch, model_type = read_config(src)
    source_hash = checkpoint_hash(src)
    key = cache_key(source_hash, options.model_dump(mode="json"), {"env": ",".join(spec.requirements)},
                    schema_version(result_model))
    final = export_dir(kind, src, tag, key)
    python = envs.ensure(spec, log)
    cached = None
    with locked(final):
        res = read_result(final / RESULT_FILE, result_model, log) if use_cache else None
        if res is not None:
            log(f"{kind} export reused from cache: {final}")
            cached = res.model_copy(update={"cached": True, "source": str(src)})
    return Prepared(src, arch, model_type, source_hash, key, final, python, cached)
