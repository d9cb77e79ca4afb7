"""Submit and follow jobs through ``huggingface_hub`` (``run_uv_job``, ``inspect_job``, ...).

The endpoint is huggingface_hub's own (``HF_ENDPOINT``) unless ``endpoint`` is given
(``HfApi(endpoint=...)``); the token is huggingface_hub's (``HF_TOKEN`` or the saved login).
Secret values are read here, sent to the Jobs API and never written: what bakeoff writes
(records, printed requests, logs, fetched runs) goes through :func:`bakeoff.host.redact.redact`.

The script travels inline: ``run_uv_job("sh", ["-c", <decode $BAKEOFF_JOB_SCRIPT_B64, uv run it>])``.
huggingface_hub's own path for a local script file uploads it to a ``jobs-artifacts`` bucket
first (Xet storage); the inline form needs nothing but the Jobs API.
"""

from __future__ import annotations

import base64
import os
import shlex
import shutil
import tempfile
import time
import warnings
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator

from bakeoff.host.artifacts import atomic_write_json, atomic_write_text, list_runs
from bakeoff.api.errors import UserError
from cli.jobs.specs import JobRecord, JobRequest, JobTask, PushTarget
from bakeoff.host.redact import MASK, redact

SCRIPT_ENV = "BAKEOFF_JOB_SCRIPT_B64"
REMOTE_SCRIPT = "/tmp/bakeoff_job.py"
REMOTE_OUT = "/tmp/bakeoff-job-output"
PRICING_HELP = "see `bakeoff jobs hardware`, `hf jobs hardware` or https://huggingface.co/docs/hub/jobs-pricing"


def api_for(endpoint: str | None = None):
    """An ``HfApi`` on ``endpoint`` (None: ``HF_ENDPOINT`` or huggingface.co)."""
    from huggingface_hub import HfApi

    return HfApi(endpoint=endpoint) if endpoint else HfApi()


def known_flavors() -> list[str]:
    """Flavor names huggingface_hub knows (``JobHardware``, kept in sync with the Hub)."""
    from huggingface_hub import JobHardware

    return [h.value for h in JobHardware]


def check_flavor(flavor: str) -> str:
    """Raises UserError naming valid flavors when ``flavor`` is unknown."""
    names = known_flavors()
    if flavor not in names:
        raise UserError(f"unknown flavor {flavor!r}; choose one of: {', '.join(names)}")
    return flavor


def secret_values(names: list[str]) -> dict[str, str]:
    """Values of the named secrets: this environment, or the saved login for ``HF_TOKEN``.

    Raises:
        UserError: a name with no value here.
    """
    out: dict[str, str] = {}
    for name in names:
        value = os.environ.get(name)
        if not value and name == "HF_TOKEN":
            from huggingface_hub import get_token

            value = get_token()
        if not value:
            raise UserError(f"--secret {name}: no value in this environment"
                            + (" and no saved login (run `hf auth login`)" if name == "HF_TOKEN" else "; export it first"))
        out[name] = value
    return out


def launch_args(script_text: str, python: str | None = None) -> tuple[str, list[str], dict[str, str]]:
    """``(script, script_args, extra_env)`` for ``run_uv_job`` that run ``script_text`` inline.

    The job runs ``uv run sh -c '<decode $BAKEOFF_JOB_SCRIPT_B64 to /tmp/bakeoff_job.py>
    && exec uv run [--python X] /tmp/bakeoff_job.py --out /tmp/bakeoff-job-output'``.
    """
    py = f"--python {shlex.quote(python)} " if python else ""  # JobRequest checked it; quoted all the same
    cmd = (f'printf %s "${SCRIPT_ENV}" | base64 -d > {REMOTE_SCRIPT} && '
           f"exec uv run {py}{REMOTE_SCRIPT} --out {REMOTE_OUT}")
    return "sh", ["-c", cmd], {SCRIPT_ENV: base64.b64encode(script_text.encode()).decode()}


