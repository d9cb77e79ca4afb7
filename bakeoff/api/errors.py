"""Errors that carry a failure class and evidence (docs/design.md "Verdict and evidence")."""

from __future__ import annotations


class UserError(Exception):
    """Bad input from the user: reported as one line that says what to do, exit code 2."""


def one_line(text: str, limit: int = 2000) -> str:
    """``text`` as one printable line: a newline, tab or other control character a user put into a
    value is shown escaped (``\\n``), so that an error stays the one line it promises; long text
    is cut at ``limit`` characters."""
    out = "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii") for ch in text)
    return out if len(out) <= limit else out[:limit] + "..."


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
