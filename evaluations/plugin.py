"""The evaluations plugin: pytest hooks and fixtures (options, run directory, the engine under test,
the verdict). The session's state and validation live in ``evaluations/session.py``."""

from __future__ import annotations

import os
import re
import sys
import traceback
from pathlib import Path

import pytest

from bakeoff.host.artifacts import RunDir
from bakeoff.api.errors import EngineFailure, UserError, one_line
from bakeoff.host.fingerprint import fingerprint
from bakeoff.host.run import CheckFailed, CheckSkipped, RunContext
from bakeoff.api.specs import BackendConfig
from bakeoff.api.verdict import Check, Verdict
from evaluations.inputs import check_request, resume_request
from evaluations.session import (KEY_ENGINE, KEY_INTERRUPTED, KEY_RUN, KEY_SETTINGS, KEY_TELEMETRY, MODULE_ORDER,
                                 RELEVANT_PACKAGES, Settings, add_options, load_resume, request_from, settings_from)
from backends import preflight
from evaluations import patching
from bakeoff.analysis.cuda_errors import classify
from bakeoff.host import procs
from bakeoff.host.envs import freeze
from evaluations.gpu_telemetry import record_telemetry, start_telemetry
from evaluations.reference import is_reference_run, reference_options
from evaluations.selection import left_out, refuse_split


def pytest_addoption(parser: pytest.Parser) -> None:
    add_options(parser)


EVALUATIONS_DIR = Path(__file__).resolve().parent


def targets_evaluations(config: pytest.Config) -> bool:
    """Whether this session collects the evaluations suite: an argument names ``evaluations``
    (``--pyargs evaluations[.test_x]``) or a path in, or above, its folder. Installed, the
    plugin is loaded into every pytest session of the environment (its pytest11 entry point);
    in any other session (a project's own tests) it adds its options and does nothing else."""
    for arg in config.args:
        arg = arg.split("::")[0]
        if config.option.pyargs and (arg == "evaluations" or arg.startswith("evaluations.")):
            return True
        path = (config.invocation_params.dir / arg).resolve()
        if path == EVALUATIONS_DIR or EVALUATIONS_DIR in path.parents or path in EVALUATIONS_DIR.parents:
            return True
    return False


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "check(name): the verdict check this test records")
    if not hasattr(config.option, "backend") or config.option.help or not targets_evaluations(config):
        return
    try:
        refuse_split(config)
        if config.option.collectonly:  # bad input is refused while collecting too; nothing is built or written
            request = request_from(config)
            check_request(resume_request(request)[0] if config.getoption("--resume") is not None else request)
            return
        if config.getoption("--resume") is not None:
            rundir, verdict, s = load_resume(config)
        else:
            s = settings_from(config)
            rundir = RunDir.create(s.artifacts, s.backend, s.model.label)
            verdict = None
    except UserError as exc:
        raise pytest.UsageError(one_line(str(exc))) from None
    # SIGTERM ends the session like Ctrl-C (engines stopped, verdict incomplete); either is remembered
    procs.sigterm_as_interrupt(lambda: config.stash.__setitem__(KEY_INTERRUPTED, True))
    config.stash[KEY_TELEMETRY] = start_telemetry(rundir)
    if verdict is not None:
        config.stash[KEY_SETTINGS] = s
        config.stash[KEY_RUN] = RunContext(rundir, verdict)
        config.stash[KEY_ENGINE] = {}
        return
    verdict = Verdict(run_id=rundir.run_id, backend=s.backend, model=s.model.label, model_path=s.model.path,
                      options=s.options, profile=s.profile, fingerprint=fingerprint(argv=sys.argv, fixture=_fixture_facts(s.model),
                                                                       packaged=_packaged_facts(s.model)))
    rundir.write_json("run.json", {"run_id": rundir.run_id, "backend": s.backend, "model": s.model.label,
                                   "model_path": s.model.path, "options": s.options, "profile": s.profile,
                                   "profile_settings": s.profile_cfg, "reference_model": s.reference_model.label,
                                   "reference_reason": s.reference_reason, "reference_options": s.reference_options,
                                   "reference_options_resolved": reference_options(s),
                                   "patches": s.patches, "source_model_path": s.source_model.path if s.source_model else None,
                                   "command": sys.argv, "cwd": os.getcwd()})
    config.stash[KEY_SETTINGS] = s
    config.stash[KEY_RUN] = RunContext(rundir, verdict)
    if os.environ.get("BAKEOFF_RUN_FILE"):  # tells `bakeoff qualify` where this run is
        Path(os.environ["BAKEOFF_RUN_FILE"]).write_text(str(rundir.path.resolve()))
    config.stash[KEY_ENGINE] = {}


