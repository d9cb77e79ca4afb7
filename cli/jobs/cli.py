"""``bakeoff jobs ...``: render, submit and follow exports and qualifications as Hugging Face Jobs.

Wired into ``cli/main.py`` by ``add_jobs_parser(sub)``. Everything printed goes through
:func:`bakeoff.host.redact.redact`; bad input is a one-line :class:`~bakeoff.api.errors.UserError`.
"""

from __future__ import annotations

import functools
import json
import math
import re
from pathlib import Path
from typing import Any

from pydantic import ValidationError

import adapters

from bakeoff.host.artifacts import atomic_write_text, check_creatable
from bakeoff.api.errors import UserError, one_line
from cli.jobs import render, submit
from cli.jobs.specs import ExportTask, JobRequest, JobTask, PushTarget, QualifyTask
from bakeoff.host.redact import redact
from bakeoff.models.resolve import is_hub_id
import backends
from evaluations.inputs import Request, check_options

REPO = Path(__file__).resolve().parents[2]


def _hub_errors(fn):
    """A command whose Hub call fails (no network, a refused token, an unknown job id: errors of
    huggingface_hub and its HTTP client) ends in one line naming the cause, not a traceback."""
    @functools.wraps(fn)
    def wrapped(args) -> int:
        try:
            return fn(args)
        except (UserError, BrokenPipeError):  # a closed stdout (`| head`) is the reader's, not the Hub's
            raise
        except Exception as exc:
            root = type(exc).__module__.split(".")[0]
            if root not in ("httpx", "httpx2", "httpcore", "requests", "urllib3", "huggingface_hub") and not isinstance(exc, OSError):
                raise
            if type(exc).__name__ == "LocalTokenNotFoundError":
                raise UserError("no Hugging Face token; log in with `hf auth login` or set HF_TOKEN") from None
            where = _no_userinfo(getattr(args, "endpoint", None)) or "the Hub"
            raise UserError(f"{where} did not answer as expected ({type(exc).__name__}: {one_line(redact(str(exc)))[:200]}); "
                            "check --endpoint, the network, the token and the job id") from None
    return wrapped


def _no_userinfo(url: str | None) -> str | None:
    """``url`` without the ``user:password@`` part (a token in an --endpoint is never printed)."""
    if not url:
        return url
    return re.sub(r"^([a-zA-Z][a-zA-Z0-9+.-]*://)[^/@]*@", r"\1***@", url)


def _out(text: str = "") -> None:
    print(redact(text), flush=True)


def _kv(items: list[str], flag: str) -> dict[str, str]:
    out = {}
    for item in items:
        k, sep, v = item.partition("=")
        if not sep or not k:
            raise UserError(f"{flag} {item!r}: use KEY=VALUE")
        out[k] = v
    return out


def _check_model(flag: str, spec: str | None, dry_run: bool) -> None:
    """A job's model: a ``fixture:NAME`` bakeoff knows (the job builds it: a typo would be found
    only after the job started), a Hub id, or (``--dry-run`` / ``uv run`` here) a local folder."""
    if spec is None:
        return
    if spec.startswith("fixture:"):
        # lazy: only a fixture model needs the fixture registry (60 ms: the builders, the fingerprint)
        from bakeoff.models import fixtures

        name = spec.split(":", 1)[1]
        if name not in fixtures.names():
            raise UserError(f"{flag}: unknown fixture {name!r}; choose one of: "
                            f"{', '.join('fixture:' + n for n in fixtures.names())}")
        return
    local = dry_run and Path(spec).expanduser().is_dir()
    if not local and not is_hub_id(spec):
        raise UserError(f"{flag} {spec!r} is not a Hub id (org/name: letters, digits, . _ -) nor fixture:NAME"
                        + ("" if dry_run else "; a job cannot reach a folder on this machine"))


def _check_path_in_repo(path: str | None) -> None:
    """A folder inside the target repository: relative, no ``..``, one printable line."""
    if not path:
        return
    parts = path.split("/")
    if path.startswith("/") or ".." in parts or not path.isprintable() or "\\" in path:
        raise UserError(f"--path-in-repo {path!r}: pass a relative folder inside the repository (e.g. runs/a40), "
                        "without .. or a leading /")


