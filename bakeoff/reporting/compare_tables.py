"""Two sections of ``bakeoff compare`` beyond the per-column tables of ``compare.py``:

- speculative decoding acceptance, one row per run that configured it (``speculative_config``)
  or measured it: method, speculative tokens, drafts, drafted and accepted tokens, mean
  acceptance length and the acceptance at each draft position, as the ``spec_decode.acceptance``
  check records them (evaluations/test_spec_decode.py: per position = accepted at i / drafts).
  A run whose check failed or skipped shows its status and class instead of figures;
- what the engines said: each failed check's own words (its summary's first line, without
  vLLM's log-line prefix, trimmed), so that the Markdown holds them and not only the HTML's
  tooltips;
- why each run that is not qualified is not: its verdict's reasons, whole (the columns' "why"
  row holds them in one short line).

Works on :class:`bakeoff.reporting.compare.Column` objects; cells are the dicts of
``compare.cell`` (text, href, cls).
"""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING, Any

from bakeoff.analysis.failures import LOG_PREFIX
from bakeoff.reporting.report import WHOLE_REASON_CHARS, clip, fmt, md_escape, summary_text  # noqa: F401 - md_escape: compare's

if TYPE_CHECKING:
    from bakeoff.reporting.compare import Column

SPEC = "spec_decode.acceptance"
MAX_POSITIONS = 16  # position columns at most (vLLM drafts a handful of tokens; a key of 10^8 is damage)
WORDS_CHARS = 160  # the words of one failed check, at most
_LOG_PREFIX_ANYWHERE = re.compile(LOG_PREFIX.pattern.lstrip("^"))
_POSITION = re.compile(r"[0-9]+")  # a draft position: a non-negative integer, ASCII digits


_ALL_FAILED = re.compile(r"^(\d+)/\1 [\w -]*requests failed")  # the checks' "9/9 needle requests failed: ..."


def no_success(values: dict[str, Any]) -> bool:
    """A sweep point or a check's values that sent requests and got no successful one back."""
    return values.get("ok") == 0 and bool(values.get("requests") or values.get("errors"))


def all_failed(check: dict[str, Any] | None) -> bool:
    """A check none of whose requests succeeded: its figures (0 tok/s, 0 needles found) are no
    measurement. Read from its values (``requests``/``ok``) or its failure message (``N/N ...
    requests failed``)."""
    check = check or {}
    return check.get("status") in ("fail", "error") and (
        no_success(check.get("values") or {}) or bool(_ALL_FAILED.match(summary_text(check))))


def _cell(text: str, href: str | None = None, cls: str = "") -> dict[str, Any]:
    return {"text": text, "href": href, "cls": cls}


def engine_words(summary: Any) -> str:
    """A failed check's words as shown: the summary's first line, vLLM's ``(Worker pid=1) ERROR
    12-02 10:45:11 [x.py:953] `` prefixes taken out (they push the engine's sentence past the
    cut), trimmed to :data:`WORDS_CHARS` at a word boundary. A summary that is not a string (a
    damaged verdict.json: a list, a number) is shown through ``str()``; None says nothing."""
    text = summary_text({"summary": summary}).strip()
    first = text.splitlines()[0] if text else ""
    return clip(_LOG_PREFIX_ANYWHERE.sub("", first).strip(), WORDS_CHARS)


def what_engines_said(cols: list[Column]) -> list[dict[str, str]]:
    """One entry per failed (or errored) check of every column, in column then check order:
    ``{"run": column label, "check", "class", "words", "href"}``."""
    out = []
    for c in cols:
        for name, ch in c.checks.items():
            if ch.get("status") not in ("fail", "error"):
                continue
            out.append({"run": c.label, "check": name, "class": ch.get("failure_class") or ch["status"],
                        "words": engine_words(ch.get("summary")) or "(no message recorded)",
                        "href": str(c.path / f"checks/{name}.json")})
    return out


def why_not_qualified(cols: list[Column]) -> list[dict[str, Any]]:
    """One entry per column whose status is not ``qualified``, in column order: ``{"run": column
    label, "run_id", "status", "reasons": its verdict's reasons, each on one line and whole (up to
    :data:`bakeoff.reporting.report.WHOLE_REASON_CHARS`), "href": its verdict.json}``."""
    return [{"run": c.label, "run_id": c.run_id, "status": c.status, "href": str(c.path / "verdict.json"),
             "reasons": [clip(" ".join(str(r).split()), WHOLE_REASON_CHARS) for r in c.reasons]}
            for c in cols if c.status != "qualified"]


def _spec_config(c: Column) -> dict[str, Any]:
    spec = c.options.get("speculative_config") or ((c.checks.get(SPEC) or {}).get("values") or {}).get("speculative_config")
    return spec if isinstance(spec, dict) else ({"method": str(spec)} if spec else {})


def _pct(x: Any) -> str:
    return f"{x:.1%}" if isinstance(x, (int, float)) else "–"


def _status_text(c: Column, ch: dict[str, Any]) -> str:
    """``fail (class)``; a skip says why in a few words: the failed load's class when the engine
    never served (``skip (load fail: config-rejected)``), else the skip's reason, clipped."""
    status = ch.get("status") or "not run"
    if ch.get("failure_class"):
        return f"{status} ({ch['failure_class']})"
    load = c.checks.get("load") or {}
    if status == "skip" and load.get("status") in ("fail", "error"):
        return f"skip (load {load['status']}: {load.get('failure_class') or 'no class'})"
    reason = clip(engine_words(ch.get("summary")), 80)
    return f"{status}: {reason}" if reason else status


