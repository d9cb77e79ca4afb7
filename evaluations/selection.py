"""One run, one verdict: what a pytest selection leaves out of the evaluations suite.

The suite is one evaluation of one engine. pytest can split or filter it: ``-n`` (pytest-xdist)
starts one session per worker, each with its own run directory and engine, each recording the
checks its share ran (a census run on 524d87b: three run folders, one ``qualified`` without the
agreement, tokenizer and sweep checks); ``-k``, ``-m``, ``--deselect``, ``--lf``, module paths and
node ids run a subset. ``-n`` is refused (:func:`refuse_split`); a subset runs, and the checks it
left out make the run ``incomplete`` (``Verdict.left_out``, :func:`bakeoff.api.verdict.decide`):
a partial run measures, it does not qualify. A failure it finds still disqualifies.

The suite's checks are read from its modules' ``@pytest.mark.check("...")`` lines
(:func:`suite_checks`; ``tests/test_selection.py`` holds them equal to the markers pytest sees).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from bakeoff.api.errors import UserError

EVALUATIONS_DIR = Path(__file__).resolve().parent
CHECK_MARK = re.compile(r'^@pytest\.mark\.check\(\s*"([^"]+)"\s*\)', re.M)


def suite_checks(modules: list[str]) -> list[str]:
    """Every check the whole suite records through a marked test, in module order."""
    names: list[str] = []
    for mod in modules:
        path = EVALUATIONS_DIR / f"{mod}.py"
        names += CHECK_MARK.findall(path.read_text()) if path.is_file() else []
    return list(dict.fromkeys(names))


def check_of(item) -> str | None:
    mark = item.get_closest_marker("check")
    return mark.args[0] if mark and mark.args else None


def left_out(modules: list[str], items: list, recorded: set[str]) -> list[str]:
    """The suite's checks that none of the selected ``items`` records and the run has not
    ``recorded`` before (a resumed run keeps what it measured)."""
    selected = {check_of(i) for i in items}
    return [c for c in suite_checks(modules) if c not in selected and c not in recorded]


def refuse_split(config: pytest.Config) -> None:
    """pytest-xdist's ``-n`` (or this being one of its workers): a ``UserError``."""
    if getattr(config.option, "numprocesses", None) or hasattr(config, "workerinput"):
        raise UserError("pytest-xdist's -n splits one evaluation into several partial runs, each with its own "
                        "engine and verdict; run the evaluations suite without -n (one engine, one run)")
