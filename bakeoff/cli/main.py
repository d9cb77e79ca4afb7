"""``bakeoff`` command line. Bad input is one line on stderr naming the fix, exit code 2."""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bakeoff.api.errors import UserError
from bakeoff.cli.progress import print_verdicts as _print_summary
from bakeoff.cli.progress import Progress, choose_mode
from bakeoff.cli.gating import EXIT_BAD_INPUT, EXIT_INTERRUPTED, EXIT_NO_RUN, GATE_STATUSES, gate, parse_fail_on
from bakeoff.host.procs import sigterm_as_interrupt

REPO = Path(__file__).resolve().parents[2]
CHECKOUT = (REPO / "pyproject.toml").is_file()  # else an installed wheel: REPO is site-packages
DEFAULT_MODEL = "fixture:tiny-qwen3"
DEFAULT_ARTIFACTS = str(REPO / "artifacts") if CHECKOUT else "artifacts"  # installed: under the current folder


def _pytest_cmd(*opts: str) -> tuple[list[str], str]:
    """``python -m pytest`` on the evaluations suite, and the folder it runs in.

    From a checkout: its ``evaluations/`` with the checkout as rootdir and folder. Installed:
    the package's folder, from the current folder, with no ini file (``-c`` the null device: a
    ``pytest.ini`` or ``addopts`` of the user's project does not apply) and no conftest above
    the package. The plugin is named with ``-p`` (as its pytest11 entry point names it, so it is
    registered once) so that ``PYTEST_DISABLE_PLUGIN_AUTOLOAD`` does not lose it."""
    ev = REPO / "evaluations"
    cmd = [sys.executable, "-m", "pytest", str(ev), "-p", "evaluations.plugin", "-p", "evaluations.reference",
           "-p", "no:cacheprovider", "-q", "-o", "console_output_style=classic"]
    if CHECKOUT:
        return cmd + ["--rootdir", str(REPO), *opts], str(REPO)
    return cmd + ["-c", os.devnull, "--rootdir", str(ev), "--confcutdir", str(ev), *opts], os.getcwd()


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2 (argparse prints usage too: keep it short)
        raise UserError(f"{message} (see: {self.prog} --help)")


def _plain_name(name: str, flag: str) -> str:
    """A report name under ``artifacts/reports/``: one plain path component.

    Raises:
        UserError: empty, a path (``/``, ``..``) or hidden.
    """
    if not name or name != Path(name).name or name in (".", "..") or name.startswith("."):
        raise UserError(f"{flag} {name!r} is not a plain name; reports go to artifacts/reports/NAME: pass a name "
                        "such as latest or cpu-vs-h200")
    return name


