"""Errors that carry a failure class and evidence (docs/design.md "Verdict and evidence")."""

from __future__ import annotations


class UserError(Exception):
    """Bad input from the user: reported as one line that says what to do, exit code 2."""


class EngineFailure(Exception):
    """An engine failed in a way that becomes a failed check, never a crash of the suite.

    Args:
        failure_class: one of ``bakeoff.api.verdict.FAILURE_CLASSES``.
        message: one line, the engine's own words where there are any.
        evidence: extra evidence as ``{file name: text}``; written under the check's
            evidence folder (log tails, tracebacks, commands).
    """

    def __init__(self, failure_class: str, message: str, evidence: dict[str, str] | None = None):
        super().__init__(message)
        self.failure_class = failure_class
        self.message = message
        self.evidence = dict(evidence or {})