def _first_error(exc: ValidationError) -> str:
    e = exc.errors()[0]
    return f"{'.'.join(str(x) for x in e['loc'])}: {e['msg']}".removeprefix(": ").replace("Value error, ", "")


# the flags of `jobs export` that are adapter Options fields (a flag's dest is the field's name)
EXPORT_FLAGS = ("precision", "execution_provider", "block_size", "accuracy_level", "int4_algo", "moe_quant_type",
                "qmoe_block_size", "extra_option", "num_samples", "max_seq_length", "opset", "weight_format",
                "group_size", "ratio", "sym", "outtype")
FLAG_FIELD = {"extra_option": "extra_options"}  # a repeatable flag whose values make one Options field


def _flag(dest: str) -> str:
    """``--extra-option`` for ``extra_option``."""
    return "--" + dest.replace("_", "-")


def _export_task(args, tag: str, push: PushTarget) -> JobTask:
    """The export flags the pipeline's adapter takes (its ``Options`` fields), validated now."""
    cls = adapters.resolve(args.pipeline)
    fields = cls.Options.model_fields
    own = [k for k in EXPORT_FLAGS if FLAG_FIELD.get(k, k) in fields]
    foreign = [k for k in EXPORT_FLAGS if getattr(args, k, None) not in (None, []) and k not in own]
    if foreign:
        raise UserError(f"{', '.join(_flag(k) for k in foreign)}: not an option of the {args.pipeline} export; "
                        f"its options: {', '.join(_flag(k) for k in own) or 'none'}")
    raw: dict[str, Any] = {k: getattr(args, k) for k in cls.Options.model_fields
                           if k != "extra_options" and getattr(args, k, None) is not None}
    if "extra_options" in cls.Options.model_fields:
        raw["extra_options"] = _kv(args.extra_option, "--extra-option")
    try:
        opts = cls.Options.model_validate(raw).model_dump(mode="json", exclude_defaults=True)
    except ValidationError as exc:
        raise UserError(f"export option {_first_error(exc)}") from None
    return JobTask(kind="export", tag=tag, model=args.model, export=ExportTask(pipeline=args.pipeline, options=opts),
                   push_to=push, path_in_repo=args.path_in_repo or "")


def _qualify_task(args, tag: str, push: PushTarget) -> JobTask:
    """The job's ``bakeoff qualify``: backends and options checked by the function ``bakeoff
    qualify`` checks them with (:func:`evaluations.inputs.check_options`), before anything is rendered."""
    names = [b.strip() for b in args.backends.split(",") if b.strip()]
    if not names:
        raise UserError("--backends names no backend")
    if len(set(names)) != len(names):
        raise UserError(f"--backends names a backend twice ({args.backends}); name each once")
    for n in names:
        backends.validate(n)
    check_options(Request(entry="qualify", backends=names, backend_opt=args.backend_opt), names)
    q = QualifyTask(backends=names, profile=args.profile, backend_opts=args.backend_opt,
                    reference_model=args.reference_model)
    return JobTask(kind="qualify", tag=tag, model=args.model, qualify=q, push_to=push, path_in_repo=args.path_in_repo or "")


