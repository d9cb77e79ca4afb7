"""Render a job as a self-contained uv script (PEP 723 ``# /// script`` metadata + a task).

The script pins bakeoff (a version, a git URL, a wheel, or a local folder) and the engine's
requirements, embeds the :class:`~bakeoff.cli.jobs.specs.JobTask` as a literal, and calls
:func:`bakeoff.cli.jobs.runtime.run_task`. The same file runs as a Hugging Face Job and with
``uv run script.py --out DIR`` on any machine.
"""

from __future__ import annotations

import pprint
from pathlib import Path

from bakeoff import __version__
from bakeoff.api.errors import UserError
from bakeoff.cli.jobs.specs import JobTask
from bakeoff.host.redact import redact

PYTORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
TORCH_INDEXES = ("auto", "pytorch-cpu", "pypi")


def engine_requirements(task: JobTask) -> list[str]:
    """The pip requirements the task's engine needs in the script's environment.

    Export jobs get the adapter environment's pins (the script's environment then *is* that
    environment: bakeoff.host.envs finds the engine preinstalled there); qualify jobs get bakeoff's
    ``reference`` extra and let bakeoff create each engine's environment as on any host.
    """
    if task.kind == "export" and task.export:
        import adapters

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
    return f"bakeoff{extras}", {"bakeoff": f'{{ path = "{path}", editable = true }}'}


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


def render_script(task: JobTask, bakeoff_spec: str | None = None, torch_index: str = "pypi",
                  requires_python: str = ">=3.11") -> str:
    """The uv script for ``task`` (redacted text).

    Args:
        task: what the script does.
        bakeoff_spec: how to install bakeoff (see :func:`bakeoff_requirement`).
        torch_index: ``pytorch-cpu`` pins torch to the PyTorch CPU wheel index; ``pypi``
            leaves torch to the default index (CUDA builds on Linux).
        requires_python: PEP 723 ``requires-python``.

    Returns:
        The script's text, ending with a newline.
    """
    extras = "[reference]" if task.kind == "qualify" else ""
    req, sources = bakeoff_requirement(bakeoff_spec, extras)
    deps = [req, *engine_requirements(task)]
    meta = ["# /// script", f'# requires-python = "{requires_python}"', "# dependencies = ["]
    meta += [f'#     "{d}",' for d in deps]
    meta.append("# ]")
    if torch_index == "pytorch-cpu" and any(d.startswith("torch") for d in deps):
        meta += ["# [[tool.uv.index]]", '# name = "pytorch-cpu"', f'# url = "{PYTORCH_CPU_INDEX}"', "# explicit = true"]
        sources = {**sources, **{d: '{ index = "pytorch-cpu" }' for d in ("torch", "torchvision")
                                 if any(x == d or x.startswith(d + "=") for x in deps)}}
    if sources:
        meta.append("# [tool.uv.sources]")
        meta += [f"# {k} = {v}" for k, v in sources.items()]
    meta.append("# ///")
    what = (f"{task.export.pipeline} export of {task.model}" if task.kind == "export" and task.export
            else f"bakeoff qualify --backends {','.join(task.qualify.backends)} on {task.model}" if task.qualify
            else task.kind)
    task_literal = pprint.pformat(task.model_dump(mode="json"), sort_dicts=False, width=100)
    body = f'''"""bakeoff job {task.tag}: {what} (rendered by bakeoff {__version__}).

Here:      uv run THIS_FILE.py --out ./job-output        (then see ./job-output/bakeoff-job.json)
As a job:  bakeoff jobs {task.kind} ... (submits this file with huggingface_hub.run_uv_job)
Output:    pushed to {task.push_to.label()}{(" under " + task.path_in_repo) if task.path_in_repo else ""}; override with --push-to
"""

import sys

from bakeoff.cli.jobs.runtime import run_task

TASK = {task_literal}

if __name__ == "__main__":
    sys.exit(run_task(TASK, sys.argv[1:]))
'''
    return redact("\n".join(meta) + "\n" + body)
