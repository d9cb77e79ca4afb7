"""``bakeoff qualify --fail-on STATUS``: the exit code a CI job gates on (docs/concepts/ci-gating.md).

| code | meaning |
|---|---|
| 0 | every backend wrote a run and no run's status is named by ``--fail-on`` (without it: whatever the verdicts) |
| 1 | at least one run's status is named by ``--fail-on``; stderr names each such run |
| 2 | bad input: one line naming the fix, nothing run |
| 3 | no backend's evaluation started (each pytest ended with a usage or internal error), no run written |
| 130 | interrupted; the runs written so far are kept (their verdicts say ``incomplete``) |

A backend whose evaluation wrote no run (while others did) counts as ``incomplete``.
"""

from __future__ import annotations

from bakeoff.api.errors import UserError

EXIT_OK = 0
EXIT_FAILED_GATE = 1
EXIT_BAD_INPUT = 2
EXIT_NO_RUN = 3
EXIT_INTERRUPTED = 130
GATE_STATUSES = ("disqualified", "incomplete", "unavailable")


def parse_fail_on(values: list[str]) -> frozenset[str]:
    """``--fail-on`` values (repeatable, each may be comma-separated) as a set of statuses.

    Raises:
        UserError: a status that is not one of :data:`GATE_STATUSES`.
    """
    out = set()
    for value in values:
        for status in (s.strip() for s in value.split(",")):
            if status not in GATE_STATUSES:
                raise UserError(f"--fail-on {status!r} is not a verdict status to fail on; choose from: "
                                f"{', '.join(GATE_STATUSES)} (repeat the option for several)")
            out.add(status)
    return frozenset(out)


def gate(outcomes: list[tuple[str, str, str]], fail_on: frozenset[str]) -> tuple[int, list[str]]:
    """The exit code and one line per run that fails the gate.

    Args:
        outcomes: ``(label, status, where)`` per requested run; ``where`` is its run directory,
            or why there is none (status ``incomplete``).
        fail_on: statuses that fail the gate.
    """
    failing = [f"{label}: {status} ({where})" for label, status, where in outcomes if status in fail_on]
    return (EXIT_FAILED_GATE if failing else EXIT_OK), failing
