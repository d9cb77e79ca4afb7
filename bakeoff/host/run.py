"""A run in progress: its directory, its checks as they finish, and its verdict.

``verdict.json`` is rewritten (atomically) after every check with status ``incomplete``, so
a run cut off at any point leaves a valid verdict holding everything measured so far; the
final status is set by :meth:`RunContext.finish`.
"""

from __future__ import annotations

import time
import traceback
from typing import Any

from bakeoff.host.artifacts import RunDir
from bakeoff.api.errors import EngineFailure
from bakeoff.api.verdict import REQUIRED_CHECKS, Check, Verdict, decide, known_failure_class, utc_now


class CheckFailed(Exception):
    """Raised inside a check scope to fail the check with a failure class."""

    def __init__(self, failure_class: str, summary: str):
        super().__init__(f"{failure_class}: {summary}")
        self.failure_class = known_failure_class(failure_class)
        self.summary = summary


class CheckSkipped(Exception):
    """Raised inside a check scope to record a skip with its reason."""


class CheckScope:
    """Collects one check's values and evidence; used as ``with run.check(...) as c``.

    Args:
        run: the run.
        name: check name (``sanity.known_answers``).
        failure_class: the class used by :meth:`require` / :meth:`fail` by default.
    """

    def __init__(self, run: "RunContext", name: str, failure_class: str):
        self.run = run
        self.name = name
        self.failure_class = known_failure_class(failure_class)
        self.values: dict[str, Any] = {}
        self.evidence_paths: list[str] = []
        self.summary = ""
        self.t0 = time.monotonic()
        self.started_at = utc_now()

    def evidence(self, name: str, content: Any) -> str:
        """Write an evidence file now (kept even if the check later crashes)."""
        rel = self.run.dir.evidence(self.name, name, content)
        if rel not in self.evidence_paths:
            self.evidence_paths.append(rel)
        return rel

    def fail(self, summary: str, failure_class: str | None = None) -> None:
        raise CheckFailed(failure_class or self.failure_class, summary)

    def require(self, condition: bool, summary: str, failure_class: str | None = None) -> None:
        """Fail the check with ``summary`` unless ``condition`` holds."""
        if not condition:
            self.fail(summary, failure_class)

    def skip(self, reason: str, required: bool = False) -> None:
        """End the check as ``skip``; ``required``: the verdict rests on what it could not verify, so
        the run cannot qualify (:attr:`bakeoff.api.verdict.Check.required`)."""
        self.required = required
        raise CheckSkipped(reason)

    def report_only(self, summary: str) -> None:
        """End the check as ``info``: it measured what it names (its values are kept) and
        judges nothing, so it must not read ``pass``."""
        self.summary = summary
        self.informational = True

    def __enter__(self) -> "CheckScope":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc is not None and not isinstance(exc, Exception):
            return False  # Ctrl-C / SIGTERM: the check did not complete; a resumed run redoes it
        status, fclass, summary = "pass", None, self.summary or "ok"
        if exc is None and getattr(self, "informational", False):
            status = "info"
        if isinstance(exc, CheckFailed):
            status, fclass, summary = "fail", exc.failure_class, exc.summary
        elif isinstance(exc, CheckSkipped):
            status, summary = "skip", str(exc)
        elif isinstance(exc, EngineFailure):
            status, fclass, summary = "fail", exc.failure_class, exc.message
            for fname, text in exc.evidence.items():
                self.evidence(fname, text)
            self.evidence("exception.txt", "".join(traceback.format_exception(exc_type, exc, tb)))
        elif exc is not None:
            status, summary = "error", f"{exc_type.__name__}: {exc}"
            self.evidence("traceback.txt", "".join(traceback.format_exception(exc_type, exc, tb)))
        self.run.record(Check(name=self.name, status=status, failure_class=fclass, summary=summary[:500],
                              values=self.values, evidence=self.evidence_paths, started_at=self.started_at,
                              duration_s=round(time.monotonic() - self.t0, 3),
                              required=getattr(self, "required", False) or self.name in REQUIRED_CHECKS))
        return False  # the plugin turns CheckFailed/CheckSkipped into pytest outcomes


class RunContext:
    """One run: directory + verdict, updated check by check.

    Args:
        rundir: the run directory (already created).
        verdict: the initial verdict (status ``incomplete``).
    """

    def __init__(self, rundir: RunDir, verdict: Verdict):
        self.dir = rundir
        self.verdict = verdict
        self.save()

    def check(self, name: str, failure_class: str = "garbage-output") -> CheckScope:
        """Open a check scope (see :class:`CheckScope`)."""
        return CheckScope(self, name, failure_class)

    def record(self, check: Check) -> None:
        """Add or replace a check, write ``checks/<name>.json`` and the verdict.

        Raises:
            ValueError: the check's failure class is not one of ``FAILURE_CLASSES`` (nothing
                is written).
        """
        known_failure_class(check.failure_class)
        self.verdict.checks = [c for c in self.verdict.checks if c.name != check.name] + [check]
        self.dir.write_json(f"checks/{check.name}.json", check.model_dump())
        self.save()

    def get(self, name: str) -> Check | None:
        return next((c for c in self.verdict.checks if c.name == name), None)

    def save(self) -> None:
        status, reasons = decide(self.verdict.checks, finished=self.verdict.finished_at is not None,
                                 left_out=self.verdict.left_out)
        self.verdict.status, self.verdict.reasons = status, reasons
        self.dir.write_json("verdict.json", self.verdict.model_dump())

    def finish(self, finished: bool = True) -> Verdict:
        """Set the final status (``incomplete`` when not finished) and write the verdict."""
        if finished:
            self.verdict.finished_at = utc_now()
        self.save()
        return self.verdict
