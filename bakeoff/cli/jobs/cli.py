"""``bakeoff jobs ...``: render, submit and follow exports and qualifications as Hugging Face Jobs.

Wired into ``bakeoff/cli/main.py`` by ``add_jobs_parser(sub)``. Everything printed goes through
:func:`bakeoff.host.redact.redact`; bad input is a one-line :class:`~bakeoff.api.errors.UserError`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import ValidationError

import adapters

from bakeoff.host.artifacts import atomic_write_text, check_creatable
from bakeoff.api.errors import UserError
from bakeoff.cli.jobs import render, submit
from bakeoff.cli.jobs.specs import ExportTask, JobRequest, JobTask, PushTarget, QualifyTask
from bakeoff.host.redact import redact

REPO = Path(__file__).resolve().parents[3]


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


def _check_fixture(flag: str, spec: str | None) -> None:
    """A ``fixture:NAME`` must name a fixture bakeoff knows (the job builds it: a typo would
    be found only after the job started)."""
    if spec and spec.startswith("fixture:"):
        from bakeoff.models import fixtures

        name = spec.split(":", 1)[1]
        if name not in fixtures.names():
            raise UserError(f"{flag}: unknown fixture {name!r}; choose one of: "
                            f"{', '.join('fixture:' + n for n in fixtures.names())}")


def _first_error(exc: ValidationError) -> str:
    e = exc.errors()[0]
    return f"{'.'.join(str(x) for x in e['loc'])}: {e['msg']}".removeprefix(": ").replace("Value error, ", "")


# the flags of `jobs export` that are adapter Options fields (a flag's dest is the field's name)
EXPORT_FLAGS = ("precision", "execution_provider", "block_size", "accuracy_level", "int4_algo", "moe_quant_type",
                "qmoe_block_size", "extra_option", "num_samples", "max_seq_length", "opset", "weight_format",
                "group_size", "ratio", "sym")
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
    import backends

    names = [b.strip() for b in args.backends.split(",") if b.strip()]
    if not names:
        raise UserError("--backends names no backend")
    for n in names:
        backends.validate(n)
    from bakeoff.api.options import parse_kv, parse_options, split_backend_opts

    per = split_backend_opts(args.backend_opt, names)  # the same checks as `bakeoff qualify`, before anything is rendered
    for n in names:
        parse_options(n, backends.resolve(n).Options, parse_kv(per[n]))
    q = QualifyTask(backends=names, profile=args.profile, backend_opts=args.backend_opt,
                    reference_model=args.reference_model)
    return JobTask(kind="qualify", tag=tag, model=args.model, qualify=q, push_to=push, path_in_repo=args.path_in_repo or "")


def cmd_submit(args) -> int:
    """``bakeoff jobs export|qualify``: render per flavor, then print (--dry-run) or submit."""
    flavors = [f.strip() for f in (getattr(args, "flavors", None) or args.flavor).split(",") if f.strip()]
    if not flavors:
        raise UserError("--flavors names no flavor; e.g. --flavors cpu-xl,a100-large (bakeoff jobs hardware lists them)")
    if args.save_script:
        targets = [Path(args.save_script)] if len(flavors) == 1 else [
            Path(args.save_script).with_name(f"{Path(args.save_script).stem}-{f}{Path(args.save_script).suffix}") for f in flavors]
        for t in targets:
            if t.exists():
                raise UserError(f"--save-script {t} exists; pass a new file name (bakeoff does not overwrite it)")
            if not t.resolve().parent.is_dir():
                raise UserError(f"--save-script {t}: its folder does not exist; pass a file in an existing folder")
            check_creatable(t.resolve().parent, "--save-script folder", "pass a file in a folder you can write")
    for f in flavors:
        submit.check_flavor(f)
    if args.push_to is None and not args.dry_run:
        raise UserError("name where the output goes: --push-to org/name (a Hub repo), or --push-to none")
    push = PushTarget.parse(args.push_to or "none")
    for flag, spec in (("--model", args.model), ("--reference-model", getattr(args, "reference_model", None))):
        _check_fixture(flag, spec)
    if not args.dry_run:
        if render.is_local_spec(args.bakeoff_spec):
            raise UserError(f"--bakeoff-spec {args.bakeoff_spec} is a path on this machine, which a job cannot reach; "
                            "pass a git URL (git+https://...@REV) or a published version (default)")
        if Path(args.model).expanduser().exists():
            raise UserError(f"--model {args.model} is a local folder, which a job cannot reach; pass a Hub id or fixture:NAME")
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
        if args.save_script:
            path = Path(args.save_script)
            if len(flavors) > 1:
                path = path.with_name(f"{path.stem}-{flavor}{path.suffix}")
            atomic_write_text(path, script)
            _out(f"script: {path}")
        if args.dry_run:
            _out(f"# ---- {flavor}: script ----\n{script}# ---- {flavor}: job request (not submitted) ----")
            _out(json.dumps(submit.describe_request(submit.job_kwargs(task, req, script)), indent=1))
            _out(f"cost: {submit.cost_line([], flavor, req.timeout)}")
            continue
        rec = submit.submit(api, task, req, script, records)
        _out(f"submitted {rec.job_id} ({flavor}, timeout {req.timeout}, secrets: {', '.join(rec.secrets) or 'none'}) "
             f"-> {rec.push_to}{'/' + rec.path_in_repo if rec.path_in_repo else ''}\n  {rec.url}\n  "
             f"{submit.cost_line(prices, flavor, req.timeout)}")
    if not args.dry_run:
        _out("follow: bakeoff jobs logs JOB_ID --follow; then: bakeoff jobs fetch JOB_ID")
    return 0


def cmd_status(args) -> int:
    api = submit.api_for(args.endpoint)
    for job_id in args.job_ids:
        _out(json.dumps(submit.summarize(api.inspect_job(job_id=job_id, namespace=args.namespace))))
    return 0


def cmd_logs(args) -> int:
    api = submit.api_for(args.endpoint)
    for line in submit.logs(api, args.job_id, follow=args.follow, tail=args.tail, namespace=args.namespace):
        _out(line)
    return 0


def cmd_wait(args) -> int:
    api = submit.api_for(args.endpoint)
    rows = submit.wait(api, args.job_ids, timeout_s=args.timeout_s, poll_s=args.poll_s, namespace=args.namespace)
    for r in rows:
        _out(json.dumps(r))
    return 0 if all(r["stage"] == "COMPLETED" for r in rows) else 1


def cmd_cancel(args) -> int:
    api = submit.api_for(args.endpoint)
    for job_id in args.job_ids:
        api.cancel_job(job_id=job_id, namespace=args.namespace)
        _out(f"canceled {job_id}")
    return 0


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


def cmd_hardware(args) -> int:
    rows = submit.hardware(submit.api_for(args.endpoint))
    if not rows:
        _out(f"hardware list unavailable (no network or no token): prices unknown; {submit.PRICING_HELP}")
        return 0
    for r in rows:
        _out(f"{r['name']:<16} {r['usd_per_hour']:>8} USD/h  {r['cpu']:<10} {r['ram']:<8} {r['accelerator']}")
    return 0


def _common(p, artifacts: bool = False) -> None:
    p.add_argument("--endpoint", default=None, help="Hub endpoint (default: $HF_ENDPOINT or https://huggingface.co)")
    p.add_argument("--namespace", default=None, help="user or org owning the jobs (default: the token's user)")
    if artifacts:
        p.add_argument("--artifacts", default=str(REPO / "artifacts"))


def _submission(p) -> None:
    _common(p, artifacts=True)
    p.add_argument("--model", default="fixture:tiny-qwen3", help="fixture:NAME or a Hub id (a local path only for uv run here)")
    p.add_argument("--push-to", default=None, help="org/name, datasets/org/name, file:///abs/path (local runs) or none")
    p.add_argument("--path-in-repo", default=None, help="folder in the target (default: export at the root, "
                   "qualify under jobs/<tag>-<flavor>)")
    p.add_argument("--timeout", default="1h", help="job timeout: 30m, 2h, or seconds (default 1h)")
    p.add_argument("--secret", action="append", default=[], metavar="NAME", help="secret NAME; its value is read from "
                   "this environment (HF_TOKEN: or the saved login) and never written (repeatable)")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="plain environment variable")
    p.add_argument("--label", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--image", default=None, help="Docker image with uv (default: huggingface_hub's uv image)")
    p.add_argument("--python", default=None, help="Python version for uv run inside the job")
    p.add_argument("--bakeoff-spec", default=None, help="how the job installs bakeoff: git+https://...@REV, a version, "
                   "a wheel or the repo folder (paths: local uv run only); default bakeoff==<this version>")
    p.add_argument("--torch-index", default="auto", help="auto (PyTorch CPU index on cpu-* flavors) | pytorch-cpu | pypi")
    p.add_argument("--dry-run", action="store_true", help="print the script and the job request; submit nothing")
    p.add_argument("--save-script", default=None, metavar="PATH", help="also write the script (for uv run PATH)")


def add_jobs_parser(sub) -> None:
    """Add ``jobs`` and its subcommands to bakeoff's subparsers."""
    j = sub.add_parser("jobs", help="run exports and qualifications as Hugging Face Jobs (see docs/jobs.md)")
    js = j.add_subparsers(dest="command_jobs", metavar="ACTION", parser_class=type(j))
    e = js.add_parser("export", help="an adapter pipeline (ort-genai INT4/QMoE export, awq-int4) as a job")
    e.add_argument("pipeline", choices=adapters.names())
    _submission(e)
    e.add_argument("--flavor", default="cpu-xl")
    # each flag is an adapter Options field of the same name; one the pipeline lacks is refused, and
    # one left out takes that adapter's default (ort-genai int4, optimum-onnx fp32, openvino fp16)
    e.add_argument("--precision", default=None, help="ort-genai: fp32|fp16|bf16|int8|int4; optimum-onnx: fp32|int8")
    e.add_argument("--execution-provider", default=None)
    e.add_argument("--block-size", type=int, default=None)
    e.add_argument("--accuracy-level", type=int, default=None)
    e.add_argument("--int4-algo", default=None)
    e.add_argument("--moe-quant-type", default=None, help="QMoE expert precision (int4, int8, ...)")
    e.add_argument("--qmoe-block-size", type=int, default=None)
    e.add_argument("--extra-option", action="append", default=[], metavar="KEY=VALUE", help="builder --extra_options")
    e.add_argument("--num-samples", type=int, default=None, help="awq-int4 calibration samples")
    e.add_argument("--max-seq-length", type=int, default=None, help="awq-int4 calibration tokens per sample")
    e.add_argument("--opset", type=int, default=None, help="optimum-onnx: ONNX opset")
    e.add_argument("--weight-format", default=None, help="openvino: fp32|fp16|int8|int4 (NNCF compression)")
    e.add_argument("--group-size", type=int, default=None, help="openvino: int4 group size (-1: per channel)")
    e.add_argument("--ratio", type=float, default=None, help="openvino: share of layers in int4, the rest int8")
    e.add_argument("--sym", action="store_true", default=None, help="openvino: symmetric int4/int8 compression")
    e.set_defaults(func=cmd_submit)
    q = js.add_parser("qualify", help="`bakeoff qualify` as one job per flavor")
    _submission(q)
    q.add_argument("--flavors", "--flavor", dest="flavors", default="l40sx1", help="comma-separated: one job each")
    q.add_argument("--backends", required=True)
    q.add_argument("--profile", default="quick", choices=["quick", "full"])
    q.add_argument("--backend-opt", action="append", default=[], metavar="[BACKEND:]KEY=VALUE")
    q.add_argument("--reference-model", default=None)
    q.set_defaults(func=cmd_submit, flavor="l40sx1")
    for name, fn, help_ in (("status", cmd_status, "stage of jobs"), ("cancel", cmd_cancel, "cancel jobs")):
        p = js.add_parser(name, help=help_)
        p.add_argument("job_ids", nargs="+")
        _common(p)
        p.set_defaults(func=fn)
    lg = js.add_parser("logs", help="a job's logs (--follow: until it ends)")
    lg.add_argument("job_id")
    lg.add_argument("--follow", "-f", action="store_true")
    lg.add_argument("--tail", type=int, default=None)
    _common(lg)
    lg.set_defaults(func=cmd_logs)
    w = js.add_parser("wait", help="block until jobs end; exit 1 unless all COMPLETED")
    w.add_argument("job_ids", nargs="+")
    w.add_argument("--timeout-s", type=float, default=None)
    w.add_argument("--poll-s", type=float, default=5.0)
    _common(w)
    w.set_defaults(func=cmd_wait)
    f = js.add_parser("fetch", help="copy pushed run directories into artifacts/runs/")
    f.add_argument("job_ids", nargs="*")
    f.add_argument("--from", dest="from_", default=None, metavar="TARGET", help="org/name, datasets/org/name or file:///path")
    f.add_argument("--path-in-repo", default=None)
    _common(f, artifacts=True)
    f.set_defaults(func=cmd_fetch)
    h = js.add_parser("hardware", help="job flavors and prices from the Hub")
    _common(h)
    h.set_defaults(func=cmd_hardware)