def cmd_qualify(args) -> int:
    import backends
    from bakeoff.host.artifacts import check_artifacts, check_writable
    from bakeoff.models.resolve import check as check_model
    from bakeoff.models.resolve import resolve
    from bakeoff.api.options import parse_kv, parse_options, split_backend_opts
    from bakeoff.reporting.report import write_report

    from bakeoff.host.envs import mode as envs_mode

    envs_mode()  # a BAKEOFF_ENVS bakeoff does not know is refused before any work
    fail_on = parse_fail_on(args.fail_on)
    if args.resume:
        return _resume(args, fail_on)
    args.model = DEFAULT_MODEL if args.model is None else args.model
    if not args.model.strip():
        raise UserError("--model is empty; pass a checkpoint folder, a hub id (org/name) or fixture:NAME")
    if args.backends is not None and not args.backends.strip(", "):
        raise UserError(f"--backends names no backend; choose from: {', '.join(backends.REGISTRY)}")
    if not str(args.artifacts).strip():
        raise UserError("--artifacts is empty; pass the folder runs and reports go to (default: artifacts)")
    report_name = _plain_name(args.report, "--report")
    names = [b.strip() for b in (args.backends or ",".join(backends.DEFAULT_QUALIFY)).split(",") if b.strip()]
    if len(set(names)) != len(names):
        raise UserError(f"--backends names a backend twice ({args.backends}); name each once")
    for n in names:
        backends.validate(n)
    per = split_backend_opts(args.backend_opt, names)
    from bakeoff.analysis.matrix import baselines_first, cells_for, merge_options, parse_matrix

    cells = baselines_first(parse_matrix(args.matrix))  # a quantized-KV cell is judged against its auto cell
    if args.repeats < 1:
        raise UserError(f"--repeats must be at least 1, got {args.repeats}")
    by_backend, left_out = {}, {}  # each backend varies the axes it has an option for
    for n in names:
        fields = backends.resolve(n).Options.model_fields
        by_backend[n], left_out[n] = cells_for(cells, fields.__contains__)
    for axis in cells[0].choices:
        if all(axis in left_out[n] for n in names):
            raise UserError(f"--matrix {axis} is an option of none of {', '.join(names)}; "
                            "check its spelling (a preset: speculative, prefix_cache) or drop the axis")
    for n in names:
        for cell in by_backend[n]:
            parse_options(n, backends.resolve(n).Options, parse_kv(merge_options(per[n], cell)))
    parse_options("transformers", backends.resolve("transformers").Options, parse_kv(args.reference_opt))
    from evaluations.session import PROFILES

    if args.profile not in PROFILES:  # the plugin's own table: a profile is defined once
        raise UserError(f"unknown profile {args.profile!r}; choose one of: {', '.join(PROFILES)}")
    # everything is checked before the first fixture build (minutes) or write (issue 15)
    from evaluations.patching import check as check_patches

    check_patches(args.patch)  # a malformed --patch: one line, before any build
    check_model(args.model)
    if args.reference_model:  # a fixture reference must be built already (bakeoff fixture build NAME)
        ref = resolve(args.reference_model, build=False)
        args.reference_model = ref.path if ref.local and not args.reference_model.startswith("fixture:") else args.reference_model
    check_artifacts(Path(args.artifacts), report_name)
    from bakeoff.cli.steps import StepClock, prepare

    clock = StepClock()  # engine environments are made while the fixture trains, on one live view
    with Progress(choose_mode(args.quiet)) as progress:
        model = prepare(args.model, [spec for n in names for spec in backends.resolve(n).env_specs()],
                        progress.phases, clock)
        if model.local and not args.model.startswith("fixture:"):
            args.model = model.path  # absolute: the evaluation runs with the repository as its folder
        artifacts = check_writable(Path(args.artifacts)).resolve()
        runs: list[Path] = []
        missing: list[tuple[str, str, str]] = []  # (label, "incomplete", why) of runs that were not written
        cell_runs: dict[tuple[str, str], Path] = {}  # (backend, cell label) -> its run, for --baseline-run
        progress.say(f"qualifying {', '.join(names)} on {args.model} ({args.profile} profile)")
        for n in names:
            if left_out[n]:
                print(f"{n}: --matrix {', '.join(left_out[n])} not varied (no such option of {n})", flush=True)
        for n, cell in [(n, cell) for n in names for cell in by_backend[n]]:  # each matrix cell is its own run
            t_run, before = time.monotonic(), len(runs)
            _one_run(args, n, cell, by_backend[n], per, artifacts, progress, runs, cell_runs, missing)
            clock.add_run(n + (f" [{cell.label}]" if cell.label else ""), time.monotonic() - t_run,
                          runs[-1] if len(runs) > before else None)
    if not runs:
        print("bakeoff: error: no run was written; see the errors above", file=sys.stderr)
        return EXIT_NO_RUN
    report = write_report(runs, artifacts / "reports" / report_name)
    outcomes = _print_summary(runs)
    if progress.mode != "quiet":
        clock.print()
    print(f"\nreport: {report}")
    return _exit_code(outcomes + missing, fail_on)