@_hub_errors
def cmd_submit(args) -> int:
    """``bakeoff jobs export|qualify``: render per flavor, then print (--dry-run) or submit."""
    flavors = _flavors(args)
    if args.save_script is not None:
        _check_save_script(args.save_script, flavors)
    for f in flavors:
        submit.check_flavor(f)
    if args.push_to is None and not args.dry_run:
        raise UserError("name where the output goes: --push-to org/name (a Hub repo), or --push-to none")
    push = PushTarget.parse(args.push_to or "none")
    for flag, spec in (("--model", args.model), ("--reference-model", getattr(args, "reference_model", None))):
        _check_model(flag, spec, args.dry_run)
    _check_path_in_repo(args.path_in_repo)
    if not args.dry_run:
        _check_reachable(args)
    try:
        request = JobRequest(flavor=flavors[0], timeout=args.timeout, secrets=args.secret, env=_kv(args.env, "--env"),
                             image=args.image, python=args.python, namespace=args.namespace,
                             labels=_kv(args.label, "--label"))
    except ValidationError as exc:
        raise UserError(_first_error(exc)) from None
    tag = submit.new_tag()
    # every check before the Hub is asked anything or a job (paid) is submitted: the task's
    # options, the secrets' values, and the folder the job records go to (issue 15)
    base_task = (_export_task if args.command_jobs == "export" else _qualify_task)(args, tag, push)
    records = Path(args.artifacts) / "jobs"
    if not args.dry_run:
        submit.secret_values(list(request.secrets))  # read, not kept: submit() reads them again
        check_creatable(records)
    api = None if args.dry_run else submit.api_for(args.endpoint)
    prices = [] if args.dry_run else submit.hardware(api)
    for flavor in flavors:
        task = base_task.model_copy(update={"flavor": flavor, "path_in_repo": base_task.path_in_repo or (
            f"jobs/{tag}-{flavor}" if base_task.kind == "qualify" else "")})
        req = request.model_copy(update={"flavor": flavor})
        script = render.render_script(task, args.bakeoff_spec, render.torch_index_for(flavor, args.torch_index))
        if args.save_script is not None:
            path = _script_paths(args.save_script, flavors)[flavors.index(flavor)]
            atomic_write_text(path, script)
            _out(f"script: {path}")
        if args.dry_run:
            _out(f"# ---- {flavor}: script ----\n{script}# ---- {flavor}: job request (not submitted) ----")
            _out(json.dumps(submit.describe_request(submit.job_kwargs(task, req, script)), indent=1))
            _out(f"cost: {submit.cost_line([], flavor, req.timeout)}")
            continue
        rec = submit.submit(api, task, req, script, records)
        _out(_submitted_line(rec, flavor, req.timeout, prices))
    if not args.dry_run:
        _out("follow: bakeoff jobs logs JOB_ID --follow; then: bakeoff jobs fetch JOB_ID")
    return 0


def _submitted_line(rec, flavor: str, timeout: str, prices: list) -> str:
    """What a submitted job's record says: its id, flavor, timeout, secrets' names, target, URL, cost."""
    target = f"{rec.push_to}{'/' + rec.path_in_repo if rec.path_in_repo else ''}"
    return (f"submitted {rec.job_id} ({flavor}, timeout {timeout}, secrets: {', '.join(rec.secrets) or 'none'}) "
            f"-> {target}\n  {rec.url}\n  {submit.cost_line(prices, flavor, timeout)}")


def _flavors(args) -> list[str]:
    """The flavors asked for (``jobs qualify --flavors``, else ``--flavor``), each named once.

    Raises:
        UserError: none named, or one empty or repeated (an empty ``--flavors`` is no flavor, not the default).
    """
    given = getattr(args, "flavors", None)
    flavors = [f.strip() for f in (args.flavor if given is None else given).split(",")]
    if not any(flavors):
        raise UserError("--flavors names no flavor; e.g. --flavors cpu-xl,a100-large (bakeoff jobs hardware lists them)")
    if not all(flavors) or len(set(flavors)) != len(flavors):
        raise UserError(f"--flavors {','.join(flavors)!r} has an empty or repeated flavor; name each once, e.g. cpu-xl,a100-large")
    return flavors


def _script_paths(save_script: str, flavors: list[str]) -> list[Path]:
    """Where each flavor's script is saved: ``--save-script`` itself for one flavor, else NAME-FLAVOR.SUFFIX."""
    p = Path(save_script)
    return [p] if len(flavors) == 1 else [p.with_name(f"{p.stem}-{f}{p.suffix}") for f in flavors]


def _check_save_script(save_script: str, flavors: list[str]) -> None:
    """``--save-script``: a file name, each flavor's file new, in a folder that exists and can be written.

    Raises:
        UserError: it names no file, a file exists, or its folder is missing or read-only.
    """
    if not save_script.strip() or save_script.endswith("/"):
        raise UserError(f"--save-script {save_script!r} names no file; pass a file name, e.g. job.py")
    for t in _script_paths(save_script, flavors):
        if t.exists():
            raise UserError(f"--save-script {t} exists; pass a new file name (bakeoff does not overwrite it)")
        if not t.resolve().parent.is_dir():
            raise UserError(f"--save-script {t}: its folder does not exist; pass a file in an existing folder")
        check_creatable(t.resolve().parent, "--save-script folder", "pass a file in a folder you can write")


