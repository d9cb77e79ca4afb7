"""Verdict and checks: the contract every run ends in (docs/design.md "Verdict and evidence")."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any, Literal

from pydantic import Field

from bakeoff.api.specs import Spec

FAILURE_CLASSES: dict[str, str] = {
    "unavailable": "cannot run on this host (missing package, no GPU)",
    "unsupported-architecture": "the engine or exporter does not support the model's architecture",
    "config-rejected": "the engine's config reader refuses the checkpoint or an option",
    "export-defect": "an exported graph is invalid (checker, shape inference, wrong op types)",
    "load-failure": "the engine failed to load the model or start",
    "incompatible-features": "a combination of options the engine refuses",
    "runtime-crash": "the engine died while serving (segfault, OOM kill, CUDA error)",
    "hang": "no progress within a deadline",
    "garbage-output": "the output is not text or not the known answer",
    "accuracy-regression": "the output disagrees with the reference beyond tolerance",
    "slo-miss": "a latency or throughput objective was missed",
    "transport-distortion": "the stream was cut or distorted in transit",
    "protocol-violation": "the server broke the API's contract (a stream past bakeoff's size or time bounds)",
    "client-accounting": "client token counts disagree with the server's usage",
    "cache-correctness": "a prefix-cache hit changed the output",
    "ineffective-option": "an option was accepted but its measurable effect is absent",
}



def known_failure_class(name: str | None) -> str | None:
    """``name`` when it is one of :data:`FAILURE_CLASSES` (or None: no class).

    Called wherever a check is recorded (``bakeoff/host/run.py``), so that a class nobody
    defined (a typo, an engine's own word) fails the code that names it, at once, instead of
    landing in a verdict that CI gates and ``compare`` groups by class.

    Raises:
        ValueError: naming the unknown class and the known ones.
    """
    if name is not None and name not in FAILURE_CLASSES:
        raise ValueError(f"unknown failure class {name!r}; the classes are (bakeoff/api/verdict.py FAILURE_CLASSES): "
                         f"{', '.join(FAILURE_CLASSES)}")
    return name


# ``info``: a report-only check that measured what it names and judges nothing (e.g. the
# warm-up TTFT); shown as such, it neither qualifies nor disqualifies.
CheckStatus = Literal["pass", "fail", "error", "skip", "info"]
RunStatus = Literal["qualified", "disqualified", "unavailable", "incomplete"]


def utc_now() -> str:
    """ISO-8601 UTC timestamp with seconds, e.g. ``2026-11-30T05:40:12Z``."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class Check(Spec):
    """One check of a run.

    Attributes:
        name: dotted name, e.g. ``sanity.known_answers``.
        status: pass / fail / error / skip / info (report only: measured, judged nothing).
        failure_class: set when status is fail or error; one of ``FAILURE_CLASSES``.
        summary: one line a maintainer reads first.
        values: measured values; units are in the keys (``ttft_p50_ms``).
        evidence: paths of evidence files, relative to the run directory.
        started_at: UTC start time.
        duration_s: wall time of the check in seconds.
        required: whether the run cannot qualify without this check passing: true for
            :data:`REQUIRED_CHECKS` always, and set by a check that a verdict rests on in this run
            and could not verify it (the agreement with a reference that could not run): ended
            ``skip``, it makes the run ``incomplete``.
    """

    name: str
    status: CheckStatus
    failure_class: str | None = None
    summary: str = ""
    values: dict[str, Any] = Field(default_factory=dict)
    evidence: list[str] = Field(default_factory=list)
    started_at: str = Field(default_factory=utc_now)
    duration_s: float | None = None
    required: bool = False


class Verdict(Spec):
    """The per-run verdict written to ``verdict.json``.

    Attributes:
        run_id: the run directory name.
        backend: registry name.
        model: what the user passed (``fixture:tiny-qwen3``, a path, a hub id).
        model_path: the resolved path or hub id the engine loaded.
        options: backend options.
        profile: ``quick`` or ``full``.
        status: qualified / disqualified / unavailable / incomplete.
        reasons: why the status is not ``qualified`` (:func:`decide`): one line per failed check
            (``check: failure-class: summary``), the check a cut-off run stopped after, a required
            check skipped (with its reason) or not run.
        checks: every check, in the order run.
        backend_info: what the engine reported at start.
        fingerprint: environment fingerprint (secrets redacted).
        started_at / finished_at: UTC timestamps; ``finished_at`` is None while incomplete.
        left_out: the checks (or evaluation modules) the run's test selection left out and that
            had not run before (``-k``, ``-m``, ``--deselect``, ``--lf``, module paths): a partial
            run measures, it does not qualify (:func:`decide`).
    """

    schema_version: int = 1
    run_id: str
    backend: str
    model: str
    model_path: str | None = None
    options: dict[str, Any] = Field(default_factory=dict)
    profile: str = "quick"
    status: RunStatus = "incomplete"
    reasons: list[str] = Field(default_factory=list)
    checks: list[Check] = Field(default_factory=list)
    backend_info: dict[str, Any] | None = None
    fingerprint: dict[str, Any] = Field(default_factory=dict)
    started_at: str = Field(default_factory=utc_now)
    finished_at: str | None = None
    resumed: int = 0
    left_out: list[str] = Field(default_factory=list)


# A run qualifies only if these passed: a selection of modules that leaves them out (e.g.
# ``pytest evaluations/test_throughput.py``) measures, but does not qualify.
REQUIRED_CHECKS = ("load", "sanity.known_answers")
# Recorded as the session ends, whatever ran before (evaluations/plugin.py): no step of the run,
# so not the check a cut-off run stopped after.
SESSION_END_CHECKS = ("telemetry.gpu",)


def cut_off_reason(checks: list[Check]) -> str:
    """Why a run that did not finish is ``incomplete``: the last check it recorded before it stopped
    (``cut off after check sanity.tokenizer: the run did not finish``), or that none was."""
    steps = [c.name for c in checks if c.name not in SESSION_END_CHECKS]
    return (f"cut off after check {steps[-1]}" if steps else "cut off before its first check") + ": the run did not finish"


def _required_reason(name: str, checks: list[Check]) -> str:
    """Why a required check did not pass, in a run with no failure: skipped (its reason), did not run."""
    c = next((c for c in reversed(checks) if c.name == name), None)
    if c is None:
        return f"{name}: required to qualify, did not run"
    why = c.summary or "(no reason recorded)"
    return f"{name}: required to qualify, " + (f"skipped: {why}" if c.status == "skip" else f"ended {c.status}: {why}")


def left_out_reason(left_out: list[str]) -> str:
    """The reason a run whose selection left checks out is ``incomplete``."""
    shown = ", ".join(left_out[:6]) + (f" and {len(left_out) - 6} more" if len(left_out) > 6 else "")
    return (f"partial run: its test selection left out {shown} (-k, -m, --deselect, --lf or module paths); "
            "a partial run measures, it does not qualify: run the whole suite (or --resume without the filter)")


def _missing_required(checks: list[Check]) -> list[str]:
    """The required checks that did not pass (:data:`REQUIRED_CHECKS`, then those that marked
    themselves ``required``), each once, in that order."""
    passed = {c.name for c in checks if c.status == "pass"}
    return list(dict.fromkeys([name for name in REQUIRED_CHECKS if name not in passed] +
                              [c.name for c in checks if c.required and c.name not in passed]))


def decide(checks: list[Check], finished: bool, left_out: list[str] | tuple = ()) -> tuple[RunStatus, list[str]]:
    """Compute a run's status from its checks, and why.

    Rules: a run that did not finish is ``incomplete``; a run whose only failures are of
    class ``unavailable`` is ``unavailable``; any other failed or errored check makes it
    ``disqualified`` (a failure found by a partial run is still one); a run without a passed
    ``load`` and ``sanity.known_answers`` (and any check that marked itself ``required``), or whose
    selection left checks out, is ``incomplete``
    (it measured, it did not qualify); otherwise ``qualified`` (skips do not disqualify, they are
    reported).

    Args:
        checks: the run's checks, in the order recorded.
        finished: whether the run reached its end.
        left_out: :attr:`Verdict.left_out`.

    Returns:
        ``(status, reasons)``; every status but ``qualified`` has at least one reason: one line
        per failed check (``check: failure-class: summary``), for a run that did not finish first
        the check it was cut off after (:func:`cut_off_reason`), for a required check that did not
        pass its skip reason or that it did not run.
    """
    bad = [c for c in checks if c.status in ("fail", "error")]
    reasons = [f"{c.name}: {c.failure_class or 'error'}: {c.summary or '(no message recorded)'}" for c in bad]
    if not finished:
        return "incomplete", [cut_off_reason(checks), *reasons]
    if bad and all(c.failure_class == "unavailable" for c in bad):
        return "unavailable", reasons
    if bad:
        return "disqualified", reasons
    if not checks:
        return "incomplete", ["no check ran"]
    missing = _missing_required(checks)
    if missing or left_out:
        return "incomplete", [_required_reason(name, checks) for name in missing] + \
            ([left_out_reason(list(left_out))] if left_out else [])
    return "qualified", reasons