def _one_run(args, n: str, cell, cells, per, artifacts: Path, progress, runs: list[Path],
             cell_runs: dict, missing: list) -> None:
    """One backend x matrix cell: its pytest subprocess; appends to ``runs`` or ``missing``."""
    from bakeoff.analysis.matrix import baseline_cell, merge_options

    t0 = time.monotonic()
    with tempfile.NamedTemporaryFile("r", suffix=".run", delete=False) as fh:
        run_file = fh.name
    # --opt=value: pytest's first parse does not know the plugin's options yet and would take a
    # separate value naming a folder for a test path, importing any conftest.py in it
    cmd, cwd = _pytest_cmd(f"--backend={n}", f"--model={args.model}", f"--artifacts={artifacts}",
                           f"--profile={args.profile}", f"--repeats={args.repeats}")
    for o in merge_options(per[n], cell):
        cmd.append(f"--backend-opt={o}")
    if args.reference_model:
        cmd.append(f"--reference-model={args.reference_model}")
    cmd += [f"--reference-opt={o}" for o in args.reference_opt]
    if args.no_preflight:
        cmd.append("--no-preflight")
    cmd += [f"--patch={p}" for p in args.patch]
    base = baseline_cell(cell, cells)
    if base is not None and (n, base.label) in cell_runs:
        cmd.append(f"--baseline-run={cell_runs[(n, base.label)]}")
    elif base is not None:
        print(f"{n} [{cell.label}]: its baseline cell [{base.label}] wrote no run; its KV ratio is not judged", flush=True)
    env = dict(os.environ, BAKEOFF_RUN_FILE=run_file)
    label = n + (f" [{cell.label}]" if cell.label else "")
    progress.announce(label, cmd)
    try:
        code, run_dir = progress.run(label, cmd, env, cwd, run_file)
    finally:
        os.unlink(run_file)
    if code in (3, 4) or run_dir is None:
        print(f"{n}: the evaluation did not start (pytest exit {code})", file=sys.stderr)
        missing.append((label, "incomplete", f"no run written: pytest exit {code}"))
        return
    runs.append(run_dir)
    cell_runs[(n, cell.label)] = run_dir
    if progress.mode != "quiet":
        print(f"--- {n}: {time.monotonic() - t0:.0f} s, pytest exit {code} -> {run_dir}", flush=True)


def _exit_code(outcomes: list[tuple[str, str, str]], fail_on: frozenset[str]) -> int:
    code, failing = gate(outcomes, fail_on)
    for line in failing:
        print(f"bakeoff: --fail-on {','.join(sorted(fail_on))}: {line}", file=sys.stderr)
    return code


def _resume(args, fail_on: frozenset[str]) -> int:
    """``bakeoff qualify --resume RUN_DIR``: finish a cut-off run (completed checks are kept),
    then re-write the report. The run's own backend, model and options apply, so options that
    choose them conflict."""
    from bakeoff.reporting.report import write_report

    given = [f for f, v in (("--backends", args.backends), ("--model", args.model), ("--backend-opt", args.backend_opt),
                            ("--matrix", args.matrix), ("--reference-model", args.reference_model),
                            ("--reference-opt", args.reference_opt)) if v]
    given += [f for f, v in (("--profile", args.profile != "quick"), ("--artifacts", args.artifacts != DEFAULT_ARTIFACTS),
                             ("--no-preflight", args.no_preflight), ("--patch", args.patch)) if v]
    if given:
        raise UserError(f"--resume continues a run with its own settings; drop {', '.join(given)}")
    if args.repeats < 1:
        raise UserError(f"--repeats must be at least 1, got {args.repeats}")
    report_name = _plain_name(args.report, "--report")  # before the resumed run, not after it
    run_dir = Path(args.resume).resolve()
    from bakeoff.host.artifacts import check_creatable
    from evaluations.session import read_resumable

    read_resumable(run_dir)  # the checks the plugin makes again when it resumes: one function
    check_creatable(run_dir.parent.parent / "reports" / report_name, "report folder",
                    "make the run's artifacts folder writable, or copy the run into one that is")
    cmd, cwd = _pytest_cmd(f"--resume={run_dir}", f"--repeats={args.repeats}")
    print(f"resuming {run_dir.name}\n$ {' '.join(cmd)}", flush=True)
    proc = subprocess.run(cmd, cwd=cwd)
    if proc.returncode in (3, 4):
        raise UserError(f"could not resume {run_dir.name} (pytest exit {proc.returncode}; see the error above)")
    report = write_report([run_dir], run_dir.parent.parent / "reports" / report_name)
    outcomes = _print_summary([run_dir])
    print(f"\nreport: {report}")
    return _exit_code(outcomes, fail_on)


