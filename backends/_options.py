"""What an engine said about the options it was given: ignored, overridden, fell back, or took.

An engine that accepts an option and then does something else (vLLM CPU given
``--attention-backend FLASH_ATTN`` logs ``Cannot use AttentionBackendEnum.FLASH_ATTN backend
on CPU.`` and serves with its CPU backend) leaves the user measuring a config they did not
ask for. Each engine backend keeps its own rules (the engine's messages, read from its source)
in its folder and answers :meth:`option_report`; this module holds the shared shapes and the
matcher. The ``load.options_effective`` check (``evaluations/test_load.py``) judges the report.

Rules of the report:
- an option is *user-set* when the user passed it (``--backend-opt``, or a flag inside an
  engine's free-form arguments); bakeoff's own defaults are not;
- a *statement* is an engine line (or, for a documented silent override, the engine source
  that does it) saying an option did not take; it concerns the user only when the option was
  user-set with a value the statement contradicts (``applies``);
- an option is *verified* only by something the engine states about its effect: the effective
  value it prints, a measured figure, or the absence of a statement where the engine's source
  logs every path that drops the option (the rule names that source).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable

from pydantic import Field

from bakeoff.api.specs import Spec

# vLLM-style prefix: "(Worker pid=12) INFO 12-01 08:37:31 [cpu.py:178] "; ANSI colours when a tty
LOG_PREFIX = re.compile(r"^(?:\([^)]*\)\s*)?(?:[A-Z]+\s+\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)?\s+\[[^\]]*\]\s*)?")
ANSI = re.compile(r"\x1b\[[0-9;]*m")


@dataclass(frozen=True)
class LogRule:
    """One engine message that says an option did not take.

    Attributes:
        options: the option keys it concerns (the backend's ``--backend-opt`` names, or the
            engine flag's name in snake case for flags passed through free-form arguments).
        pattern: regular expression searched in each log line.
        kind: ``ignored`` | ``overridden`` | ``fell-back`` | ``disabled``.
        source: where the message comes from in the engine (file and function), so a reader
            can check the rule against a newer release.
        applies: given the user's value, whether the message contradicts it (e.g. "disabling
            chunked prefill" does not contradict ``enable_chunked_prefill=false``); None: any value.
    """

    options: tuple[str, ...]
    pattern: re.Pattern
    kind: str
    source: str
    applies: Callable[[Any], bool] | None = None


def rule(options: str | tuple[str, ...], pattern: str, kind: str, source: str,
         applies: Callable[[Any], bool] | None = None) -> LogRule:
    """A :class:`LogRule`; ``options`` may be one key."""
    return LogRule((options,) if isinstance(options, str) else tuple(options), re.compile(pattern), kind, source, applies)


def truthy(value: Any) -> bool:
    """``applies`` for messages that disable a feature: they contradict only an option set on."""
    return value not in (False, None, 0, "false", "False", "0", "off", "none", "None")


class OptionStatement(Spec):
    """An engine's statement that an option did not take.

    Attributes:
        option: the option it concerns.
        kind: ``ignored`` | ``overridden`` | ``fell-back`` | ``disabled``.
        line: the engine's line as logged (prefix kept: it says which process), or for a
            silent override the source statement that does it, marked ``(no log line)``.
        log: the file it was read from (``vllm.log``, ``builder.log``...).
        source: the engine source the rule comes from.
        user_set: the user set this option with a value the statement contradicts.
    """

    option: str
    kind: str
    line: str
    log: str = ""
    source: str = ""
    user_set: bool = False


class OptionReport(Spec):
    """Which options the user set, what the engine said about them, and what proves they took.

    Attributes:
        engine: engine name, for summaries.
        set_options: the user-set options and their values.
        statements: every matched statement, user-set or not (others are context).
        verified: ``{option: how}``: the engine's words or figure showing the option took.
        unverifiable: ``{option: why}``: set, contradicted by nothing, and nothing shows it took.
        judged_elsewhere: ``{option: check}``: the measured effect is another check's business
            (spec-decode acceptance, prefix-cache hits, KV capacity ratio).
    """

    engine: str
    set_options: dict[str, Any] = Field(default_factory=dict)
    statements: list[OptionStatement] = Field(default_factory=list)
    verified: dict[str, str] = Field(default_factory=dict)
    unverifiable: dict[str, str] = Field(default_factory=dict)
    judged_elsewhere: dict[str, str] = Field(default_factory=dict)

    def ignored(self) -> list[OptionStatement]:
        """Statements about user-set options (what fails ``load.options_effective``)."""
        return [s for s in self.statements if s.user_set]

    def add(self, statement: OptionStatement) -> None:
        """Add a statement (not twice the same option and message), marking it user-set when
        the option was set; a contradicted option is no longer verified nor unverifiable."""
        key = (statement.option, message_of(statement.line))
        if any((s.option, message_of(s.line)) == key for s in self.statements):
            return
        self.statements.append(statement)
        if statement.user_set:
            self.verified.pop(statement.option, None)
            self.unverifiable.pop(statement.option, None)


def message_of(line: str) -> str:
    """A log line without its process/level/time/file prefix (the same message from two
    processes is one statement)."""
    return LOG_PREFIX.sub("", ANSI.sub("", line)).strip()


def scan(text: str, rules: list[LogRule] | tuple[LogRule, ...], set_options: dict[str, Any],
         log_name: str) -> list[OptionStatement]:
    """Match ``rules`` against every line of ``text``.

    Args:
        text: a log.
        rules: the engine's rules.
        set_options: user-set options and values (decides ``user_set``).
        log_name: the log's file name, recorded with each statement.

    Returns:
        One statement per (option, message), in log order.
    """
    out: list[OptionStatement] = []
    seen: set[tuple[str, str]] = set()
    for raw in text.splitlines():
        line = ANSI.sub("", raw).rstrip()
        if not line:
            continue
        for r in rules:
            if not r.pattern.search(line):
                continue
            for opt in r.options:
                key = (opt, message_of(line))
                if key in seen:
                    continue
                seen.add(key)
                user = opt in set_options and (r.applies is None or r.applies(set_options[opt]))
                out.append(OptionStatement(option=opt, kind=r.kind, line=line[:600], log=log_name,
                                           source=r.source, user_set=user))
    return out


def read_log(path, max_bytes: int = 8_000_000) -> str:
    """The whole log (its last ``max_bytes``), '' when missing: startup statements come early,
    so a tail is not enough."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, 2)
            size = fh.tell()
            fh.seek(max(0, size - max_bytes))
            return fh.read().decode("utf-8", "replace")
    except OSError:
        return ""


def fallback_statements(fallbacks: dict[str, str], set_options: dict[str, Any], engine: str) -> list[OptionStatement]:
    """Statements from ``BackendInfo.fallbacks`` (``{option: why}``: what a worker served with
    instead of what was asked, e.g. ``batching``)."""
    return [OptionStatement(option=opt, kind="fell-back", line=f"{opt} fell back: {text}"[:600], log="backend info",
                            source=f"{engine} worker", user_set=opt in set_options)
            for opt, text in (fallbacks or {}).items()]
