"""What a rendered job script runs: one adapter pipeline or one qualification, then a push.

Called as ``run_task(TASK, sys.argv[1:])`` from the script (:mod:`cli.jobs.render`), on a
Hugging Face Job or under ``uv run`` here. Output folder layout::

    <out>/bakeoff-job.json              status, task, durations, host, files (always written)
    <out>/export.json  <out>/model/...  export jobs: the adapter's export folder, as cached locally
    <out>/runs/<run-id>/...             qualify jobs: the run directories
    <out>/reports/<tag>/...             qualify jobs: the report
    <out>/evidence/...                  a failed job's evidence (log tails, command)

A failure is data: ``bakeoff-job.json`` says ``failed`` with the failure class and message,
the output is still pushed, and the script exits 1.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bakeoff import __version__
from bakeoff.host.artifacts import atomic_write_json, atomic_write_text
from bakeoff.api.errors import EngineFailure, UserError
from cli.jobs.specs import JobTask, PushTarget
from bakeoff.host.redact import redact
from bakeoff.models.resolve import resolve
import adapters
from bakeoff.host.fingerprint import cpu_model, gpus

JOB_FILE = "bakeoff-job.json"


def _log(msg: str) -> None:
    print(redact(f"[bakeoff-job] {msg}"), flush=True)


def _local_model(model: str, work: Path) -> str:
    """A local checkpoint folder for ``model`` (fixture build, Hub download, or the path)."""
    resolved = resolve(model, log=_log)
    if resolved.local:
        return resolved.path
    from huggingface_hub import snapshot_download

    _log(f"downloading {model} from the Hub")
    return snapshot_download(model, local_dir=str(work / "source"))


def _export(task: JobTask, out: Path, work: Path) -> dict[str, Any]:
    """The task's adapter (``adapters.REGISTRY``) on the job's checkpoint, written into ``out``."""
    assert task.export is not None
    adapter = adapters.resolve(task.export.pipeline)(task.export.options)
    return {"export": adapter.run(_local_model(task.model, work), out, log=_log)}


def _qualify(task: JobTask, out: Path) -> dict[str, Any]:
    assert task.qualify is not None
    q = task.qualify
    # --flag=value: a value that starts with a dash stays the flag's value, never a flag of its own
    cmd = [sys.executable, "-m", "cli.main", "qualify", f"--backends={','.join(q.backends)}",
           f"--model={task.model}", f"--profile={q.profile}", f"--artifacts={out}", f"--report={task.tag}"]
    cmd += [f"--backend-opt={o}" for o in q.backend_opts]
    if q.reference_model:
        cmd.append(f"--reference-model={q.reference_model}")
    _log("$ " + " ".join(cmd))
    rc = subprocess.run(cmd).returncode
    runs = sorted(p.name for p in (out / "runs").glob("*") if p.is_dir()) if (out / "runs").is_dir() else []
    if rc != 0 and not runs:
        raise EngineFailure("runtime-crash", f"bakeoff qualify exited {rc} without a run directory",
                            {"command.txt": " ".join(cmd)})
    return {"qualify": {"exit_code": rc, "runs": runs}}


def push(folder: Path, target: PushTarget, path_in_repo: str = "", message: str = "bakeoff job output") -> str:
    """Send ``folder`` to the target: a Hub repo (``upload_folder``), a local folder, or nowhere.

    Returns:
        Where it went, one line.
    """
    if target.kind == "none":
        return "not pushed (--push-to none)"
    if target.kind == "file":
        dest = Path(str(target.folder)) / path_in_repo
        shutil.copytree(folder, dest, dirs_exist_ok=True)
        return f"copied to {dest}"
    from huggingface_hub import HfApi

    api = HfApi()
    api.create_repo(str(target.repo_id), repo_type=target.repo_type, private=True, exist_ok=True)
    info = api.upload_folder(repo_id=str(target.repo_id), repo_type=target.repo_type, folder_path=str(folder),
                             path_in_repo=path_in_repo or None, commit_message=message)
    return f"pushed to {target.label()} ({getattr(info, 'commit_url', info)})"


def _host() -> dict[str, Any]:
    return {"cpu": cpu_model(), "cpu_count": os.cpu_count(), "gpus": gpus(), "python": sys.version.split()[0],
            "job_id": os.environ.get("JOB_ID"), "bakeoff": __version__}


def run_task(task_data: dict[str, Any], argv: list[str] | None = None) -> int:
    """Run one job task and push its output.

    Args:
        task_data: a :class:`JobTask` as a dict (the script's ``TASK``).
        argv: ``--out DIR`` (default ``./bakeoff-job-output``), ``--push-to TARGET`` (override).

    Returns:
        0 when the work succeeded, 1 when it failed (the failure is in ``bakeoff-job.json``).
    """
    ap = argparse.ArgumentParser(prog="bakeoff-job")
    ap.add_argument("--out", default="bakeoff-job-output", help="output folder (must be new or empty)")
    ap.add_argument("--push-to", default=None, help="override the task's target: org/name, file:///path, none")
    args = ap.parse_args(argv)
    task = JobTask.model_validate(task_data)
    target = PushTarget.parse(args.push_to) if args.push_to else task.push_to
    out = Path(args.out).resolve()
    if out.exists() and any(out.iterdir()):
        print(f"bakeoff-job: error: output folder {out} is not empty; choose a new --out", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    work = out.parent / f".{out.name}.work"
    t0 = time.monotonic()
    record: dict[str, Any] = {"tag": task.tag, "kind": task.kind, "model": task.model, "flavor": task.flavor,
                              "status": "ok", "task": task.model_dump(mode="json"), "host": _host()}
    _log(f"{task.kind} of {task.model} on {task.flavor} -> {out}")
    try:
        record.update(_export(task, out, work) if task.kind == "export" else _qualify(task, out))
    except EngineFailure as exc:
        record.update(status="failed", failure_class=exc.failure_class, message=exc.message)
        for name, text in exc.evidence.items():
            atomic_write_text(out / "evidence" / name, text)
    except UserError as exc:
        record.update(status="failed", failure_class="config-rejected", message=str(exc))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    record["duration_s"] = round(time.monotonic() - t0, 1)
    record["files"] = sorted({str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()} | {JOB_FILE})
    atomic_write_json(out / JOB_FILE, record)
    _log(f"{record['status']} in {record['duration_s']} s" + (f": {record.get('message')}" if record.get("message") else ""))
    try:
        _log(push(out, target, task.path_in_repo, f"bakeoff {task.kind} {task.tag} ({record['status']})"))
    except Exception as exc:  # the work is done: say where it is and why the push failed
        _log(f"push to {target.label()} failed: {type(exc).__name__}: {exc}; the output stays in {out}")
        return 1
    return 0 if record["status"] == "ok" else 1
