"""``bakeoff compare RUN_OR_DIR...``: runs side by side, in the tables serving teams write by hand.

Each run (backend x config x machine) is a column headed by its fingerprint (CPU/GPU,
memory, driver, engine version, options); sessions or measurements are rows; every cell
carries its delta in % against a baseline column (``--baseline``, default the first) and,
where the runs were repeated (``--repeats``), whether the difference is real or within
noise (bootstrap interval of the difference, :mod:`bakeoff.analysis.noise`). The verdict table links
each check to its evidence file. A recommendation per objective names the run it comes
from. Under the verdicts, each failed check's own words; speculative decoding acceptance per
position (:mod:`bakeoff.reporting.compare_tables`). When the runs are of several
models, every column's label names its model; a sweep point whose requests all failed is no
measurement ("– (all requests failed)"), and its row is kept. Labels and cells are escaped in
the Markdown (the HTML is autoescaped).
Output: ``report.md`` (:mod:`bakeoff.reporting.compare_markdown`), ``index.html`` and the plots
(:mod:`bakeoff.reporting.compare_html`).

Everything is recomputed from the run directories (docs/design.md "Artifacts").
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bakeoff.host.artifacts import atomic_write_text, list_runs
from bakeoff.api.errors import UserError
from bakeoff.analysis.noise import bootstrap_mean
from bakeoff.reporting.compare_findings import delta_text, findings, recommendations, short_value
from bakeoff.reporting.compare_markdown import render_markdown
from bakeoff.reporting.compare_tables import all_failed, no_success, spec_decode_table, what_engines_said, why_not_qualified
from bakeoff.reporting.report import fmt, load_run, reason_line, summary_text
from bakeoff.reporting.compare_html import render_html, write_plots

SWEEP_METRICS = [  # (title, point key, higher is better, digits)
    ("Aggregate output tok/s", "output_tokens_per_s", True, 1),
    ("Per-session output tok/s", "per_session_output_tokens_per_s", True, 1),
    ("TTFT p50 ms", "ttft_p50_ms", False, 1),
    ("TTFT p99 ms", "ttft_p99_ms", False, 1),
    # GPU runs only (bakeoff/analysis/roofline.py, bakeoff/host/telemetry.py); tables with no value are left out
    ("% of the decode roofline (bound kind)", "pct_of_bound", True, 2),
    ("Energy per output token J", "joules_per_output_token", False, 4),
    ("GPU mean power W", "gpu_power_mean_w", False, 0),
]
OPTIONAL_SWEEP_KEYS = {"pct_of_bound", "joules_per_output_token", "gpu_power_mean_w"}
MEASUREMENTS = [  # (row title, check, value key, higher is better, digits)
    ("KV cache tokens", "capacity.kv_cache", "kv_cache_tokens", True, 0),
    ("stated max concurrency (x)", "capacity.kv_cache", "max_concurrency", True, 1),
    ("first request TTFT ms", "capacity.warmup", "first_request_ttft_ms", False, 1),
    ("prefill tok/s cold", "prefix_cache.prefill", "cold_prefill_tokens_per_s", True, 0),
    ("prefill tok/s warm (prefix hit)", "prefix_cache.prefill", "warm_prefill_tokens_per_s", True, 0),
    ("prefix-cache warm hit rate", "prefix_cache.prefill", "warm_hit_rate", True, 3),
    ("spec-decode mean acceptance length", "spec_decode.acceptance", "mean_acceptance_length", True, 2),
    ("spec-decode single-stream decode tok/s", "spec_decode.acceptance", "decode_tokens_per_s_median", True, 1),
    ("agents aggregate tok/s", "agents.multiturn", "aggregate_output_tokens_per_s", True, 1),
    ("agents per-stream decode tok/s", "agents.multiturn", "per_stream_decode_tokens_per_s_p50", True, 1),
    ("agents TTFT warm p50 ms", "agents.multiturn", "ttft_warm_p50_ms", False, 1),
    ("agents prefix-cache hit rate", "agents.multiturn", "prefix_cache_hit_rate", True, 3),
    ("needles found", "needles.retrieval", "found", True, 0),
    ("energy per output token J (sweep)", "throughput.sweep", "joules_per_output_token", False, 4),
    ("GPU mean power W (sweep)", "telemetry.gpu", "power_mean_w", False, 0),
    ("GPU SM utilisation % (sweep)", "telemetry.gpu", "sm_util_mean_pct", True, 0),
]


def cell(text: str, href: str | None = None, cls: str = "") -> dict[str, Any]:
    """A table cell: text, an optional link (relative to the report folder), a CSS class."""
    return {"text": text, "href": href, "cls": cls}


class Column:
    """One run as a report column (read from its directory)."""

    def __init__(self, path: Path):
        r = load_run(path)
        self.path = path
        self.v: dict[str, Any] = r["verdict"]
        self.run_id = r["run_id"]
        self.backend = r["backend"]
        self.status = r["status"]
        self.reasons: list[str] = r["reasons"]  # why the status, recomputed from the run's checks
        self.checks = {c["name"]: c for c in self.v.get("checks", [])}
        self.info = r["info"]
        _check_shape(r)
        # a point whose requests all failed is no measurement (its 0 tok/s is not a speed): kept apart
        self.failed_points = {p["sessions"]: p for p in r["points"] if no_success(p)}
        self.points = {p["sessions"]: p for p in r["points"] if not no_success(p)}
        fp = self.v.get("fingerprint") or {}
        self.machine = machine(fp)
        ev = fp.get("engine_versions") or {}
        eng = self.info.get("engine") or self.backend
        self.engine = f"{eng} {self.info.get('engine_version') or ev.get(eng) or ''}".strip()
        self.engine_versions = ", ".join(f"{k} {v}" for k, v in sorted(ev.items()))
        self.options = self.v.get("options") or {}
        self.model = str(self.v.get("model") or "?")
        self.label = self.backend + (" " + ",".join(f"{k}={short_value(v)}" for k, v in self.options.items())
                                     if self.options else "")

    def value(self, check: str, key: str):
        return ((self.checks.get(check) or {}).get("values") or {}).get(key)

    def repeats(self, sessions: int, key: str) -> list[float]:
        p = self.points.get(sessions) or {}
        reps = [r.get(key) for r in (p.get("repeats") or [])]
        reps = [x for x in reps if x is not None]
        return reps or ([p[key]] if p.get(key) is not None else [])


def machine(fp: dict[str, Any]) -> dict[str, str]:
    """A run fingerprint's machine as report text (CPU and cores, GPUs, memory, driver, CUDA, host)."""
    gpus = fp.get("gpus") if isinstance(fp.get("gpus"), list) else []

    def text(key: str, none: str) -> str:  # any type: text
        return str(fp[key]) if fp.get(key) not in (None, "", [], {}) else none
    return {
        "cpu": f"{text('cpu', '?')} ({text('cpu_count', '?')} cores)",
        "gpu": ", ".join(str(g.get("name", "?")) if isinstance(g, dict) else str(g) for g in gpus) or "none",
        "memory": f"{text('memory_gib', '?')} GiB" if fp.get("memory_gib") else "?",
        "driver": text("cuda_driver", "–"),
        "cuda": text("cuda_version", "–"),
        "host": text("hostname", "?"),
    }


