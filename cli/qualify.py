"""``bakeoff qualify``: check the request (:func:`evaluations.inputs.check_request`), make the engine
environments in the background while the fixture resolves (copied from its shipped weights, or
trained) and while the runs go, run ``pytest evaluations/`` once per backend x matrix cell (each in
its own process, one at a time, each as soon as its own environments are made:
``cli/steps.py by_readiness``), then write the report. ``--resume RUN_DIR`` finishes a cut-off run."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bakeoff.api.errors import UserError
from cli.gating import EXIT_NO_RUN, gate, parse_fail_on
from evaluations.inputs import Request, check_request, resume_request
import backends

REPO = Path(__file__).resolve().parents[1]
CHECKOUT = (REPO / "pyproject.toml").is_file()  # else an installed wheel: REPO is site-packages


# What the evaluations do not use, left out of each run's pytest: hypothesis's and xdist's plugins (bakeoff's
# test extra installs them; hypothesis alone imported for 1.05 s at every session's end) and assertion
# rewriting (the checks record through run.check, not assert; rewriting bakeoff's ~200 modules took ~0.7 s
# where bytecode is not written). A cell started 1.3 s sooner: 5.2 -> 3.9 s for trtllm's (2026-12-05).
LEAN = ("-p", "no:hypothesispytest", "-p", "no:xdist", "--assert=plain")


def _pytest_cmd(*opts: str) -> tuple[list[str], str]:
    """``python -m pytest`` on the evaluations suite, and the folder it runs in.

    From a checkout: its ``evaluations/`` with the checkout as rootdir and folder. Installed:
    the package's folder, from the current folder, with no ini file (``-c`` the null device: a
    ``pytest.ini`` or ``addopts`` of the user's project does not apply) and no conftest above
    the package. The plugin is named with ``-p`` (as its pytest11 entry point names it, so it is
    registered once) so that ``PYTEST_DISABLE_PLUGIN_AUTOLOAD`` does not lose it."""
    ev = REPO / "evaluations"
    cmd = [sys.executable, "-m", "pytest", str(ev), "-p", "evaluations.plugin", "-p", "evaluations.reference",
           "-p", "no:cacheprovider", *LEAN, "-q", "-o", "console_output_style=classic"]
    if CHECKOUT:
        return cmd + ["--rootdir", str(REPO), *opts], str(REPO)
    return cmd + ["-c", os.devnull, "--rootdir", str(ev), "--confcutdir", str(ev), *opts], os.getcwd()


def _request(args):
    """``bakeoff qualify``'s flags as an :class:`evaluations.inputs.Request` (None: not given)."""
    return Request(entry="qualify", backends=None if args.backends is None else args.backends.split(","), model=args.model,
                   backend_opt=args.backend_opt, matrix=args.matrix, profile=args.profile, artifacts=args.artifacts,
                   report=args.report, reference_model=args.reference_model, reference_opt=args.reference_opt,
                   patch=args.patch, no_preflight=args.no_preflight, repeats=args.repeats, resume=args.resume,
                   spec_starts=args.spec_starts)


def cmd_qualify(args) -> int:
    """Check everything (:func:`evaluations.inputs.check_request`, the function ``pytest
    evaluations/`` calls too), then run each backend x matrix cell and write the report."""
    fail_on = parse_fail_on(args.fail_on)
    if args.resume is not None:
        return _resume(_request(args), fail_on)
    checked = check_request(_request(args))
    return _qualify(checked, args.quiet, fail_on)


def _qualify(c, quiet: bool, fail_on: frozenset[str]) -> int:
    """The checked request ``c`` (:class:`evaluations.inputs.Checked`): environments and fixture,
    one evaluation per run, the report."""
    # lazy: bakeoff qualify answers bad input before these load (pydantic 0.1 s, the model resolvers 60 ms, the environments 20 ms); tests patch cli.progress.print_verdicts and bakeoff.reporting.report.write_report (read at call time)
    from cli import steps
    from cli.progress import Progress, choose_mode
    from cli.progress import print_verdicts as _print_summary
    from bakeoff.host.artifacts import check_writable
    from bakeoff.models.resolve import resolve
    from bakeoff.reporting.report import write_report

    if c.reference_model and not c.reference_model.startswith("fixture:"):
        ref = resolve(c.reference_model, build=False)  # absolute: the evaluation runs in the repository
        c.reference_model = ref.path if ref.local else c.reference_model
    clock = steps.StepClock()  # environments made in the background from the start; each run once its own are made
    specs = {n: backends.resolve(n).env_specs() for n in c.backends}
    needs = {n: [str(spec.path) for spec in specs[n]] for n in c.backends}
    with Progress(choose_mode(quiet)) as progress:
        model, prewarm = steps.prepare(c.model, [spec for n in c.backends for spec in specs[n]], progress.phases, clock)
        if model.local and not model.fixture and not model.packaged:
            c.model = model.path  # absolute: the evaluation runs with the repository as its folder
        artifacts = check_writable(c.artifacts).resolve()
        runs: list[Path] = []
        missing: list[tuple[str, str, str]] = []  # (label, "incomplete", why) of runs that were not written
        cell_runs: dict[tuple[str, str], Path] = {}  # (backend, cell label) -> its run, for --baseline-run
        progress.say(f"qualifying {', '.join(c.backends)} on {c.model} ({c.profile} profile)")
        for n in c.backends:
            if c.left_out[n]:
                print(f"{n}: --matrix {', '.join(c.left_out[n])} not varied (no such option of {n})", flush=True)
        # each matrix cell is its own run, one at a time; a run whose environment is made goes first
        progress.phases.runs_started()
        shared = tempfile.TemporaryDirectory(prefix="bakeoff-qualify-")  # what the command's runs share
        calibration = {"BAKEOFF_CALIBRATION_FILE": str(Path(shared.name) / "calibration.json")}  # evaluations/test_calibration.py
        for nxt in steps.by_readiness(c.runs, lambda r: needs[r.backend], prewarm, _label, progress.say):
            run, t_run, before = nxt.run, time.monotonic(), len(runs)
            _one_run(c, run, artifacts, progress, runs, cell_runs, missing, calibration)
            clock.add_run(_label(run), time.monotonic() - t_run, runs[-1] if len(runs) > before else None,
                          nxt, prewarm.made_between(t_run, time.monotonic()))
        clock.add_envs(prewarm)
        shared.cleanup()
    if not runs:
        print("bakeoff: error: no run was written; see the errors above", file=sys.stderr)
        return EXIT_NO_RUN
    report = write_report(runs, artifacts / "reports" / c.report)
    outcomes = _print_summary(runs)
    if progress.mode != "quiet":
        clock.print()
    print(f"\nreport: {report}")
    return _exit_code(outcomes + missing, fail_on)