def _fixture_facts(model) -> dict | None:
    """A fixture's provenance for the fingerprint (shipped or trained here, its fixture hash)."""
    if not model.fixture:
        return None
    # lazy: the pytest plugin loads in every pytest session of this venv (its pytest11 entry point); kept light (bakeoff.models.fixtures 60 ms)
    from bakeoff.models.fixtures import provenance

    return provenance(model.path)


def _packaged_facts(model) -> dict | None:
    """A packaged model's provenance for the fingerprint (package, version, sha256s, converter)."""
    if not model.packaged:
        return None
    # lazy: the pytest plugin loads in every pytest session of this venv (its pytest11 entry point); kept light (bakeoff.models.packaged 65 ms)
    from bakeoff.models.packaged import provenance

    return provenance(model.path)


def pytest_keyboard_interrupt(excinfo) -> None:
    """Ctrl-C is being handled (engines stopped, the verdict written): a SIGTERM that follows it
    (``bakeoff qualify`` passes one on when the child has not stopped) is ignored, not raised
    inside that teardown."""
    procs.ignore_sigterm()


def pytest_report_header(config: pytest.Config) -> list[str]:
    run = config.stash.get(KEY_RUN, None)
    return [f"bakeoff run: {run.dir.path}"] if run else []


def pytest_collection_modifyitems(session, config, items) -> None:
    if not targets_evaluations(config):
        return

    def key(item):
        mod = item.module.__name__.rsplit(".", 1)[-1] if item.module else ""
        # a module not listed runs before the judge, which stops the engine
        return MODULE_ORDER.index(mod) if mod in MODULE_ORDER else MODULE_ORDER.index("test_judge") - 0.5
    items.sort(key=key)
    run = config.stash.get(KEY_RUN, None)
    if run is not None and config.getoption("--resume"):
        for item in items:
            marker = item.get_closest_marker("check")
            done = run.get(marker.args[0]) if marker else None
            if done is not None:
                item.add_marker(pytest.mark.skip(reason=f"completed before the resume: {done.status}"))


def pytest_collection_finish(session) -> None:
    """The checks this session's selection leaves out (:mod:`evaluations.selection`), recorded
    before the first check runs."""
    run = session.config.stash.get(KEY_RUN, None)
    if run is not None and targets_evaluations(session.config):
        run.verdict.left_out = left_out(MODULE_ORDER, session.items, {c.name for c in run.verdict.checks})
        run.save()


@pytest.hookimpl(wrapper=True)
def pytest_pyfunc_call(pyfuncitem):
    outcome = None
    try:
        return (yield)
    except CheckSkipped as exc:
        outcome = ("skip", str(exc))
    except CheckFailed as exc:
        outcome = ("fail", str(exc))
    except EngineFailure as exc:
        outcome = ("fail", f"{exc.failure_class}: {exc.message}")
    if outcome[0] == "skip":
        pytest.skip(outcome[1])
    pytest.fail(outcome[1], pytrace=False)


def pytest_sessionfinish(session: pytest.Session, exitstatus) -> None:
    config = session.config
    run = config.stash.get(KEY_RUN, None)
    if run is None:
        return
    state = config.stash[KEY_ENGINE]
    backend = state.get("backend")
    if backend is not None:
        backend.stop()
    interrupted = (exitstatus in (pytest.ExitCode.INTERRUPTED, pytest.ExitCode.INTERNAL_ERROR) or session.shouldstop
                   or config.stash.get(KEY_INTERRUPTED, False))
    tr = config.pluginmanager.get_plugin("terminalreporter")
    try:
        record_telemetry(config, run)
        verdict = run.finish(finished=not interrupted and bool(run.verdict.checks))
    except OSError as exc:  # disk full, folder gone: atomic writes left the earlier files whole
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        msg = (f"bakeoff: error: cannot write to the run directory {run.dir.path}: {exc.strerror or exc}; the files "
               "written before are intact (verdict.json holds the checks recorded so far); free space or pass --artifacts DIR")
        if tr is not None:
            tr.ensure_newline()
            tr.write_line(msg, red=True)
        else:
            print(msg, file=sys.stderr)
        return
    line = f"bakeoff verdict: {verdict.status} ({verdict.backend} on {verdict.model}) -> {run.dir.path}/verdict.json"
    if config.getoption("--backend", None) is None and not config.getoption("--resume", None):
        line += f"\n  ({verdict.backend}: no --backend was given, so the default; pass --backend NAME to qualify another)"
    if tr is not None:
        tr.write_line(line)
        for r in verdict.reasons:
            tr.write_line(f"  - {r}")