def _check_shape(r: dict[str, Any]) -> None:
    """TypeError (one line in :func:`load_columns`) unless the fields compare computes with have their
    types: a string run id, integer sessions, numbers or null for the sweep figures and their repeats."""
    if not isinstance(r["run_id"], str):
        raise TypeError(f"run_id is {r['run_id']!r}, not a string")
    for p in r["points"]:
        if not isinstance(p, dict) or type(p.get("sessions")) is not int:
            raise TypeError(f"a sweep point {p!r:.60} has no integer sessions")
        reps = p.get("repeats") or []
        if not isinstance(reps, list) or not all(isinstance(x, dict) for x in reps):
            raise TypeError(f"the {p['sessions']}-session point's repeats are not a list of objects")
        for where, (_t, k, _h, _d) in ((w, m) for w in (p, *reps) for m in SWEEP_METRICS):
            if where.get(k) is not None and type(where[k]) not in (int, float):
                raise TypeError(f"the {p['sessions']}-session point's {k} is {where[k]!r:.40}, not a number")


def load_columns(paths: list[Path]) -> list[Column]:
    """Read every run named (a run directory, or a folder of them).

    Raises:
        UserError: one line for a path that is missing or holds no readable run.
    """
    found: list[Path] = []
    for p in paths:
        p = Path(p)
        if not p.exists():
            raise UserError(f"cannot read run directory {p}: no such file or directory")
        runs = list_runs([p])
        if not runs:
            raise UserError(f"cannot read run directory {p}: no verdict.json in it or below it")
        found += [q for q in runs if q not in found]
    cols = []
    for p in found:
        try:
            cols.append(Column(p))
        except (TypeError, ValueError, KeyError, AttributeError) as exc:  # a verdict.json of the wrong shape inside
            raise UserError(f"cannot read run directory {p}: its verdict.json is not bakeoff's ({type(exc).__name__}: "
                            f"{str(exc)[:120]}); remove it from the comparison") from None
    if len({c.model for c in cols}) > 1:  # runs of several models: every column says which, the first too
        for c in cols:
            c.label += f" ({short_model(c.model)})"
    seen: dict[str, int] = {}
    for c in cols:  # same label on two machines or two repeats of a config: tell them apart
        seen[c.label] = seen.get(c.label, 0) + 1
    hosts = {c.machine["host"] for c in cols}
    for c in cols:
        if seen[c.label] > 1:
            c.label += f" @{c.machine['host']}" if len(hosts) > 1 else f" #{c.run_id[-6:]}"
    return cols


