"""``bakeoff report``: a Markdown report of run directories (verdict table + sweep table).

Everything shown is recomputed from the run directories (docs/design.md "Artifacts"), the
verdicts' reasons too: every status but ``qualified`` says why, in one short line in the verdict
table (:func:`reason_line`) and whole under "Why not qualified".
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Any
from urllib.parse import quote

from jinja2 import Environment
from markupsafe import Markup
from pydantic import ValidationError

from bakeoff.host.artifacts import atomic_write_text, list_runs, read_json
from bakeoff.api.errors import UserError
from bakeoff.analysis.failures import LOG_PREFIX
from bakeoff.api.verdict import Check, Verdict, decide
from bakeoff.loadgen.serving_cpu import serving_bound_note

TEMPLATE = """# bakeoff report

{{ runs|length }} run(s). Each run directory holds `verdict.json`, `checks/`, `evidence/`, `engine/` (the engine's log) and `run.json`.

## Verdicts

| backend | model | options | status | why | run |
|---|---|---|---|---|---|
{% for r in runs -%}
| {{ r.backend }} | {{ r.model }} | {{ r.options or "" }} | **{{ r.status }}** | {{ r.why }} | {{ r.run_id }} |
{% endfor %}
{% set unqualified = runs|rejectattr("status", "equalto", "qualified")|list %}{% if unqualified -%}
## Why not qualified

{% for r in unqualified -%}
### {{ r.backend }} on {{ r.model }}{% if r.options %} ({{ r.options }}){% endif %}: {{ r.status }}

Run [{{ r.run_id }}]({{ r.verdict_href|safe }}):

{% for reason in r.reasons %}- {{ whole(reason) }}
{% endfor %}
{% endfor %}{% endif -%}
{% if configurations -%}
## One engine, several configurations

{% for g in configurations -%}
- **{{ g.backend }}** on {{ g.model }}: {% for cell in g.cells %}{{ cell.options or "its defaults" }} **{{ cell.status }}**{% if cell.cls %} ({{ cell.cls }}){% endif %}{% if not loop.last %}; {% endif %}{% endfor %}{% if g.note %}. {{ g.note }}{% endif %}
{% endfor %}
{% endif -%}
## Engines

| backend | engine | version | device | start s | KV cache tokens | full-context sequences (KV tokens / max_model_len) |
|---|---|---|---|---|---|---|
{% for r in runs -%}
| {{ r.backend }} | {{ r.info.engine or "" }} | {{ r.info.engine_version or "" }} | {{ r.info.device or "" }} | {{ fmt(r.info.startup_s, 1) }} | {{ fmt(r.info.kv_cache_tokens, 0) }} | {{ fmt(r.info.max_concurrency, 1) }}{% if r.info.max_model_len and r.info.max_concurrency %} at {{ fmt(r.info.max_model_len, 0) }} tokens{% endif %} |
{% endfor %}
### How each ran

The configuration each backend was measured in: bakeoff's defaults for it (its best documented
configuration on this host) and what the engine reported, from `backend_info.notes`.

{% for r in runs if r.notes -%}
- **{{ r.backend }}**{% if r.options %} ({{ r.options }}){% endif %}: {{ r.notes }}
{% endfor %}
## Sanity

Known answers: the probes answered right (of the probes asked); flagged: outputs the degeneration
detectors flagged (probe outputs and open-ended ones); agreement: greedy outputs identical to the
reference's, tied (the tie rule: a near-tie at the first difference) or really different;
accuracy: the backend's, then the reference's, on the same probes.

| backend | known answers | flagged outputs | agreement with the reference | accuracy: backend vs reference |
|---|---|---|---|---|
{% for r in runs -%}
| {{ r.backend }} | {{ r.sanity.accuracy }} | {{ r.sanity.flagged }} | {{ r.sanity.exact }} | {{ r.sanity.ref }} |
{% endfor %}
{% set skipped = runs|selectattr("skipped")|list %}{% if skipped -%}
## Checks not verified

A skipped check verified nothing: it neither passed nor failed (report-only checks, and checks this
engine or host cannot run).