def job_kwargs(task: JobTask, request: JobRequest, script_text: str) -> dict[str, Any]:
    """The ``run_uv_job`` keyword arguments, secrets as NAMES (values are added at submission)."""
    script, script_args, extra_env = launch_args(script_text, request.python)
    labels = {"bakeoff": task.kind, "bakeoff-tag": task.tag, "bakeoff-flavor": request.flavor, **request.labels}
    kw: dict[str, Any] = {"script": script, "script_args": script_args, "env": {**request.env, **extra_env},
                          "secrets": list(request.secrets), "flavor": request.flavor, "timeout": request.timeout,
                          "labels": labels, "name": request.name or f"bakeoff-{task.kind}-{task.tag}-{request.flavor}"}
    if request.image:
        kw["image"] = request.image
    if request.namespace:
        kw["namespace"] = request.namespace
    return kw


def describe_request(kw: dict[str, Any]) -> dict[str, Any]:
    """Printable form of :func:`job_kwargs` (the inline script abbreviated, secrets masked)."""
    env = {k: (f"<{len(v)} chars: the script above, base64>" if k == SCRIPT_ENV else v) for k, v in kw["env"].items()}
    return {"call": "huggingface_hub.HfApi.run_uv_job", **kw, "env": env,
            "secrets": {name: MASK for name in kw["secrets"]}}


def submit(api, task: JobTask, request: JobRequest, script_text: str, records: Path | None) -> JobRecord:
    """Submit one job with ``run_uv_job``; write its record to ``records/<job_id>.json``.

    Raises:
        UserError: a missing secret value; a push to the Hub without an ``HF_TOKEN`` secret.
    """
    if task.push_to.kind == "hub" and "HF_TOKEN" not in request.secrets:
        raise UserError(f"pushing to {task.push_to.label()} needs a token inside the job: add --secret HF_TOKEN")
    if task.push_to.kind == "file":
        raise UserError("--push-to file://... is for local runs (uv run); a job needs a Hub repository (org/name)")
    kw = job_kwargs(task, request, script_text)
    kw["secrets"] = secret_values(kw["secrets"])
    with warnings.catch_warnings():  # run_uv_job is marked experimental in huggingface_hub
        warnings.simplefilter("ignore")
        info = api.run_uv_job(**kw)
    rec = JobRecord(job_id=info.id, url=info.url, kind=task.kind, tag=task.tag, flavor=request.flavor,
                    namespace=info.owner.name, endpoint=api.endpoint, push_to=task.push_to.label(),
                    path_in_repo=task.path_in_repo, submitted_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                    secrets=list(request.secrets))
    if records is not None:
        atomic_write_json(records / f"{rec.job_id}.json", rec.model_dump(mode="json"))
    return rec


