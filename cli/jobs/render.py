"""Render a job as a self-contained uv script (PEP 723 ``# /// script`` metadata + a task).

The script pins bakeoff (a version, a git URL, a wheel, or a local folder) and the engine's
requirements, embeds the :class:`~cli.jobs.specs.JobTask` as a literal, and calls
:func:`cli.jobs.runtime.run_task`. The same file runs as a Hugging Face Job and with
``uv run script.py --out DIR`` on any machine.
"""

from __future__ import annotations

import base64
import json
import pprint
import re
from pathlib import Path
from typing import Any

from bakeoff import __version__
from bakeoff.api.errors import UserError
from cli.jobs.specs import JobTask
from bakeoff.host.redact import redact
import adapters

PYTORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
TORCH_INDEXES = ("auto", "pytorch-cpu", "pypi")


def engine_requirements(task: JobTask) -> list[str]:
    """The pip requirements the task's engine needs in the script's environment.

    Export jobs get the adapter environment's pins (the script's environment then *is* that
    environment: bakeoff.host.envs finds the engine preinstalled there); qualify jobs get bakeoff's
    ``reference`` extra and let bakeoff create each engine's environment as on any host.
    """
    if task.kind == "export" and task.export:
        cls = adapters.resolve(task.export.pipeline)
        # a package the adapter's environment removes after install (openvino: the index's CUDA
        # torchvision beside a CPU torch) is named here so that it comes from torch's own index
        fixed = [p for p in cls.env_spec().uninstall if p == "torchvision"]
        return [*cls.requirements(), *fixed, "huggingface_hub"]
    return ["huggingface_hub"]


def bakeoff_requirement(spec: str | None, extras: str = "") -> tuple[str, dict[str, str]]:
    """The PEP 508 line for bakeoff and any ``[tool.uv.sources]`` entry it needs.

    Args:
        spec: None or ``""`` (this version from the index), ``==X`` / ``bakeoff...`` (a
            specifier), ``git+https://...`` or ``https://...`` (a URL), or a local folder /
            wheel path (only meaningful where that path exists: ``uv run`` on this machine).
        extras: e.g. ``[reference]``.

    Returns:
        ``(requirement, sources)``; a local folder becomes an editable path source so that
        the working tree's code runs (uv caches non-editable folder builds by pyproject mtime).

    Raises:
        UserError: a path that does not exist, or a wheel that is not bakeoff's.
    """
    spec = (spec or "").strip()
    if not spec:
        return f"bakeoff{extras}=={__version__}", {}
    if spec.startswith(("git+", "https://", "http://")):
        return f"bakeoff{extras} @ {spec}", {}
    if spec.startswith(("==", ">=", "~=", "<=")) or spec[0].isdigit():
        return f"bakeoff{extras}{spec if not spec[0].isdigit() else '==' + spec}", {}
    if spec.startswith("bakeoff") and not Path(spec).exists():
        return spec if not extras else spec.replace("bakeoff", f"bakeoff{extras}", 1), {}
    path = Path(spec.removeprefix("file://")).expanduser()
    if not path.exists():
        raise UserError(f"--bakeoff-spec {spec}: no such folder or wheel; pass a git URL (git+https://...), "
                        "a version (==0.1.0), a wheel file or the repository folder")
    path = path.resolve()
    if path.is_file():
        if not (path.name.startswith("bakeoff-") and path.suffix == ".whl"):
            raise UserError(f"--bakeoff-spec {spec}: not a bakeoff wheel (bakeoff-*.whl)")
        return f"bakeoff{extras} @ {path.as_uri()}", {}
    if not (path / "pyproject.toml").is_file():
        raise UserError(f"--bakeoff-spec {spec}: {path} has no pyproject.toml; pass the bakeoff repository folder")
    return f"bakeoff{extras}", {"bakeoff": {"path": str(path), "editable": True}}


def is_local_spec(spec: str | None) -> bool:
    """Whether ``spec`` names a path on this machine (useless inside a remote job)."""
    spec = (spec or "").strip()
    if not spec or spec.startswith(("git+", "https://", "http://", "==", ">=", "~=", "<=")) or spec[0].isdigit():
        return False
    return spec.startswith("file://") or Path(spec).expanduser().exists() or spec.startswith(("/", ".", "~"))


def torch_index_for(flavor: str, choice: str = "auto") -> str:
    """``pytorch-cpu`` for CPU flavors under ``auto`` (a CUDA torch from PyPI is gigabytes), else ``pypi``.

    Raises:
        UserError: an unknown choice.
    """
    if choice not in TORCH_INDEXES:
        raise UserError(f"--torch-index {choice!r}: choose one of {', '.join(TORCH_INDEXES)}")
    if choice != "auto":
        return choice
    return "pytorch-cpu" if flavor.startswith("cpu") else "pypi"