def _positions(vals: dict[str, Any]) -> tuple[dict[int, float | None], str]:
    """``per_position_acceptance`` as ``{position: fraction or None}`` (None: no drafts to divide
    by) for the keys that are non-negative integers (``"0"``, ``"1"``, ...) with a number or null,
    and a note on what was left out: ``malformed (...)`` for anything else (a list, a key ``"a"``
    or ``"0.0"``, a value ``"45%"``), ``positions past N not shown`` beyond :data:`MAX_POSITIONS`."""
    raw = vals.get("per_position_acceptance")
    if raw is None:
        return {}, ""
    if not isinstance(raw, dict):
        return {}, f"malformed (a {type(raw).__name__}, not an object)"
    out: dict[int, float | None] = {}
    bad = beyond = 0
    for key, x in raw.items():
        number = x is None or (isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x))
        if not (isinstance(key, str) and _POSITION.fullmatch(key) and number):
            bad += 1
        elif len(key) > 4 or int(key) >= MAX_POSITIONS:
            beyond += 1
        else:
            out[int(key)] = x
    notes = ([f"malformed ({bad} {'entry' if bad == 1 else 'entries'} ignored)"] if bad else []) + \
        ([f"positions past {MAX_POSITIONS - 1} not shown ({beyond})"] if beyond else [])
    return out, "; ".join(notes)


def spec_decode_table(cols: list[Column]) -> dict[str, Any] | None:
    """The acceptance table, or None when no run configured or measured speculative decoding.

    Position columns run up to the highest position any run measured (a number), at most
    :data:`MAX_POSITIONS`; a declared ``num_speculative_tokens`` makes no column (it may say
    anything). A run's positions that are malformed or past the cap are named in a last column."""
    runs = [c for c in cols if _spec_config(c) or ((c.checks.get(SPEC) or {}).get("values") or {}).get("drafts") is not None]
    if not runs:
        return None
    parsed = {id(c): _positions((c.checks.get(SPEC) or {}).get("values") or {}) for c in runs}
    n_pos = max((max((i for i, x in pos.items() if x is not None), default=-1) + 1 for pos, _ in parsed.values()),
                default=0)
    noted = any(note for _, note in parsed.values())
    header = ["run", "method", "speculative tokens", "check", "drafts", "drafted tokens", "accepted",
              "mean acceptance length", *[f"position {i}" for i in range(n_pos)], *(["per position"] if noted else [])]
    rows = [_spec_row(c, parsed[id(c)], n_pos, noted) for c in runs]
    return {"title": "Speculative decoding acceptance (per position: accepted at that position / drafts, "
                     "vLLM's counters over the check's workload)", "header": header, "rows": rows}


def _spec_row(c: Column, parsed: tuple, n_pos: int, noted: bool) -> list:
    """One run's row of :func:`spec_decode_table`: its method and tokens, the check's status, and
    its figures and per-position rates (a run without drafts: its status and class, no figures)."""
    spec, ch = _spec_config(c), c.checks.get(SPEC) or {}
    vals, (pos, note) = ch.get("values") or {}, parsed
    k = spec.get("num_speculative_tokens")
    k = max(k if isinstance(k, int) and not isinstance(k, bool) else 0, max(pos, default=-1) + 1)
    href = str(c.path / f"checks/{SPEC}.json") if ch else None
    status = ch.get("status") or "not run"
    row = [_cell(c.label, str(c.path / "verdict.json")), _cell(str(spec.get("method") or "?")),
           _cell(str(spec.get("num_speculative_tokens", "?")))]
    if vals.get("drafts") is None:  # failed, skipped or not run: its status and class, no figures
        return row + [_cell(_status_text(c, ch), href, status)] + [_cell("–") for _ in range(4 + n_pos + noted)]
    drafted, accepted = vals.get("draft_tokens"), vals.get("accepted_tokens")
    rate = vals.get("acceptance_rate")
    row.append(_cell(status + (f" ({ch['failure_class']})" if ch.get("failure_class") else ""), href, status))
    row += [_cell(fmt(vals.get("drafts"), 0)), _cell(fmt(drafted, 0)),
            _cell(fmt(accepted, 0) + (f" ({_pct(rate)})" if rate is not None else "")),
            _cell(fmt(vals.get("mean_acceptance_length"), 2))]
    row += [_cell(_pct(pos.get(i)) if i < k else "") for i in range(n_pos)]
    return row + ([_cell(note, href, "error" if note.startswith("malformed") else "")] if noted else [])


def _code(name: str) -> str:
    """A check name as a code span when it is a plain name (``throughput.sweep``), else escaped text."""
    return f"`{name}`" if re.fullmatch(r"[A-Za-z0-9_.\-]+", str(name)) else md_escape(name)


def words_markdown(words: list[dict[str, str]]) -> str:
    """The "what the engines said" list in Markdown (label, check, class, words; all escaped)."""
    lines = ["### What the engines said (each failed check's own words)", ""]
    lines += [f"- **{md_escape(w['run'])}** · {_code(w['check'])} · {md_escape(w['class'])}: {md_escape(w['words'])}"
              for w in words]
    return "\n".join(lines) + "\n"
