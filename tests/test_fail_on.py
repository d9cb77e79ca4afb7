"""``bakeoff qualify --fail-on STATUS``: the exit codes of README "CI gating".

The real runs are elsewhere, to keep CI's time: the disqualified untrained fixture exiting 1
under ``--fail-on disqualified`` in ``tests/test_installed.py`` (from the installed wheel), and
qualified runs exiting 0 under every ``--fail-on`` status in ``tests/test_e2e_engines.py``
(``qualify_run``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bakeoff.api.errors import UserError
from bakeoff.cli.gating import EXIT_FAILED_GATE, EXIT_OK, gate, parse_fail_on

REPO = Path(__file__).resolve().parent.parent


def test_parse_and_gate():
    assert parse_fail_on(["disqualified", "incomplete,unavailable"]) == {"disqualified", "incomplete", "unavailable"}
    assert parse_fail_on([]) == frozenset()
    with pytest.raises(UserError, match="--fail-on 'qualified' is not a verdict status to fail on; choose from"):
        parse_fail_on(["qualified"])
    outcomes = [("vllm", "disqualified", "/runs/a"), ("ort-genai", "incomplete", "no run written: pytest exit 4"),
                ("transformers", "qualified", "/runs/b")]
    assert gate(outcomes, frozenset()) == (EXIT_OK, [])
    assert gate(outcomes, frozenset({"unavailable"})) == (EXIT_OK, [])
    code, lines = gate(outcomes, frozenset({"disqualified", "incomplete"}))
    assert code == EXIT_FAILED_GATE == 1 and lines == ["vllm: disqualified (/runs/a)",
                                                      "ort-genai: incomplete (no run written: pytest exit 4)"]


def test_exit_codes_are_the_readme_table():
    """The README's table and the gating module's constants say the same codes."""
    from bakeoff.cli import gating

    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## CI gating"):]
    section = section[:section.index("\n## ", 4)]
    for code in (gating.EXIT_OK, gating.EXIT_FAILED_GATE, gating.EXIT_BAD_INPUT, gating.EXIT_NO_RUN, gating.EXIT_INTERRUPTED):
        assert f"| {code} |" in section
    assert "--fail-on disqualified" in section