# ---- fixtures ------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def settings(pytestconfig) -> Settings:
    if KEY_SETTINGS not in pytestconfig.stash:
        pytest.skip("bakeoff plugin not configured (run pytest evaluations/ --backend NAME)")
    return pytestconfig.stash[KEY_SETTINGS]


@pytest.fixture(scope="session")
def run(pytestconfig, settings) -> RunContext:
    return pytestconfig.stash[KEY_RUN]


@pytest.fixture(scope="session")
def engine_state(request, pytestconfig, settings, run) -> dict:
    """Starts the backend under test once; its start is the ``load`` check."""
    state = pytestconfig.stash[KEY_ENGINE]
    if "backend" not in state:
        cfg = BackendConfig(backend=settings.backend, model=settings.model.path, model_label=settings.model.label,
                            options=settings.options, workdir=str(run.dir.path / "engine"),
                            start_timeout_s=settings.start_timeout_s, progress_timeout_s=settings.progress_timeout_s,
                            request_deadline_factor=settings.request_deadline_factor,
                            memory_limit_gib=settings.memory_limit_gib)
        backend = settings.backend_cls(cfg)
        state["backend"] = backend
        probe_failure, prediction = None, None
        try:  # a server that is not there (a dead port) is told at once, before any reference work
            backend.probe()
            prediction = _predict(settings)  # so is a refusal the pre-flight predicts
        except Exception as exc:  # noqa: BLE001 - the load check below records it as a start failure
            probe_failure = exc
        refused = prediction is not None and prediction.accepted is False and settings.preflight
        if probe_failure is None and not refused and not backend.attaches and not is_reference_run(settings):
            request.getfixturevalue("reference")  # the reference runs first, alone
        with _quiet(run.check("load", "load-failure")) as c:
            try:
                _preflight(settings, c, prediction)
                if probe_failure is not None:
                    raise probe_failure
                info = backend.start()
            except (CheckFailed, CheckSkipped):
                raise
            except Exception as exc:  # noqa: BLE001 - any start error is the load's failure, never a half-started engine
                raise _start_failure(exc, state, backend, settings.backend) from None
            state["info"] = info
            run.verdict.backend_info = info.model_dump()
            run.verdict.fingerprint["engine_versions"] = _versions(backend)
            _record_load(c, info, backend)
    return state


def _start_failure(exc: Exception, state: dict, backend, name: str) -> EngineFailure:
    """A failed start as the ``load`` check's failure (an exception that is not an
    :class:`EngineFailure` is a ``load-failure`` with its traceback), the engine's log tail in its
    evidence; the backend is stopped and ``state["error"]`` says why, for the checks after it."""
    if not isinstance(exc, EngineFailure):
        exc = EngineFailure("load-failure", f"{type(exc).__name__} while starting {name}: {exc}",
                            {"traceback.txt": traceback.format_exc()})
    state["error"] = f"{exc.failure_class}: {exc.message}"
    if "engine.log.tail" not in exc.evidence:
        exc.evidence["engine.log.tail"] = backend.log_tail(120)
    backend.stop()
    return exc


def _record_load(c, info, backend) -> None:
    """The started engine in the ``load`` check: its figures, info and log tail, and a summary that
    names a server bakeoff attached to, a patched checkpoint, pre-flight warnings and fallbacks."""
    c.values.update({"startup_s": info.startup_s, "kv_cache_tokens": info.kv_cache_tokens,
                     "max_concurrency": info.max_concurrency, "max_model_len": info.max_model_len,
                     "engine_version": info.engine_version, "device": info.device})
    c.evidence("backend_info.json", info.model_dump())
    c.evidence("engine.log.tail", backend.log_tail(200))
    c.summary = (f"attached to {info.engine} {info.engine_version or ''} at {info.base_url} in {info.startup_s} s "
                 "(a server bakeoff did not start)" if info.device == "remote" else
                 f"{info.engine} {info.engine_version or ''} started in {info.startup_s} s").replace("  ", " ")
    if c.values.get("patches"):  # what was changed in the checkpoint, and what pre-flight warns of
        c.summary += f"; on a patched checkpoint ({', '.join(c.values['patches'])})"
    for warning in (c.values.get("preflight") or {}).get("warnings") or []:
        c.summary += f"; pre-flight warning: {warning[:300]}"
    if info.fallbacks:  # what bakeoff changed to get the engine serving is read first, not buried
        c.values["fallbacks"] = info.fallbacks
        c.summary += "; " + "; ".join(f"{k}: {v}" for k, v in info.fallbacks.items())


