"""Is this input acceptable? One answer for ``bakeoff qualify`` and ``pytest evaluations/``.

Both entry points turn their flags into a :class:`Request` (``None`` or empty: not given; the
defaults are :data:`DEFAULTS`, one table), and :func:`check_request` checks all of it before
anything is built or written: backend names, ``--backend-opt`` (parsed from ``KEY=VALUE`` once
and validated against each backend's pydantic ``Options`` once per matrix cell), ``--matrix``,
the profile, numeric bounds, patches, the models, the artifacts folder. It returns the parsed
values (:class:`Checked`). ``--resume`` takes the run's own settings (:func:`resume_request`,
with the run's options as parsed values, never re-written as ``KEY=VALUE``); a flag that would
choose them conflicts (:data:`RESUME_CONFLICTS`). Bad input is a one-line ``UserError``.

No pytest import here: ``bakeoff qualify`` answers bad input without loading it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

import backends
from bakeoff.api.errors import UserError

REPO = Path(__file__).resolve().parents[1]
CHECKOUT = (REPO / "pyproject.toml").is_file()  # else an installed wheel: REPO is site-packages

PROFILES: dict[str, dict[str, Any]] = {
    # quick: CI and `make qualify`; full: the usual serving sweep (1..32 sessions).
    # prefill budgets of the long-context checks (evaluations/sizing.py), unless given: quick keeps a slow
    # engine's three checks within about 45 s (SmolLM2-135M on 2 cores prefills 240-720 tok/s: at 30 s per
    # check they took 4.5 of a real-model qualification's 22 minutes, for checks that are report-only
    # there), full measures longer prompts; neither cuts a fixture's lengths (tests/test_prompt_sizing.py)
    "quick": {"sessions": [1, 2, 4, 8], "requests_per_session": 2, "max_tokens": 32, "warmup": 2,
              "prefill_budget_s": 5.0, "check_prefill_budget_s": 15.0},
    "full": {"sessions": [1, 2, 4, 8, 16, 32], "requests_per_session": 4, "max_tokens": 128, "warmup": 4,
             "prefill_budget_s": 30.0, "check_prefill_budget_s": 120.0},
}
DEFAULTS: dict[str, Any] = {
    "model": "fixture:tiny-qwen3",
    "profile": "quick",
    "artifacts": str(REPO / "artifacts") if CHECKOUT else "artifacts",  # installed: under the current folder
    "report": "latest",
    "repeats": 1,
    "spec_starts": 3,  # fresh engine starts of spec_decode.acceptance (evaluations/test_spec_decode.py)
    "start_timeout_s": 420.0,
    "progress_timeout_s": 120.0,
    # a request the launched engine computes without a byte ends (slo-miss, not hang) at this many
    # progress timeouts after its send (bakeoff/loadgen/progress.py)
    "request_deadline_factor": 5.0,
    # long-context checks (prefix cache, needles, agents) size prompts so that, at the engine's
    # measured prefill rate, each prompt prefills within prefill_budget_s and the check's prompts
    # together within check_prefill_budget_s (evaluations/sizing.py); unset: the profile's (PROFILES)
    "prefill_budget_s": None,
    "check_prefill_budget_s": None,
}
TUNING = ("request_deadline_factor", "prefill_budget_s", "check_prefill_budget_s")  # Request/Checked fields, DEFAULTS
DEFAULT_BACKENDS = {"qualify": backends.DEFAULT_QUALIFY, "pytest": ["transformers"]}
MAX_REPEATS = 100  # each repeat measures the whole sweep again: 100 is days on a real model
MAX_SPEC_STARTS = 20  # each is the engine's start again
MAX_SECONDS = 7 * 24 * 3600.0  # timeouts: a week
MAX_MEMORY_GIB = 1024.0**2  # --memory-limit-gib: a PiB

# (Request field, flag) that choose what a run is: --resume takes them from the run itself
RESUME_CONFLICTS = (("backends", "--backend"), ("model", "--model"), ("backend_opt", "--backend-opt"),
                    ("matrix", "--matrix"), ("profile", "--profile"), ("artifacts", "--artifacts"),
                    ("reference_model", "--reference-model"), ("reference_opt", "--reference-opt"),
                    ("patch", "--patch"), ("no_preflight", "--no-preflight"))


@dataclass
class Request:
    """What the user asked, as given (``None``, ``[]`` or ``False``: not given).

    ``options`` / ``reference_options`` are already parsed values (a resumed run's ``run.json``);
    when set they replace ``backend_opt`` / ``reference_opt``.
    """

    entry: Literal["qualify", "pytest"]
    backends: list[str] | None = None
    model: str | None = None
    backend_opt: list[str] = field(default_factory=list)
    matrix: list[str] = field(default_factory=list)
    profile: str | None = None
    artifacts: str | None = None
    report: str | None = None
    reference_model: str | None = None
    reference_opt: list[str] = field(default_factory=list)
    patch: list[str] = field(default_factory=list)
    no_preflight: bool = False
    repeats: int | None = None
    spec_starts: int | None = None
    resume: str | None = None
    start_timeout_s: float | None = None
    progress_timeout_s: float | None = None
    request_deadline_factor: float | None = None
    prefill_budget_s: float | None = None
    check_prefill_budget_s: float | None = None
    memory_limit_gib: float | None = None
    min_probe_accuracy: float | None = None
    baseline_run: str | None = None
    options: dict[str, Any] | None = None
    reference_options: dict[str, Any] | None = None


@dataclass
class Run:
    """One backend x matrix cell: what one evaluation session runs."""

    backend: str
    cell: Any  # bakeoff.analysis.matrix.Cell (pydantic: imported when options are checked, not before)
    options: dict[str, Any]


@dataclass
class Checked:
    """A request that passed :func:`check_request`: every default applied, every value parsed."""

    backends: list[str]
    runs: list[Run]  # baselines first (a quantized-KV cell after its auto twin)
    left_out: dict[str, list[str]]  # backend -> --matrix axes it has no option for
    model: str
    profile: str
    artifacts: Path
    report: str
    reference_model: str | None
    reference_options: dict[str, Any]
    patches: list[str]
    preflight: bool
    repeats: int
    spec_starts: int
    start_timeout_s: float
    progress_timeout_s: float
    memory_limit_gib: float | None
    min_probe_accuracy: float | None
    baseline_run: str | None
    request_deadline_factor: float = DEFAULTS["request_deadline_factor"]
    prefill_budget_s: float = PROFILES["quick"]["prefill_budget_s"]
    check_prefill_budget_s: float = PROFILES["quick"]["check_prefill_budget_s"]


def _flag(req: Request, name: str, flag: str) -> str:
    return "--backends" if name == "backends" and req.entry == "qualify" else flag


def given_with_resume(req: Request) -> list[str]:
    """The flags of ``req`` that ``--resume`` takes from the run (each one given is a conflict)."""
    return [_flag(req, name, flag) for name, flag in RESUME_CONFLICTS if getattr(req, name) not in (None, [], False)]


def resume_request(req: Request) -> tuple[Request, dict[str, Any], Any]:
    """The request a ``--resume RUN_DIR`` stands for: the run's own settings (parsed values) with
    this invocation's per-session flags.

    Returns:
        ``(request, run.json, verdict)`` (:func:`read_resumable`).

    Raises:
        UserError: an empty ``--resume``, a conflicting flag, or a run that cannot be resumed.
    """
    if not (req.resume or "").strip():
        raise UserError("--resume is empty; pass a cut-off run directory (artifacts/runs/<run id>)")
    given = given_with_resume(req)
    if given:
        raise UserError(f"--resume continues a run with its own settings; drop {', '.join(given)}")
    path = Path(req.resume).resolve()
    meta, verdict = read_resumable(path)
    keep = {f.name: getattr(req, f.name) for f in fields(Request)
            if f.name not in {n for n, _ in RESUME_CONFLICTS} | {"options", "reference_options"}}
    run = Request(**keep)
    run.backends = [meta["backend"]]
    run.model, run.profile, run.options = meta["model"], meta["profile"], dict(meta["options"])
    run.patch = list(meta.get("patches") or [])
    if meta.get("reference_reason") == "--reference-model":
        run.reference_model = meta.get("reference_model")
    run.reference_options = dict(meta.get("reference_options") or {})
    run.artifacts = str(path.parent.parent)
    return run, meta, verdict


def read_resumable(path: Path) -> tuple[dict[str, Any], Any]:
    """A cut-off run's ``run.json`` and :class:`~bakeoff.api.verdict.Verdict`, checked.

    Raises:
        UserError: unreadable (a file that is not a regular file, not JSON, nested too deep), not
            bakeoff's, finished, or not writable (one line each).
    """
    # lazy: bakeoff qualify answers bad input before these load (pydantic 0.1 s; the model resolvers 60 ms)
    from bakeoff.api.verdict import Verdict
    from bakeoff.host.artifacts import check_creatable, is_run_meta, read_json

    try:
        meta = read_json(path / "run.json")
        raw = read_json(path / "verdict.json")
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot resume {path}: not a readable run directory ({exc.__class__.__name__}: "
                        f"{' '.join(str(exc).split())[:100]}); pass a folder under artifacts/runs/ that holds run.json "
                        "and verdict.json") from None
    foreign = UserError(f"cannot resume {path}: run.json or verdict.json is not bakeoff's; pass a folder under "
                        "artifacts/runs/ written by bakeoff")
    if not is_run_meta(meta) or not isinstance(raw, dict) or not all(
            isinstance(meta.get(k), str) for k in ("backend", "model", "profile")):
        raise foreign
    if not isinstance(meta.get("patches") or [], list) or not isinstance(meta.get("reference_options") or {}, dict):
        raise foreign
    if not all(isinstance(x, str) for x in meta.get("patches") or []) or not isinstance(
            meta.get("reference_model") or "", str) or not isinstance(meta.get("options") or {}, dict):
        raise foreign  # a patch or a reference model that is not text (a census found ints: AttributeError)
    if raw.get("finished_at"):
        raise UserError(f"run {path.name} finished ({str(raw.get('status'))[:40]}); nothing to resume: start a new run")
    try:
        verdict = Verdict.model_validate(raw)
    except (ValueError, RecursionError):
        raise foreign from None
    check_creatable(path, "run directory", "resume a run in a folder you can write (copy it elsewhere first)")
    return meta, verdict


def check_options(req: Request, names: list[str]) -> tuple[list[Run], dict[str, list[str]], dict[str, Any]]:
    """``--backend-opt``, ``--matrix`` and ``--reference-opt`` of ``req`` for ``names``: parsed once,
    each backend x cell validated once against the backend's ``Options``.

    Returns:
        ``(runs, axes left out per backend, reference options)``.

    Raises:
        UserError: a malformed item, an unknown key or a bad value (naming the valid keys), a
            ``--matrix`` axis no backend has, an option set both ways.
    """
    # lazy: bakeoff qualify answers bad input before these load (pydantic 0.1 s; the model resolvers 60 ms)
    from bakeoff.analysis.matrix import baselines_first, cells_for, merge_options, parse_matrix, scoped_items
    from bakeoff.api.options import parse_options, split_backend_opts

    per = ({n: dict(req.options) for n in names} if req.options is not None
           else split_backend_opts(req.backend_opt, names))
    scoped = scoped_items(req.matrix, names)  # BACKEND:key=... axes for one backend
    shared = [i for i in req.matrix if ":" not in i.partition("=")[0]]
    runs: list[Run] = []
    left_out: dict[str, list[str]] = {}
    for n in names:
        cells = baselines_first(parse_matrix(scoped[n]))  # a quantized-KV cell is judged against its auto cell
        mine, left_out[n] = cells_for(cells, backends.resolve(n).Options.model_fields.__contains__)
        runs += [Run(n, cell, merge_options(per[n], cell)) for cell in mine]
        own = parse_matrix([i for i in scoped[n] if i not in shared])[0].choices
        for axis in own:
            if axis in left_out[n]:
                raise UserError(f"--matrix {n}:{axis} is not an option of {n}; check its spelling or drop the axis")
    for axis in parse_matrix(shared)[0].choices:
        if all(axis in left_out[n] for n in names):
            raise UserError(f"--matrix {axis} is an option of none of {', '.join(names)}; "
                            "check its spelling (a preset: speculative, prefix_cache) or drop the axis")
    for r in runs:
        parse_options(r.backend, backends.resolve(r.backend).Options, r.options)
    if req.reference_options is not None:
        ref = dict(req.reference_options)
    else:
        ref = split_backend_opts(req.reference_opt, ["transformers"], "--reference-opt", prefixes=False)["transformers"]
    parse_options("transformers", backends.resolve("transformers").Options, ref)
    return runs, left_out, ref


def _number(flag: str, value: float | int | None, low: float, high: float, what: str, low_open: bool = False) -> None:
    if value is None:
        return
    if not (isinstance(value, (int, float)) and math.isfinite(value)
            and (value > low if low_open else value >= low) and value <= high):
        raise UserError(f"{flag} must be {what}, got {value}")


def _backend_names(req: Request) -> list[str]:
    """The backends asked for (the entry's default when none), each known and named once.

    Raises:
        UserError: none named, one named twice, or one bakeoff does not know.
    """
    flag = _flag(req, "backends", "--backend")
    if req.backends is not None and not [b for b in req.backends if b.strip()]:
        raise UserError(f"{flag} names no backend; choose from: {', '.join(backends.names())}")
    names = [b.strip() for b in (req.backends or DEFAULT_BACKENDS[req.entry]) if b.strip()]
    if len(set(names)) != len(names):
        raise UserError(f"{flag} names a backend twice ({','.join(names)}); name each once")
    for n in names:
        backends.validate(n)
    return names


def _numbers(req: Request, profile: str) -> tuple[int, dict[str, float], dict[str, Any]]:
    """``(repeats, timeouts, tuning)``: the request's numbers with the profile's defaults, each in range.

    Raises:
        UserError: a number out of its range, in words that give the range.
    """
    repeats = DEFAULTS["repeats"] if req.repeats is None else req.repeats
    _number("--repeats", repeats, 1, MAX_REPEATS, f"at least 1 and at most {MAX_REPEATS} (a whole number)")
    _number("--spec-starts", DEFAULTS["spec_starts"] if req.spec_starts is None else req.spec_starts, 1, MAX_SPEC_STARTS,
            f"at least 1 and at most {MAX_SPEC_STARTS} (a whole number)")
    timeouts = {k: DEFAULTS[k] if getattr(req, k) is None else getattr(req, k) for k in ("start_timeout_s", "progress_timeout_s")}
    for k, fl in (("start_timeout_s", "--start-timeout"), ("progress_timeout_s", "--progress-timeout")):
        _number(fl, timeouts[k], 0, MAX_SECONDS, f"a positive number of seconds up to {MAX_SECONDS:.0f}", low_open=True)
    tuning = {k: (DEFAULTS[k] if DEFAULTS[k] is not None else PROFILES[profile][k]) if getattr(req, k) is None
              else getattr(req, k) for k in TUNING}
    _number("--request-deadline-factor", tuning["request_deadline_factor"], 1, 1000, "a number of progress timeouts "
            "from 1 to 1000")
    for k, fl in (("prefill_budget_s", "--prefill-budget"), ("check_prefill_budget_s", "--check-prefill-budget")):
        _number(fl, tuning[k], 0, MAX_SECONDS, f"a positive number of seconds up to {MAX_SECONDS:.0f}", low_open=True)
    _number("--memory-limit-gib", req.memory_limit_gib, 0, MAX_MEMORY_GIB, "a positive number of GiB", low_open=True)
    _number("--min-probe-accuracy", req.min_probe_accuracy, 0, 1, "between 0 and 1")
    return repeats, timeouts, tuning


def _check_reference(req: Request, check_model, resolve) -> None:
    """``--reference-model``: not empty; for ``bakeoff qualify`` built already (each backend's
    session would build it), else a model bakeoff can resolve.

    Raises:
        UserError: it is empty or cannot be resolved.
    """
    if not req.reference_model.strip():
        raise UserError("--reference-model is empty; pass a checkpoint folder, a hub id (org/name) or fixture:NAME")
    if req.entry == "qualify":
        resolve(req.reference_model, build=False)
    else:
        check_model(req.reference_model)


def check_request(req: Request) -> Checked:
    """Check everything ``req`` asks before anything is built or written (issue 15).

    Returns:
        The request with defaults applied and every value parsed.

    Raises:
        UserError: one line naming the fix.
    """
    # lazy: bakeoff qualify answers bad input before these load (pydantic 0.1 s; the model resolvers 60 ms)
    from bakeoff.host.envs import mode as envs_mode

    envs_mode()  # a BAKEOFF_ENVS bakeoff does not know is refused before any work
    names = _backend_names(req)
    profile = DEFAULTS["profile"] if req.profile is None else req.profile
    if profile not in PROFILES:
        raise UserError(f"unknown profile {profile!r}; choose one of: {', '.join(PROFILES)}")
    repeats, timeouts, tuning = _numbers(req, profile)
    model = DEFAULTS["model"] if req.model is None else req.model
    if not model.strip():
        raise UserError("--model is empty; pass a checkpoint folder, a hub id (org/name) or fixture:NAME")
    artifacts = DEFAULTS["artifacts"] if req.artifacts is None else req.artifacts
    if not str(artifacts).strip():
        raise UserError("--artifacts is empty; pass the folder runs and reports go to (default: artifacts)")
    # lazy: bakeoff qualify answers bad input before these load (pydantic 0.1 s; the model resolvers 60 ms)
    from bakeoff.host.artifacts import check_artifacts, plain_name

    report = plain_name(DEFAULTS["report"] if req.report is None else req.report, "--report")
    runs, left_out, ref_options = check_options(req, names)  # pydantic and the backends' modules from here on
    # lazy: bakeoff qualify answers bad input before these load (pydantic 0.1 s; the model resolvers 60 ms)
    from bakeoff.models.resolve import check as check_model
    from bakeoff.models.resolve import resolve
    from evaluations.patching import check as check_patches

    check_patches(req.patch)  # a malformed --patch: one line, before any build
    check_model(model)  # known fixture, readable checkpoint; a fixture cache that takes a build
    if req.reference_model is not None:
        _check_reference(req, check_model, resolve)
    _outside_models(Path(artifacts), [model, req.reference_model])
    check_artifacts(Path(artifacts), report if req.entry == "qualify" else None)  # creates nothing
    if req.baseline_run is not None:  # a readable run, checked before anything is written
        # lazy: bakeoff qualify answers bad input before these load (pydantic 0.1 s; the model resolvers 60 ms)
        from bakeoff.analysis.matrix import load_baseline

        load_baseline(Path(req.baseline_run))
    return Checked(backends=names, runs=runs, left_out=left_out, model=model, profile=profile,
                   artifacts=Path(artifacts), report=report, reference_model=req.reference_model,
                   reference_options=ref_options, patches=list(req.patch), preflight=not req.no_preflight,
                   repeats=repeats, spec_starts=DEFAULTS["spec_starts"] if req.spec_starts is None else req.spec_starts,
                   start_timeout_s=timeouts["start_timeout_s"],
                   progress_timeout_s=timeouts["progress_timeout_s"], memory_limit_gib=req.memory_limit_gib,
                   min_probe_accuracy=req.min_probe_accuracy, baseline_run=req.baseline_run, **tuning)


def _outside_models(artifacts: Path, models: list[str | None]) -> None:
    """Runs are never written into a checkpoint: ``--artifacts`` inside a local model folder (or
    the fixture cache) is refused.

    Raises:
        UserError: naming the folder it is inside.
    """
    # lazy: bakeoff qualify answers bad input before these load (pydantic 0.1 s; the model resolvers 60 ms)
    from bakeoff.models import fixtures

    where = Path(artifacts).expanduser().resolve()
    homes = [Path(m).expanduser() for m in models if m and not m.startswith("fixture:") and Path(m).expanduser().is_dir()]
    if any(m and m.startswith("fixture:") for m in models):
        homes.append(fixtures.cache_root())
    # lazy: bakeoff qualify answers bad input before these load (pydantic 0.1 s; the model resolvers 60 ms)
    from bakeoff.models import packaged
    from bakeoff.models.resolve import packaged_name

    if any(m and packaged_name(m) for m in models):
        homes.append(packaged.cache_root())
    for home in homes:
        home = home.resolve()
        if where == home or home in where.parents:
            raise UserError(f"--artifacts {artifacts} is inside the model folder {home}; runs are never written into a "
                            "checkpoint: pass --artifacts DIR outside it")