def _check_reachable(args) -> None:
    """A submitted job reaches bakeoff and the model only through the network: not a local path.

    Raises:
        UserError: ``--bakeoff-spec`` or ``--model`` is a path on this machine.
    """
    if render.is_local_spec(args.bakeoff_spec):
        raise UserError(f"--bakeoff-spec {args.bakeoff_spec} is a path on this machine, which a job cannot reach; "
                        "pass a git URL (git+https://...@REV) or a published version (default)")
    if Path(args.model).expanduser().exists():
        raise UserError(f"--model {args.model} is a local folder, which a job cannot reach; pass a Hub id or fixture:NAME")


@_hub_errors
def cmd_status(args) -> int:
    api = submit.api_for(args.endpoint)
    for job_id in args.job_ids:
        _out(json.dumps(submit.summarize(api.inspect_job(job_id=job_id, namespace=args.namespace))))
    return 0


@_hub_errors
def cmd_logs(args) -> int:
    if args.tail is not None and args.tail < 1:
        raise UserError(f"--tail must be at least 1 line, got {args.tail}")
    api = submit.api_for(args.endpoint)
    for line in submit.logs(api, args.job_id, follow=args.follow, tail=args.tail, namespace=args.namespace):
        _out(line)
    return 0


@_hub_errors
def cmd_wait(args) -> int:
    for flag, v, low in (("--timeout-s", args.timeout_s, 0.0), ("--poll-s", args.poll_s, 0.01)):
        if v is not None and not (math.isfinite(v) and low <= v <= 7 * 24 * 3600):
            raise UserError(f"{flag} must be a number of seconds from {low:g} to a week, got {v}")
    api = submit.api_for(args.endpoint)
    rows = submit.wait(api, args.job_ids, timeout_s=args.timeout_s, poll_s=args.poll_s, namespace=args.namespace)
    for r in rows:
        _out(json.dumps(r))
    return 0 if all(r["stage"] == "COMPLETED" for r in rows) else 1


@_hub_errors
def cmd_cancel(args) -> int:
    api = submit.api_for(args.endpoint)
    for job_id in args.job_ids:
        api.cancel_job(job_id=job_id, namespace=args.namespace)
        _out(f"canceled {job_id}")
    return 0


@_hub_errors
def cmd_fetch(args) -> int:
    artifacts = Path(args.artifacts)
    sources: list[tuple[PushTarget, str]] = []
    for job_id in args.job_ids:
        rec = submit.load_record(artifacts / "jobs", job_id)
        if rec is None:
            raise UserError(f"no record of job {job_id} under {artifacts / 'jobs'}; pass --from REPO instead")
        sources.append((PushTarget.parse(rec.push_to), rec.path_in_repo))
    if args.from_:
        sources.append((PushTarget.parse(args.from_), args.path_in_repo or ""))
    if not sources:
        raise UserError("name JOB_IDs submitted from here, or --from org/name (or file:///path)")
    check_creatable(artifacts / "runs")  # before anything is downloaded
    api = submit.api_for(args.endpoint) if any(t.kind == "hub" for t, _ in sources) else None
    total = 0
    for target, prefix in sources:
        new, skipped = submit.fetch(target, artifacts, prefix, api)
        total += len(new)
        for p in new:
            _out(f"fetched {p}")
        if skipped:
            _out(f"already here (kept): {', '.join(skipped)}")
    _out(f"{total} run(s) in {artifacts / 'runs'}; compare: bakeoff report {artifacts / 'runs'}")
    return 0


@_hub_errors
def cmd_hardware(args) -> int:
    rows = submit.hardware(submit.api_for(args.endpoint))
    if not rows:
        _out(f"hardware list unavailable (no network or no token): prices unknown; {submit.PRICING_HELP}")
        return 0
    for r in rows:
        _out(f"{r['name']:<16} {r['usd_per_hour']:>8} USD/h  {r['cpu']:<10} {r['ram']:<8} {r['accelerator']}")
    return 0