def _label(run) -> str:
    """``vllm`` or ``vllm [kv_cache_dtype=fp8]``: a run's name in the view and the table."""
    return run.backend + (f" [{run.cell.label}]" if run.cell.label else "")


def _one_run(c, run, artifacts: Path, progress, runs: list[Path], cell_runs: dict, missing: list,
             shared_env: dict[str, str]) -> None:
    """One backend x matrix cell: its pytest subprocess (with ``shared_env``, what the command's runs
    share); appends to ``runs`` or ``missing``."""
    # lazy: bakeoff qualify answers bad input before these load (pydantic 0.1 s, the model resolvers 60 ms, the environments 20 ms)
    from bakeoff.analysis.matrix import baseline_cell
    from bakeoff.api.options import format_kv

    n, cell, t0 = run.backend, run.cell, time.monotonic()
    with tempfile.NamedTemporaryFile("r", suffix=".run", delete=False) as fh:
        run_file = fh.name
    # --opt=value: pytest's first parse does not know the plugin's options yet and would take a
    # separate value naming a folder for a test path, importing any conftest.py in it
    cmd, cwd = _pytest_cmd(f"--backend={n}", f"--model={c.model}", f"--artifacts={artifacts}",
                           f"--profile={c.profile}", f"--repeats={c.repeats}", f"--spec-starts={c.spec_starts}")
    cmd += [f"--backend-opt={format_kv(k, v)}" for k, v in run.options.items()]  # the one KEY=VALUE form: for the child
    if c.reference_model:
        cmd.append(f"--reference-model={c.reference_model}")
    cmd += [f"--reference-opt={format_kv(k, v)}" for k, v in c.reference_options.items()]
    if not c.preflight:
        cmd.append("--no-preflight")
    cmd += [f"--patch={p}" for p in c.patches]
    base = baseline_cell(cell, [r.cell for r in c.runs if r.backend == n])
    if base is not None and (n, base.label) in cell_runs:
        cmd.append(f"--baseline-run={cell_runs[(n, base.label)]}")
    elif base is not None:
        print(f"{n} [{cell.label}]: its twin cell [{base.label}] wrote no run; it is not judged against a twin", flush=True)
    env = dict(os.environ, **shared_env, BAKEOFF_RUN_FILE=run_file)
    label = _label(run)
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


def _resume(req, fail_on: frozenset[str]) -> int:
    """``bakeoff qualify --resume RUN_DIR``: finish a cut-off run (completed checks are kept),
    then re-write the report. The run's own backend, model and options apply: the resumed
    request is checked here as the evaluation will check it, before it starts."""
    # lazy: tests patch cli.progress.print_verdicts and bakeoff.reporting.report.write_report (read at call time); bakeoff qualify answers bad input before these load (pydantic 0.1 s, the model resolvers 60 ms, the environments 20 ms)
    from cli.progress import print_verdicts as _print_summary
    from bakeoff.host.artifacts import check_creatable
    from bakeoff.reporting.report import write_report
    run_req, _meta, _verdict = resume_request(req)
    c = check_request(run_req)
    run_dir = Path(run_req.resume).resolve()
    check_creatable(run_dir.parent.parent / "reports" / c.report, "report folder",
                    "make the run's artifacts folder writable, or copy the run into one that is")
    cmd, cwd = _pytest_cmd(f"--resume={run_dir}", f"--repeats={c.repeats}", f"--spec-starts={c.spec_starts}")
    print(f"resuming {run_dir.name}\n$ {' '.join(cmd)}", flush=True)
    proc = subprocess.run(cmd, cwd=cwd)
    if proc.returncode in (3, 4):
        raise UserError(f"could not resume {run_dir.name} (pytest exit {proc.returncode}; see the error above)")
    report = write_report([run_dir], run_dir.parent.parent / "reports" / c.report)
    outcomes = _print_summary([run_dir])
    print(f"\nreport: {report}")
    return _exit_code(outcomes, fail_on)