{% for r in skipped -%}
- **{{ r.backend }}**{% if r.options %} ({{ r.options }}){% endif %}: {% for name, why in r.skipped %}`{{ name }}`: {{ why }}{% if not loop.last %}; {% endif %}{% endfor %}
{% endfor %}
{% endif %}
## Throughput sweep (closed loop, {{ "distinct prompt per session" }})

{% for r in runs if r.points -%}
### {{ r.backend }} on {{ r.model }}{% if r.options %} ({{ r.options }}){% endif %}
{% if r.distorted %}
**Figures distorted in transit: they are the hop's, not the engine's** (throughput.transport: {{ r.distorted }}).
{% endif %}{% if r.disputed %}
**Token counts disputed: the server's usage and the client's count disagree, so tokens/s and TPOT may be off** (throughput.accounting: {{ r.disputed }}).
{% endif %}{% if r.serving_bound %}
**{{ r.serving_bound[0] | upper }}{{ r.serving_bound[1:] }}.**
{% endif %}

| sessions | requests | tokens in / out per request | aggregate output tok/s | per-session tok/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | ITL p50 ms | errors | valid |
|---|---|---|---|---|---|---|---|---|---|---|
{% for p in r.points -%}
| {{ p.sessions }} | {{ p.requests }} | {{ per_request(p, "input_tokens") }} / {{ per_request(p, "output_tokens") }} | {{ fmt(p.output_tokens_per_s, 1) }} | {{ fmt(p.per_session_output_tokens_per_s, 1) }} | {{ fmt(p.ttft_p50_ms, 1) }} | {{ fmt(p.ttft_p99_ms, 1) }} | {{ fmt(p.tpot_p50_ms, 2) }} | {{ fmt(p.itl_p50_ms, 2) }} | {{ p.errors }} | {{ "no: " ~ p.invalid_reason if p.valid is false else "yes" }} |
{% endfor %}
Each point: that many closed-loop sessions, each sending its next request when the last ended; the
percentiles are over the point's requests (few requests: a p99 is their maximum). valid: the load
generator measured itself within its error budget at that concurrency (`loadgen.calibration`).

{% if r.itl_in_frames %}ITL is per token: at the points where its p50 is 0.00 most tokens reached the client several to an
event (the server sends them in frames), so half the per-token gaps are 0; TPOT is the decode pace there.
{% endif %}{% if r.warmup %}Warm-up (reported apart): first request TTFT {{ fmt(r.warmup.first_request_ttft_ms, 1) }} ms.{% endif %}

{% endfor %}
"""


def clip(text: str, n: int) -> str:
    """``text`` cut to at most ``n`` characters at a word boundary, with an ellipsis when cut."""
    if len(text) <= n:
        return text
    cut = text[:n - 1]
    return (cut.rsplit(" ", 1)[0] if " " in cut else cut).rstrip(" ,;:") + "…"


def summary_text(check: dict[str, Any] | None, default: str = "") -> str:
    """A check's ``summary`` as text: a string as it is, anything else (a list, a number) through
    ``str()``, none (absent or null) as ``default``. A damaged verdict.json never breaks a report."""
    s = (check or {}).get("summary")
    return default if s is None else s if isinstance(s, str) else str(s)


TABLE_REASON_CHARS = 240  # the reasons of one run in a table cell, at most
WHOLE_REASON_CHARS = 4000  # one reason "whole", at most (a damaged run's megabyte summary is cut)
_LOG_PREFIX_ANYWHERE = re.compile(LOG_PREFIX.pattern.lstrip("^"))


def _one_line(reason: Any) -> str:
    return " ".join(str(reason).split())


def reason_line(reasons: list[str], n: int = TABLE_REASON_CHARS) -> str:
    """A run's reasons as one short line for a table cell; empty without reasons.

    Each reason on one line, vLLM's log-line prefixes taken out (the whole text keeps them); the
    first three share ``n`` characters, each cut at a word boundary with an ellipsis but to no less
    than 80 (its check and failure class, which lead, stay whole); ``(+N more)`` says how many are
    left out.
    """
    lines = [_LOG_PREFIX_ANYWHERE.sub("", _one_line(r)) for r in reasons]
    if not lines:
        return ""
    each = max(80, n // min(3, len(lines)))
    return "; ".join(clip(x, each) for x in lines[:3]) + (f" (+{len(lines) - 3} more)" if len(lines) > 3 else "")


def reason_lines(reasons: list[str], n: int = 200, most: int = 4) -> str:
    """A run's reasons for a console cell: one line each, cut to ``n`` characters, ``most`` of them."""
    lines = [clip(_LOG_PREFIX_ANYWHERE.sub("", _one_line(r)), n) for r in reasons[:most]]
    return "\n".join(lines + ([f"(+{len(reasons) - most} more)"] if len(reasons) > most else []))