def short_model(model: str) -> str:
    """A model as a column label names it: ``fixture:tiny-qwen3`` -> ``tiny-qwen3``, a path or
    ``org/name`` -> its last part."""
    return model.removeprefix("fixture:").rstrip("/").rsplit("/", 1)[-1] or model


def pick_baseline(cols: list[Column], baseline: str | None) -> int:
    """Index of the baseline column: a run id (or its prefix/suffix), a label, or a 1-based number.

    Raises:
        UserError: when nothing matches.
    """
    if not baseline:
        return 0
    if baseline.isdigit() and 1 <= int(baseline) <= len(cols):
        return int(baseline) - 1
    for i, c in enumerate(cols):
        if baseline in (c.run_id, c.label) or c.run_id.startswith(baseline) or c.run_id.endswith(baseline):
            return i
    raise UserError(f"--baseline {baseline!r} matches no run; use a run id, a column label or a number 1..{len(cols)}")


def _options_text(c: Column) -> str:
    return ", ".join(f"{k}={json.dumps(v) if isinstance(v, dict) else v}" for k, v in c.options.items()) or "defaults"


# the fingerprint's rows: (label, a column's cell)
FINGERPRINT_ROWS: list[tuple[str, Any]] = [
    ("run", lambda c: cell(c.run_id, f"{c.path}/verdict.json")),
    ("status", lambda c: cell(c.status, cls=c.status)),
    ("why", lambda c: {**cell(reason_line(c.reasons) or "–"), "title": "\n".join(c.reasons)[:2000]}),
    ("model", lambda c: cell(c.model)),
    *[(label, (lambda key: lambda c: cell(c.machine[key]))(key))
      for label, key in (("CPU", "cpu"), ("GPU", "gpu"), ("memory", "memory"), ("driver", "driver"), ("CUDA", "cuda"))],
    ("engine", lambda c: cell(c.engine)),
    ("engine packages", lambda c: cell(c.engine_versions or "–")),
    ("options", lambda c: cell(_options_text(c))),
    ("profile", lambda c: cell(f"{c.v.get('profile')}, repeats {c.value('throughput.sweep', 'repeats') or 1}")),
]


def fingerprint_table(cols: list[Column]) -> dict[str, Any]:
    rows = [[cell(label)] + [make(c) for c in cols] for label, make in FINGERPRINT_ROWS]
    return {"title": "Columns (one per run: machine, engine, config)", "header": ["", *[c.label for c in cols]],
            "rows": rows}


def verdict_table(cols: list[Column]) -> dict[str, Any]:
    names: list[str] = []
    for c in cols:
        names += [n for n in c.checks if n not in names]
    rows = []
    for n in names:
        row = [cell(n)]
        for c in cols:
            ch = c.checks.get(n)
            if ch is None:
                row.append(cell("–"))
                continue
            text = ch["status"] + (f" ({ch['failure_class']})" if ch.get("failure_class") else "")
            ev = (ch.get("evidence") or [None])[0]
            href = str(c.path / (ev or f"checks/{n}.json"))
            row.append(cell(text, href, ch["status"]))
            row[-1]["title"] = summary_text(ch)[:300]
        rows.append(row)
    return {"title": "Verdicts (each cell links to the check's evidence)", "header": ["check", *[c.label for c in cols]],
            "rows": rows}


def sweep_tables(cols: list[Column], base: int) -> list[dict[str, Any]]:
    sessions = sorted({n for c in cols for n in (*c.points, *c.failed_points)})  # a point that failed is a row too
    out = []
    for title, key, higher, digits in SWEEP_METRICS:
        if key in OPTIONAL_SWEEP_KEYS and not any(p.get(key) is not None for c in cols for p in c.points.values()):
            continue
        rows = []
        for n in sessions:
            row = [cell(str(n))]
            b = cols[base].repeats(n, key)
            for i, c in enumerate(cols):
                row.append(_sweep_cell(c, n, key, digits, b if i != base else None, higher))
            rows.append(row)
        out.append({"title": f"{title} by concurrent sessions (delta vs {cols[base].label})",
                    "header": ["sessions", *[c.label for c in cols]], "rows": rows})
    return out