def _redacted(value: Any) -> Any:
    """``value`` (JSON data) with every string redacted: secrets are masked in the data, before it
    becomes source text, so that no redaction of the text can reach into a literal."""
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {redact(str(k)): _redacted(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_redacted(v) for v in value]
    return value


def _toml(text: str) -> str:
    """A TOML basic string holding ``text`` (a JSON string is one: same escapes; ASCII only, so a
    newline or any line separator stays an escape and the ``# `` comment line stays one line)."""
    return json.dumps(text, ensure_ascii=True)


def _inline_table(fields: dict[str, str | bool]) -> str:
    """A TOML inline table, ``{ path = "/x", editable = true }``, its strings escaped."""
    return "{ " + ", ".join(f"{k} = {_toml(v) if isinstance(v, str) else str(v).lower()}" for k, v in fields.items()) + " }"


def _requirement(line: str) -> str:
    """``line`` checked as one PEP 508 requirement.

    Raises:
        UserError: not a requirement (a newline, a quote, stray text).
    """
    from packaging.requirements import InvalidRequirement, Requirement

    try:
        Requirement(line)
    except InvalidRequirement as exc:
        raise UserError(f"--bakeoff-spec gives {line!r}, which is not one requirement ({str(exc).splitlines()[0]}); "
                        "pass a git URL (git+https://...@REV), a version (==0.1.0), a wheel or the repository folder") from None
    if not line.isprintable():
        raise UserError(f"--bakeoff-spec gives {line!r}, which holds a control character; pass it on one line")
    return line


def render_script(task: JobTask, bakeoff_spec: str | None = None, torch_index: str = "pypi",
                  requires_python: str = ">=3.11") -> str:
    """The uv script for ``task``.

    Every value a user gave is data in the script: the task is one Python literal (``repr`` of
    its redacted JSON form), the requirements are TOML strings (JSON escapes) in the PEP 723
    block, descriptions are comments with escaped values; none is spliced into source. The text
    is redaction-stable (redacting it again changes nothing), so printing or saving it through
    :func:`bakeoff.host.redact.redact` keeps it the script that runs.

    Args:
        task: what the script does.
        bakeoff_spec: how to install bakeoff (see :func:`bakeoff_requirement`).
        torch_index: ``pytorch-cpu`` pins torch to the PyTorch CPU wheel index; ``pypi``
            leaves torch to the default index (CUDA builds on Linux).
        requires_python: PEP 723 ``requires-python``.

    Returns:
        The script's text, ending with a newline.

    Raises:
        UserError: a ``--bakeoff-spec`` that is not one requirement, or a value that a secret's
            value in this environment would mangle.
    """
    extras = "[reference]" if task.kind == "qualify" else ""
    req, sources = bakeoff_requirement(bakeoff_spec, extras)
    deps = [_redacted(_requirement(req)), *engine_requirements(task)]
    meta = ["# /// script", f"# requires-python = {_toml(requires_python)}", "# dependencies = ["]
    meta += [f"#     {_toml(d)}," for d in deps]
    meta.append("# ]")
    if torch_index == "pytorch-cpu" and any(d.startswith("torch") for d in deps):
        meta += ["# [[tool.uv.index]]", '# name = "pytorch-cpu"', f"# url = {_toml(PYTORCH_CPU_INDEX)}", "# explicit = true"]
        sources = {**sources, **{d: {"index": "pytorch-cpu"} for d in ("torch", "torchvision")
                                 if any(x == d or x.startswith(d + "=") for x in deps)}}
    if sources:
        meta.append("# [tool.uv.sources]")
        meta += [f"# {k} = {_inline_table(src)}" for k, src in sources.items()]
    meta.append("# ///")
    data = _redacted(task.model_dump(mode="json"))
    head = "\n".join(meta) + "\n"
    script = head + _body(task, data, readable=True)
    if redact(script) != script:  # an escaped value the redaction would reach into: the task as base64 JSON
        script = head + _body(task, data, readable=False)
    if redact(script) != script:  # a secret's value in this environment matches the script's own text
        raise UserError("a secret-named environment variable's value occurs in the job script's own text (e.g. a "
                        "package name); unset it or give it its real value before rendering a job")
    return script


def _body(task: JobTask, data: dict[str, Any], readable: bool) -> str:
    """The script after its PEP 723 block. ``readable``: ``TASK`` as a Python literal and the job
    described in comments (escaped values); else ``TASK`` decoded from base64 JSON, whose alphabet
    no redaction pattern reaches into, and no value in a comment."""
    if readable:
        what = (f"{_toml(data['export']['pipeline'])} export of {_toml(data['model'])}" if task.kind == "export" and task.export
                else f"bakeoff qualify --backends {_toml(','.join(data['qualify']['backends']))} on {_toml(data['model'])}"
                if task.qualify else task.kind)
        where = _toml(redact(task.push_to.label())) + (f" under {_toml(data['path_in_repo'])}" if task.path_in_repo else "")
        about = f"# job:    {what}\n# output: {where}\n"
        imports = "import sys\n"
        literal = pprint.pformat(data, sort_dicts=False, width=100)
    else:
        about = "# job:    TASK below (base64 JSON: a value holds text the redaction of secrets would change)\n"
        imports = "import base64\nimport json\nimport sys\n"
        literal = f"json.loads(base64.b64decode({base64.b64encode(json.dumps(data).encode()).decode()!r}))"
    return f'''"""bakeoff job {_TAG.sub("_", task.tag)} (rendered by bakeoff {__version__}): what it does is TASK below.

Here:      uv run THIS_FILE.py --out ./job-output        (then see ./job-output/bakeoff-job.json)
As a job:  bakeoff jobs {task.kind} ... (submits this file with huggingface_hub.run_uv_job)
Output:    pushed where TASK["push_to"] says; override with --push-to
"""
{about}
{imports}
from cli.jobs.runtime import run_task

TASK = {literal}

if __name__ == "__main__":
    sys.exit(run_task(TASK, sys.argv[1:]))
'''


_TAG = re.compile(r"[^A-Za-z0-9_.:-]")  # the tag is bakeoff's own (submit.new_tag); kept plain in the docstring