def load_record(records: Path, job_id: str) -> JobRecord | None:
    """The local record of ``job_id``, or None."""
    path = records / f"{job_id}.json"
    if not path.is_file():
        return None
    try:
        return JobRecord.model_validate_json(path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:  # pydantic's ValidationError is a ValueError
        raise UserError(f"the job record {path} is not bakeoff's or is damaged ({type(exc).__name__}); "
                        "remove it, or pass --artifacts where `bakeoff jobs` wrote it") from None


def summarize(info) -> dict[str, Any]:
    """One job's status as plain data."""
    d = info.durations
    return {"id": info.id, "stage": str(getattr(info.status.stage, "value", info.status.stage)),
            "message": info.status.message, "flavor": str(getattr(info.flavor, "value", info.flavor)),
            "labels": info.labels or {}, "url": info.url,
            "running_s": d.running_secs if d else None, "total_s": d.total_secs if d else None}


def logs(api, job_id: str, follow: bool = False, tail: int | None = None, namespace: str | None = None) -> Iterator[str]:
    """The job's log lines, redacted (``follow``: until the job ends)."""
    for line in api.fetch_job_logs(job_id=job_id, follow=follow, tail=tail, namespace=namespace):
        yield redact(line)


def wait(api, job_ids: list[str], timeout_s: float | None = None, poll_s: float = 5.0,
         namespace: str | None = None) -> list[dict[str, Any]]:
    """Block until every job is in a terminal stage; their summaries.

    Raises:
        UserError: still running after ``timeout_s`` seconds.
    """
    try:
        infos = api.wait_for_job(job_ids, timeout=timeout_s, poll_interval=poll_s, namespace=namespace)
    except TimeoutError as exc:
        raise UserError(f"{exc} (wait longer with --timeout-s, or see `bakeoff jobs status`)") from None
    return [summarize(i) for i in infos]


def hardware(api) -> list[dict[str, Any]]:
    """The Hub's job hardware with prices (``list_jobs_hardware``); ``[]`` when unreachable."""
    try:
        hw = api.list_jobs_hardware()
    except Exception:  # no network, old server: prices are then "unknown"
        return []
    return [{"name": h.name, "pretty_name": h.pretty_name, "cpu": h.cpu, "ram": h.ram,
             "accelerator": f"{h.accelerator.quantity}x {h.accelerator.model} {h.accelerator.vram}" if h.accelerator else "",
             "usd_per_hour": round(h.unit_cost_usd * {"minute": 60, "second": 3600, "hour": 1}.get(h.unit_label, 60), 4)}
            for h in hw]


def cost_line(hw: list[dict[str, Any]], flavor: str, timeout: str) -> str:
    """``cpu-xl: $X/h, at most $Y for 2h`` or ``unknown`` with where to look."""
    row = next((h for h in hw if h["name"] == flavor), None)
    if row is None:
        return f"{flavor}: cost unknown ({PRICING_HELP})"
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    seconds = float(timeout[:-1]) * units[timeout[-1]] if timeout[-1] in units else float(timeout)
    return f"{flavor}: ${row['usd_per_hour']}/h, at most ${row['usd_per_hour'] * seconds / 3600:.2f} for {timeout}"


def _copy_redacted(src: Path, dest: Path) -> None:
    for p in sorted(src.rglob("*")):
        if not p.is_file():
            continue
        out = dest / p.relative_to(src)
        try:
            atomic_write_text(out, p.read_text(encoding="utf-8"))
        except UnicodeDecodeError:
            out.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(p, out)


def fetch(target: PushTarget, artifacts: Path, path_in_repo: str = "", api=None) -> tuple[list[Path], list[str]]:
    """Copy the run directories a job pushed into ``artifacts/runs/`` (text redacted, never overwritten).

    Args:
        target: where the job pushed (a Hub repo or a ``file://`` folder).
        artifacts: the local artifacts folder.
        path_in_repo: the job's folder inside the target ("": everything).
        api: ``HfApi`` for Hub targets.

    Returns:
        ``(new run directories, names skipped because they exist already)``.
    """
    if target.kind == "none":
        raise UserError("that job pushed nowhere (--push-to none): nothing to fetch")
    prefix = f"{path_in_repo.strip('/')}/" if path_in_repo.strip("/") else ""
    with tempfile.TemporaryDirectory(prefix="bakeoff-fetch-") as tmp:
        if target.kind == "file":
            root = Path(str(target.folder)) / prefix
            if not root.is_dir():
                raise UserError(f"{root} does not exist: nothing was pushed there")
        else:
            root = Path(api.snapshot_download(repo_id=str(target.repo_id), repo_type=target.repo_type,
                                              allow_patterns=[f"{prefix}**/runs/**", f"{prefix}runs/**"],
                                              local_dir=tmp)) / prefix
        new, skipped = [], []
        for run in list_runs([root]):
            dest = artifacts / "runs" / run.name
            if dest.exists():
                skipped.append(run.name)
                continue
            _copy_redacted(run, dest)
            new.append(dest)
    return new, skipped


def new_tag() -> str:
    """A short, sortable submission tag (UTC time + random)."""
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + os.urandom(2).hex()