def _sweep_cell(c: Column, n: int, key: str, digits: int, baseline: list | None, higher: bool) -> dict:
    """One column's figure at ``n`` sessions with what qualifies it (distorted in transit, disputed
    counts, over the client's budget), its interval over repeats, and its delta against
    ``baseline``'s repeats (None: this column is the baseline)."""
    p = c.points.get(n)
    if n in c.failed_points:
        return cell("– (all requests failed)", cls="fail")
    if p is None or p.get(key) is None:
        return cell("–")
    val = fmt(p[key], digits) + (f" ({p['bound_kind']})" if key == "pct_of_bound" and p.get("bound_kind") else "")
    if c.value("throughput.sweep", "transport_distorted"):  # throughput.transport: a buffering hop
        val += " (distorted in transit)"
    if (c.checks.get("throughput.accounting") or {}).get("status") == "fail":
        val += " (token counts disputed)"
    if p.get("valid") is False:  # beyond the load generator's calibrated concurrency
        val += " (invalid: client over its error budget)"
    ci = bootstrap_mean(c.repeats(n, key))
    if ci is not None and ci.n > 1:  # the 95% interval of the mean over repeats
        val += f" [{fmt(ci.low, digits)}–{fmt(ci.high, digits)}]"
    if baseline is None:
        return cell(f"{val} (baseline)")
    dt, cls = delta_text(baseline, c.repeats(n, key), higher)
    return cell(f"{val} ({dt})" if dt else val, cls=cls)


def measurement_table(cols: list[Column], base: int) -> dict[str, Any]:
    rows = []
    for title, check, key, higher, digits in MEASUREMENTS:
        failed = [all_failed(c.checks.get(check)) for c in cols]
        vals = [None if f else c.value(check, key) for c, f in zip(cols, failed)]  # no request succeeded: no figure
        if all(c.value(check, key) is None for c in cols):
            continue
        row = [cell(title)]
        for i, (c, v) in enumerate(zip(cols, vals)):
            ch = c.checks.get(check) or {}
            if failed[i]:
                row.append(cell("– (all requests failed)", f"{c.path}/checks/{check}.json", "fail"))
                continue
            if v is None:
                row.append(cell("–" if not ch else f"– ({ch.get('status')})", f"{c.path}/checks/{check}.json" if ch else None))
                continue
            text = fmt(v, digits)
            bv = vals[base]
            if i != base and isinstance(bv, (int, float)) and bv and isinstance(v, (int, float)):
                pct = (v - bv) / bv * 100
                text += f" ({pct:+.1f}%)"
            row.append(cell(text, f"{c.path}/checks/{check}.json"))
        rows.append(row)
    return {"title": f"Engine-side measurements (delta vs {cols[base].label}; single measurements, noise not estimated)",
            "header": ["measurement", *[c.label for c in cols]], "rows": rows}


def needle_tables(cols: list[Column]) -> list[dict[str, Any]]:
    out = []
    for c in cols:
        nv = (c.checks.get("needles.retrieval") or {}).get("values") or {}
        table = nv.get("table")
        if not table or all_failed(c.checks.get("needles.retrieval")):  # no answer at all is no "not found"
            continue
        depths = nv.get("depths") or []
        rows = [[cell(f"{float(f):.0%} of context")] + [cell("found" if table[f].get(f"{d:g}") else "not found",
                                                             cls="pass" if table[f].get(f"{d:g}") else "fail")
                                                        for d in depths] for f in table]
        out.append({"title": f"Needles: {c.label} ({nv.get('format')}; {nv.get('found')}/{nv.get('cases')} found)",
                    "header": ["length \\ depth", *[f"depth {d:g}" for d in depths]], "rows": rows,
                    "href": f"{c.path}/evidence/needles.retrieval/needles.json"})
    return out


def build(cols: list[Column], base: int) -> dict[str, Any]:
    """Everything the Markdown and HTML renderers show."""
    return {"columns": cols, "baseline": cols[base].label, "fingerprint": fingerprint_table(cols),
            "verdicts": verdict_table(cols), "sweeps": sweep_tables(cols, base),
            "measurements": measurement_table(cols, base), "needles": needle_tables(cols),
            "recommendations": recommendations(cols), "findings": findings(cols),
            "spec": spec_decode_table(cols), "words": what_engines_said(cols), "reasons": why_not_qualified(cols)}


def write_compare(paths: list[Path], out_dir: Path, baseline: str | None = None) -> dict[str, Path]:
    """Write ``report.md``, ``index.html`` and plots comparing the runs.

    Returns:
        ``{"markdown": path, "html": path, **plots}``.

    Raises:
        UserError: an unreadable run directory, or a baseline that matches no run.
    """
    cols = load_columns(paths)
    base = pick_baseline(cols, baseline)
    data = build(cols, base)
    out_dir.mkdir(parents=True, exist_ok=True)
    images = write_plots(cols, out_dir)
    md = render_markdown(data, out_dir, images)
    atomic_write_text(out_dir / "report.md", md)
    atomic_write_text(out_dir / "index.html", render_html(data, out_dir, images))
    return {"markdown": out_dir / "report.md", "html": out_dir / "index.html",
            **{k: out_dir / v for k, v in images.items()}}