@pytest.fixture(scope="session")
def engine(engine_state):
    """The started backend; when its start failed, the check asking for it is a skip that
    names the load failure (recorded in the verdict by ``pytest_runtest_makereport``)."""
    if "error" in engine_state:
        pytest.skip(f"backend did not load ({engine_state['error']})")
    if "stopped" in engine_state:
        pytest.skip(engine_state["stopped"])
    return engine_state["backend"]


@pytest.fixture(scope="session")
def prompt_calibration(engine, settings):
    """Tokens per haystack unit and the engine's prefill rate, measured once for the long-context
    checks (:func:`evaluations.measuring.calibrate`; their lengths: ``evaluations/sizing.py``)."""
    # lazy: the pytest plugin loads in every pytest session of this venv (its pytest11 entry point); kept light (evaluations.measuring: the load generator, numpy)
    from evaluations.measuring import calibrate, is_fixture

    return calibrate(engine, is_fixture(settings))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    marker = item.get_closest_marker("check")
    run = item.config.stash.get(KEY_RUN, None)
    if marker and run is not None and call.when == "setup" and (report.skipped or report.failed):
        name = marker.args[0]
        if run.get(name) is None and report.skipped:
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            run.record(Check(name=name, status="skip", summary=str(reason).removeprefix("Skipped: ")[:500]))
        elif run.get(name) is None and call.excinfo is not None and isinstance(call.excinfo.value, Exception):
            # a fixture of bakeoff's that raised (census 5.11: a read-only cache) is not the engine's
            # fault: the check did not run, and the run cannot qualify on it (incomplete, with the reason)
            exc = call.excinfo.value
            if isinstance(exc, EngineFailure):  # the engine failed while a fixture drove it: its failure, classed
                run.record(Check(name=name, status="fail", failure_class=exc.failure_class, summary=exc.message[:500]))
            else:
                run.record(Check(name=name, status="skip", required=True,
                                 summary=f"not run: bakeoff's setup of it failed: {type(exc).__name__}: {exc}"[:500]))
    return report


def _predict(settings: Settings):
    """The pre-flight's prediction for a local checkpoint (None for a hub id)."""
    return preflight(settings.model.path, settings.backend, options=settings.options) if settings.model.local else None


def _preflight(settings: Settings, scope, result=None) -> None:
    """Predict from config.json whether the engine's loader accepts this checkpoint
    (bakeoff.analysis.preflight, rules cite the engine's documented support). A predicted refusal ends
    the load check before minutes are spent launching (and before the reference is computed:
    ``result`` is the prediction made then); ``--no-preflight`` lets the engine decide (the
    prediction is still recorded as evidence)."""
    if not settings.model.local:
        return
    if settings.patched is not None:  # the source's finding and the patches, beside the patched copy's prediction
        patching.record(scope, settings.source_model, settings.patched, settings.backend, settings.options)
    result = result or _predict(settings)
    scope.values["preflight"] = {"accepted": result.accepted, "reason": result.reason, "enforced": settings.preflight,
                                 "warnings": result.warnings, "suggested_patches": result.suggested_patches}
    scope.evidence("preflight.json", result.model_dump())
    if result.accepted is False and settings.preflight:
        raise EngineFailure(result.failure_class or "config-rejected", f"preflight: {result.reason} "
                            f"(source: {result.rule_source}; --no-preflight lets the engine decide)")


class _quiet:
    """Run a check scope but swallow its failure (the load check's outcome is reported by
    ``test_load``; fixtures must not error)."""

    def __init__(self, scope):
        self.scope = scope

    def __enter__(self):
        return self.scope.__enter__()

    def __exit__(self, *exc):
        self.scope.__exit__(*exc)
        return exc[0] is not None and issubclass(exc[0], Exception)


def _versions(backend) -> dict[str, str]:
    python = backend.env_python or sys.executable

    allv = freeze(python)  # names as each distribution spells them (openvino_genai or openvino-genai): PEP 503 form
    return {k: v for k, v in allv.items() if re.sub(r"[-_.]+", "-", k).lower() in RELEVANT_PACKAGES}


def attach_engine_evidence(scope, engine, failure_class: str | None) -> None:
    """Write what a maintainer needs when requests failed: the engine log tail, and for a
    ``hang`` the stacks of every thread of the engine's processes (py-spy)."""
    tail = engine.log_tail(150)
    scope.evidence("engine.log.tail", tail)

    cuda = classify("\n".join(scope.values.get("first_errors") or []) + "\n" + tail)
    if cuda is not None:  # OOM, illegal access, NCCL...: the line is the evidence (bakeoff/analysis/cuda_errors.py)
        scope.evidence("cuda_error.json", cuda.model_dump())
        scope.values["cuda_error"] = cuda.kind
    proc = engine.proc
    if failure_class == "hang" and proc is not None:
        scope.evidence("stacks.txt", proc.dump_stacks())