_MD_SPECIAL = re.compile(r"([\\`*\[\]<|])|^>|(?<![A-Za-z0-9])_|_(?![A-Za-z0-9])")  # a ">" inside text is no quote
STATUSES = ("qualified", "disqualified", "unavailable", "incomplete")  # bakeoff/api/verdict.py's


def md_escape(text: Any) -> str:
    """``text`` as literal Markdown on one line: newlines become spaces; backslashes, backticks,
    ``*``, brackets, ``<``, a leading ``>``, pipes and word-edge underscores are backslash-escaped
    (an engine's ``kernel[grid](...)`` is no link, an ``a | b`` no table cell, a ``<script>`` in a
    model name no HTML, ``auto -> fp8`` stays readable)."""
    text = " ".join(str(text).split())
    return _MD_SPECIAL.sub(lambda m: "\\" + m.group(0), text)


def fmt(value: Any, digits: int = 1) -> str:
    """A figure as shown: ``1,234.5``; none, NaN or an infinity as ``–``; anything else as text."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "–"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            return f"{value:,.{digits}f}"
        except OverflowError:  # an int past any float (a damaged run): no figure
            return "–"
    return str(value)


def _recomputed(v: dict[str, Any]) -> tuple[str, list[str]]:
    """The status as today's rules decide it from the run's checks (a report recomputes what it
    shows from the run directory; a run written under older rules is judged by the current ones)."""
    recorded = v.get("status")
    if recorded is not None and recorded not in STATUSES:  # damage shown as it is, not judged into a status
        return f"unknown status {str(recorded)[:40]!r}", [f"verdict.json says status {str(recorded)[:40]!r}, not a verdict status"]
    try:  # a summary of another type (a damaged run) is its text: the reasons are still recomputed
        checks = [Check.model_validate({**c, "summary": summary_text(c)}) for c in v.get("checks", [])]
    except (ValueError, RecursionError):
        reasons = [r for r in (v.get("reasons") or []) if isinstance(r, str)] if isinstance(v.get("reasons"), list) else []
        return str(recorded), reasons or ([] if recorded == "qualified" else
                                          [f"verdict.json records no reason for {recorded} and its checks are not bakeoff's"])
    left_out = v.get("left_out")
    left_out = [str(x) for x in left_out] if isinstance(left_out, list) else []
    return decide(checks, finished=v.get("finished_at") is not None, left_out=left_out)


def _require_verdict_shape(v: Any, path: Path) -> None:
    """The fields the report reads, with the types it reads them as.

    Raises:
        UserError: naming the first field that is not what bakeoff writes.
    """
    def bad(what: str) -> UserError:
        return UserError(f"cannot read run directory {path}: verdict.json{'' if what.startswith(chr(39)) else ' '}{what}; pass folders that hold a "
                         "verdict.json written by bakeoff")
    if not isinstance(v, dict):
        raise bad(f"holds a {type(v).__name__}, not an object")
    if not isinstance(v.get("checks", []), list):
        raise bad("has checks that are not a list")
    for c in v.get("checks", []):
        if not isinstance(c, dict) or not isinstance(c.get("name"), str) or not isinstance(c.get("status"), str):
            raise bad("has a check without a name and a status")
        if not isinstance(c.get("values", {}), dict):
            raise bad(f"has check {c['name']} whose values are not an object")
    for key in ("options", "backend_info", "fingerprint"):
        if not isinstance(v.get(key) or {}, dict):
            raise bad(f"has {key} that is not an object")
    for key in ("backend", "model"):
        if not isinstance(v.get(key), str):
            raise bad(f"has no {key}")
    # the contract bakeoff writes; shown as they are, not refused: an unknown status (_recomputed) and
    # a check summary of another type (summary_text)
    probe = {**v, "status": v.get("status") if v.get("status") in STATUSES else "incomplete",
             "checks": [{**c, "summary": summary_text(c)} for c in v.get("checks", [])]}
    try:
        Verdict.model_validate(probe)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(x) for x in err.get("loc", ())) or "?"
        raise bad(f"'s {where} is {repr(err.get('input'))[:60]}, not bakeoff's ({err.get('msg')})") from None
    except RecursionError:
        raise bad("nests deeper than bakeoff writes") from None


def _notes(v: dict[str, Any]) -> dict[str, Any]:
    """A run's ``backend_info.notes`` (an empty dict where a damaged run holds something else)."""
    info = v.get("backend_info")
    notes = info.get("notes") if isinstance(info, dict) else None
    return notes if isinstance(notes, dict) else {}