def _report_dest(args) -> Path:
    """``artifacts/reports/NAME`` for ``report`` / ``compare``, checked writable (nothing is
    created: the runs are read and checked first, then the report folder is made)."""
    from bakeoff.host.artifacts import check_creatable

    name = _plain_name(args.name, "--name")
    check_creatable(Path(args.artifacts))
    return check_creatable(Path(args.artifacts) / "reports" / name)


@contextlib.contextmanager
def _io_as_user_error(what: str):
    """An OSError while reading runs or writing ``what`` becomes one line naming the file."""
    try:
        yield
    except OSError as exc:
        raise UserError(f"cannot read the runs or write the {what}: {exc.__class__.__name__}: {exc.strerror or exc} "
                        f"({exc.filename}); pass readable run folders and a writable --artifacts") from None


def cmd_report(args) -> int:
    from bakeoff.reporting.report import write_report

    paths = [Path(p) for p in args.runs] or [Path(args.artifacts) / "runs"]
    dest = _report_dest(args)
    with _io_as_user_error("report"):
        print(write_report(paths, dest))
    return 0


def cmd_compare(args) -> int:
    from bakeoff.reporting.compare import write_compare

    dest = _report_dest(args)
    with _io_as_user_error("comparison"):
        out = write_compare([Path(p) for p in args.runs], dest, args.baseline)
    print(f"{out['markdown']}\n{out['html']}")
    return 0


def cmd_fixture(args) -> int:
    from bakeoff.models import fixtures

    if args.action == "list":
        for n in fixtures.names():
            print(f"{n}\t{'built' if fixtures.is_built(n) else 'not built'}")
        return 0
    if not args.name:
        raise UserError(f"name a fixture to build: {', '.join(fixtures.names())}")
    for name in args.name:
        if name.removeprefix("fixture:") not in fixtures.names():
            raise UserError(f"unknown fixture {name!r}; choose one of: {', '.join(fixtures.names())}")
    from bakeoff.host.artifacts import check_creatable

    if args.force or not all(fixtures.is_built(n.removeprefix("fixture:")) for n in args.name):
        check_creatable(fixtures.cache_root(), "fixture cache", "point BAKEOFF_CACHE at a writable folder")
    for name in args.name:
        print(fixtures.build(name.removeprefix("fixture:"), force=args.force, log=lambda s: print(s, flush=True)))
    return 0