def per_request(point: dict[str, Any], key: str) -> str:
    """A point's mean tokens per ok request (``input_tokens`` or ``output_tokens``), or ``–``."""
    if not isinstance(point, dict):
        return "–"
    total, ok = point.get(key), point.get("ok")
    if isinstance(total, (int, float)) and isinstance(ok, int) and ok > 0 and math.isfinite(float(total)):
        return fmt(total / ok, 0)
    return "–"


def _of(shown: str, rate: Any, n: Any) -> str:
    """``94% (282/300)``: a rate with its count, where both are numbers."""
    if isinstance(rate, (int, float)) and isinstance(n, int) and n > 0 and math.isfinite(float(rate)):
        return f"{shown} ({round(float(rate) * n)}/{n})"
    return shown


def _agreement(ra: dict[str, Any], pct) -> str:
    """``272 exact, 28 tie, 0 real of 300`` (with undetermined ones when any), else the rate."""
    v = ra.get("values") or {}
    parts = [v.get("exact"), v.get("tie_divergences"), v.get("real_divergences")]
    if not all(isinstance(x, int) for x in parts):
        return pct(v.get("exact_match_rate"))
    und = v.get("undetermined_divergences") or 0
    total = sum(parts) + (und if isinstance(und, int) else 0)
    return (f"{parts[0]} exact, {parts[1]} tie, {parts[2]} real" + (f", {und} undetermined" if und else "")
            + f" of {total}")


def _itl_in_frames(points: list) -> bool:
    """Whether a sweep point's tokens came in frames of several (ITL p50 0 where TPOT is not)."""
    return any(p.get("itl_p50_ms") == 0 and (p.get("tpot_p50_ms") or 0) > 0 for p in points if isinstance(p, dict))


def _pct(x) -> str:
    """A finite fraction as a percentage, else ``–``."""
    try:
        return f"{float(x):.0%}" if isinstance(x, (int, float)) and math.isfinite(float(x)) else "–"
    except OverflowError:  # an int too large for a float (a damaged run)
        return "–"


def _sanity_cells(ka: dict, dg: dict, ra: dict) -> dict[str, str]:
    """The report's sanity cells from the known-answers, degeneration and reference-agreement checks."""
    kv = ka.get("values") or {}
    return {"accuracy": _of(_pct(kv.get("accuracy")), kv.get("accuracy"), kv.get("probes")) if ka else "–",
            "flagged": (f"{dg['values'].get('flagged')}/{dg['values'].get('outputs')}" if dg.get("values") else "–"),
            "exact": _agreement(ra, _pct) if ra.get("status") != "skip" else clip(summary_text(ra, "–"), 60) if ra else "–",
            "ref": (f"{_pct(ra['values'].get('accuracy'))} vs {_pct(ra['values'].get('reference_accuracy'))}"
                    if ra.get("values", {}).get("reference_accuracy") is not None else "–")}


def load_run(path: Path) -> dict[str, Any]:
    """Read one run directory into the fields the report shows.

    Raises:
        UserError: when the directory has no readable ``verdict.json``.
    """
    try:
        v = read_json(path / "verdict.json")  # a FIFO, a device or JSON nested 200,000 deep: a ValueError
    except (OSError, ValueError) as exc:  # ValueError: JSONDecodeError, UnicodeDecodeError
        raise UserError(f"cannot read run directory {path}: {exc.__class__.__name__}: {' '.join(str(exc).split())[:120]}; "
                        "pass folders that hold a verdict.json written by bakeoff") from None
    _require_verdict_shape(v, path)
    checks = {c["name"]: c for c in v.get("checks", [])}
    v["status"], v["reasons"] = _recomputed(v)
    sweep = checks.get("throughput.sweep", {}).get("values", {})
    ka = checks.get("sanity.known_answers", {})
    dg = checks.get("sanity.degeneration", {})
    ra = checks.get("sanity.reference_agreement", {})
    tr = checks.get("throughput.transport", {})
    acc = checks.get("throughput.accounting", {})
    return {
        "path": str(path), "run_id": v.get("run_id"), "backend": v.get("backend"), "model": v.get("model"),
        "options": ", ".join(f"{k}={val}" for k, val in (v.get("options") or {}).items()),
        "status": v.get("status"), "reasons": v["reasons"], "why": reason_line(v["reasons"]),
        "info": v.get("backend_info") or {}, "points": sweep.get("points") or [], "warmup": sweep.get("warmup"),
        "itl_in_frames": _itl_in_frames(sweep.get("points") or []),
        "notes": "; ".join(f"{k} {clip(_one_line(val), 160)}" for k, val in _notes(v).items())[:1500],
        "skipped": [(c.get("name"), clip(_one_line(c.get("summary") or "(no reason recorded)"), 160))
                    for c in v.get("checks", []) if isinstance(c, dict) and c.get("status") == "skip"],
        "sanity": _sanity_cells(ka, dg, ra),
        "verdict": v,
        "distorted": clip(summary_text(tr) or "distorted", 300) if tr.get("status") == "fail" else None,
        "disputed": clip(summary_text(acc) or "disputed", 300) if acc.get("status") == "fail" else None,
        "serving_bound": serving_bound_note([p for p in sweep.get("points") or [] if isinstance(p, dict)]),
    }


def configurations(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Engines run on one model in several configurations (``--matrix`` cells) whose verdicts
    differ: each cell's status and first failure class, and, where one cell qualified and another
    was disqualified for accuracy, that the engine serves the model and the configuration costs the
    accuracy (ORT GenAI int4 beside its lossless fp32 export)."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in runs:
        groups.setdefault((r["backend"], r["model"]), []).append(r)
    out = []
    for (backend, model), cells in groups.items():
        if len({c["options"] for c in cells}) < 2 or len({c["status"] for c in cells}) < 2:
            continue
        rows = [{"options": c["options"], "status": c["status"],
                 "cls": next((x.split(": ")[1] for x in c["reasons"] if x.count(": ") >= 2), None)
                 if c["status"] == "disqualified" else None} for c in cells]
        good = [c["options"] or "its defaults" for c in rows if c["status"] == "qualified"]
        lossy = [c["options"] or "its defaults" for c in rows if c["cls"] == "accuracy-regression"]
        note = (f"the engine serves the model ({', '.join(good)}); {', '.join(lossy)} costs accuracy against the "
                "reference" if good and lossy else "")
        out.append({"backend": backend, "model": model, "cells": rows, "note": note})
    return out


def write_report(run_paths: list[Path], out_dir: Path) -> Path:
    """Write ``report.md`` for the given runs (folders or their parents).

    Raises:
        UserError: no run found, or an unreadable run.
    """
    runs = [load_run(p) for p in list_runs(run_paths)]
    if not runs:
        raise UserError(f"no run directory (with verdict.json) under {', '.join(map(str, run_paths))}")
    for r in runs:  # relative to the report, percent-encoded: a link that a space does not end
        r["verdict_href"] = quote(os.path.relpath(Path(r["path"]) / "verdict.json", out_dir).replace(os.sep, "/"))
    # every value a run gives is escaped as it is written (finalize): a model name "<img onerror=...>" is text;
    # but a link target made here (percent-encoded, ``|safe``), whose "_" or "\\" an escape would change
    env = Environment(trim_blocks=False, lstrip_blocks=False, keep_trailing_newline=True,
                      finalize=lambda x: x if isinstance(x, Markup) else md_escape(x))
    text = env.from_string(TEMPLATE).render(runs=runs, fmt=fmt, per_request=per_request, configurations=configurations(runs),
                                            whole=lambda r: clip(_one_line(r), WHOLE_REASON_CHARS))
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out_dir / "report.md", text)
    return out_dir / "report.md"