def cmd_envs(args) -> int:
    from bakeoff.host import envs

    root = envs.cache_root() / "envs"
    for p in sorted(root.glob("*")) if root.is_dir() else []:
        if p.is_dir():
            print(f"{p.name}\t{'ready' if (p / '.bakeoff-ready').is_file() else 'incomplete'}\t{p}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    import backends

    ap = _Parser(prog="bakeoff", description="Qualify or disqualify LLM inference backends for a model, "
                 "with captured evidence, and measure the ones that qualify.")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    q = sub.add_parser("qualify", help="run the evaluations once per backend, then write a report")
    q.add_argument("--backends", help=f"comma-separated, from: {', '.join(backends.names())} "
                   f"(default: {','.join(backends.DEFAULT_QUALIFY)})")
    q.add_argument("--model", default=None, help=f"checkpoint folder, hub id, or fixture:NAME (default: {DEFAULT_MODEL})")
    q.add_argument("--backend-opt", action="append", default=[], metavar="[BACKEND:]KEY=VALUE",
                   help="an engine option (repeatable); BACKEND: limits it to one backend, e.g. "
                        "vllm:kv_cache_dtype=fp8 (an unknown key is refused with the backend's valid keys)")
    q.add_argument("--profile", default="quick", help="quick (1-8 sessions, default) | full (1-32 sessions)")
    q.add_argument("--artifacts", default=DEFAULT_ARTIFACTS, help="folder for runs/ and reports/ "
                   "(default: the checkout's artifacts/; installed: ./artifacts)")
    q.add_argument("--report", default="latest", help="report name under artifacts/reports/")
    q.add_argument("--reference-model", default=None, help="the transformers reference's checkpoint "
                   "(default: the model under test, or its unquantized source when known)")
    q.add_argument("--reference-opt", action="append", default=[], metavar="KEY=VALUE",
                   help="option of the transformers reference, e.g. device=cpu")
    q.add_argument("--no-preflight", action="store_true", help="let each engine decide whether it loads the checkpoint")
    q.add_argument("--patch", action="append", default=[], metavar="PATCH",
                   help="run every backend on a recorded, patched copy of the checkpoint (repeatable): "
                        "quantization_config.ignore+=re:.*mtp\\..*, PATH=VALUE, del:PATH; or 'preflight' for the "
                        "patches the pre-flight rules suggest")
    q.add_argument("--matrix", action="append", default=[], metavar="KEY=V1,V2",
                   help="run every combination (repeatable): a backend option or a preset "
                        "(speculative=none,ngram,mtp; prefix_cache=on,off)")
    q.add_argument("--repeats", type=int, default=1, help="measure each sweep point R times (noise estimate)")
    q.add_argument("--quiet", action="store_true", help="no live table and no pytest output (each run keeps it "
                   "in pytest.log); only the verdicts at the end")
    q.add_argument("--fail-on", action="append", default=[], metavar="STATUS",
                   help=f"exit 1 when a run's verdict is STATUS (repeatable): {', '.join(GATE_STATUSES)}; "
                        "without it the exit code is 0 whatever the verdicts (README 'CI gating')")
    q.add_argument("--resume", default=None, metavar="RUN_DIR",
                   help="finish a cut-off run (its verdict says incomplete): completed checks are kept, then the report "
                        "is re-written; the run's own backend, model and options apply")
    q.set_defaults(func=cmd_qualify)
    c = sub.add_parser("compare", help="compare runs side by side (Markdown + HTML + plots)")
    c.add_argument("runs", nargs="+", help="run directories or folders of them")
    c.add_argument("--baseline", default=None, help="run id, column label or 1-based column number (default: first)")
    c.add_argument("--artifacts", default=DEFAULT_ARTIFACTS)
    c.add_argument("--name", default="compare", help="report name under artifacts/reports/")
    c.set_defaults(func=cmd_compare)
    r = sub.add_parser("report", help="write a Markdown report of run directories")
    r.add_argument("runs", nargs="*", help="run directories or folders of them (default: artifacts/runs)")
    r.add_argument("--artifacts", default=DEFAULT_ARTIFACTS)
    r.add_argument("--name", default="latest")
    r.set_defaults(func=cmd_report)
    f = sub.add_parser("fixture", help="build or list bakeoff's fixture models")
    f.add_argument("action", choices=["build", "list"])
    f.add_argument("name", nargs="*")
    f.add_argument("--force", action="store_true")
    f.set_defaults(func=cmd_fixture)
    e = sub.add_parser("envs", help="list engine environments")
    e.set_defaults(func=cmd_envs)
    from bakeoff.cli.jobs.cli import add_jobs_parser; add_jobs_parser(sub)
    from bakeoff.cli.tools import add_tool_parsers; add_tool_parsers(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    try:
        sigterm_as_interrupt()
        argv = list(sys.argv[1:] if argv is None else argv)
        if argv[:1] == ["calibrate"]:  # its own parser (bakeoff.loadgen.calibrate)
            from bakeoff.loadgen.calibrate import cli_calibrate

            return cli_calibrate(argv[1:])
        ap = build_parser()
        args = ap.parse_args(argv)
        if not getattr(args, "func", None):
            ap.print_help()
            return 0
        return args.func(args)
    except UserError as exc:
        print(f"bakeoff: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("bakeoff: interrupted; runs written so far are kept (`bakeoff qualify --resume RUN_DIR` finishes one)",
              file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:  # huggingface_hub's, raised lazily by the jobs commands
        if type(exc).__name__ != "LocalTokenNotFoundError":
            raise
        print("bakeoff: error: no Hugging Face token; log in with `hf auth login` or set HF_TOKEN", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
