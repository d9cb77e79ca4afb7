"""Plots (matplotlib, Agg) and the static HTML page (jinja2) of ``bakeoff compare``.

Plots: aggregate output tok/s vs sessions and TTFT p50/p99 vs sessions, one line per
column (error bars: the 95% bootstrap interval over repeats where there are repeats); the
needle heat map, one panel per run (found = 1, not found = 0).
"""

from __future__ import annotations

import math

import os
from pathlib import Path
from typing import Any
from urllib.parse import quote

from jinja2 import Environment, select_autoescape

from bakeoff.analysis.noise import bootstrap_mean
from bakeoff.reporting.compare_tables import all_failed

PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>bakeoff compare</title>
<style>
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }
table { border-collapse: collapse; margin: .5em 0 1.5em; font-size: 13px; }
th, td { border: 1px solid #ccc; padding: 3px 8px; text-align: left; vertical-align: top; }
th { background: #f2f2f2; }
td.pass, td.qualified, td.better { background: #e7f6e7; }
td.fail, td.error, td.disqualified, td.worse { background: #fbe3e3; }
td.skip, td.noise { background: #f6f6e0; }
td.unavailable, td.incomplete { background: #eee; }
img { max-width: 900px; display: block; margin: .5em 0 1.5em; border: 1px solid #ddd; }
</style></head><body>
<h1>bakeoff compare</h1>
<p>{{ data.columns|length }} runs; baseline: <b>{{ data.baseline }}</b>. A difference is called <i>real</i> only when the
95% bootstrap interval of the difference (over <code>--repeats</code>) excludes 0, otherwise <i>within noise</i>;
with 1 repeat the noise is unknown.</p>
<h2>Recommendation per objective</h2>
<table id="recommendations"><tr><th>objective</th><th>run</th><th>why</th></tr>
{% for r in data.recommendations %}<tr><td>{{ r.objective }}</td><td>{% if r.href %}<a href="{{ rel(r.href) }}">{{ r.run }}</a>{% else %}{{ r.run }}{% endif %}</td><td>{{ r.why }}</td></tr>
{% endfor %}</table>
{% if data.findings %}<h2>Option effects (runs one option apart)</h2>
<ul id="findings">{% for f in data.findings %}<li>{{ f }}</li>{% endfor %}</ul>{% endif %}
{% macro table(t, id) %}<h3>{{ t.title }}</h3>
<table id="{{ id }}"><tr>{% for h in t.header %}<th>{{ h }}</th>{% endfor %}</tr>
{% for row in t.rows %}<tr>{% for c in row %}<td class="{{ c.cls }}"{% if c.title %} title="{{ c.title }}"{% endif %}>{% if c.href %}<a href="{{ rel(c.href) }}">{{ c.text }}</a>{% else %}{{ c.text }}{% endif %}</td>{% endfor %}</tr>
{% endfor %}</table>{% endmacro %}
<h2>Machines and configs</h2>
{{ table(data.fingerprint, "fingerprint") }}
<h2>Verdicts</h2>
{{ table(data.verdicts, "verdicts") }}
{% if data.reasons %}<h2>Why not qualified</h2>
<ul id="reasons">{% for e in data.reasons %}<li><b>{{ e.run }}</b> (<a href="{{ rel(e.href) }}">{{ e.run_id }}</a>): {{ e.status }}
<ul>{% for r in e.reasons %}<li>{{ r }}</li>{% endfor %}</ul></li>
{% endfor %}</ul>{% endif %}
{% if data.words %}<h3>What the engines said (each failed check's own words)</h3>
<ul id="engine-words">{% for w in data.words %}<li><b>{{ w.run }}</b> · <a href="{{ rel(w.href) }}"><code>{{ w.check }}</code></a> · {{ w["class"] }}: {{ w.words }}</li>
{% endfor %}</ul>{% endif %}
<h2>Throughput and latency</h2>
{% for t in data.sweeps %}{{ table(t, "sweep-" ~ loop.index) }}{% endfor %}
{% for name, src in images.items() if name != "needles" %}<img id="plot-{{ name }}" src="{{ src | urlencode }}" alt="{{ name }}">{% endfor %}
{% if data.measurements.rows %}<h2>Engine-side measurements</h2>{{ table(data.measurements, "measurements") }}{% endif %}
{% if data.spec %}<h2>Speculative decoding acceptance</h2>{{ table(data.spec, "spec-decode") }}{% endif %}
{% if data.needles %}<h2>Long-context needles</h2>
{% for t in data.needles %}{{ table(t, "needles-" ~ loop.index) }}{% endfor %}
{% if images.needles %}<img id="plot-needles" src="{{ images.needles | urlencode }}" alt="needle heat map">{% endif %}{% endif %}
</body></html>
"""


def render_html(data: dict[str, Any], out_dir: Path, images: dict[str, str]) -> str:
    """The static page: the same tables as the Markdown, links relative to ``out_dir``."""
    env = Environment(autoescape=select_autoescape(default=True), trim_blocks=True, lstrip_blocks=True)
    return env.from_string(PAGE).render(data=data, images=images, rel=lambda p: quote(os.path.relpath(p, out_dir).replace(os.sep, "/")))


def _series(col, key: str) -> tuple[list[int], list[float], list[float], list[float]]:
    xs, ys, lo, hi = [], [], [], []
    for n in sorted(col.points):
        v = col.points[n].get(key)
        try:  # a damaged run's point (session count <= 0, a non-number, an int past float) is not drawn:
            ok = n > 0 and math.isfinite(float(v))  # a log axis of no positive values stops matplotlib
        except (TypeError, ValueError, OverflowError):
            ok = False
        if not ok:
            continue
        ci = bootstrap_mean(col.repeats(n, key))
        xs.append(n)
        ys.append(v)
        lo.append(max(0.0, v - ci.low) if ci and ci.n > 1 else 0.0)
        hi.append(max(0.0, ci.high - v) if ci and ci.n > 1 else 0.0)
    return xs, ys, lo, hi


def _plain(label: str) -> str:
    """A column label as matplotlib text: its ``$`` escaped (a ``$\\frac$`` in a label is no mathtext
    that stops the plot)."""
    return label.replace("$", r"\$")


def _session_ticks(ax, cols) -> None:
    """Session counts as plain tick labels on a log axis (no minor labels)."""
    from matplotlib.ticker import NullFormatter

    ns = sorted({n for c in cols for n in c.points if isinstance(n, (int, float)) and n > 0})
    ax.set_xticks(ns, labels=[str(n) for n in ns])
    ax.xaxis.set_minor_formatter(NullFormatter())


def write_plots(cols, out_dir: Path) -> dict[str, str]:
    """Write the PNG plots; returns ``{name: file name}`` (empty without matplotlib or data).

    matplotlib is imported here only, so the rest of bakeoff does not need it.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return {}
    return {**_sweep_plots(plt, cols, out_dir), **_needle_plot(plt, cols, out_dir)}


def _sweep_plots(plt, cols, out_dir: Path) -> dict[str, str]:
    """Throughput and TTFT (p50, p99) against sessions, one line per column; {} without a drawable point."""
    images: dict[str, str] = {}
    if not any(_series(c, "output_tokens_per_s")[0] for c in cols):  # a drawable point (sessions > 0, a finite figure)
        return images
    fig, ax = plt.subplots(figsize=(7, 4))
    for c in cols:
        xs, ys, lo, hi = _series(c, "output_tokens_per_s")
        if xs:
            ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", capsize=3, label=_plain(c.label))
    ax.set(xscale="log", xlabel="concurrent sessions", ylabel="aggregate output tok/s",
           title="Aggregate output throughput vs sessions")
    _session_ticks(ax, cols)
    ax.grid(alpha=.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_dir / "throughput.png", dpi=110)
    plt.close(fig)
    images["throughput"] = "throughput.png"
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, title in ((axes[0], "ttft_p50_ms", "TTFT p50"), (axes[1], "ttft_p99_ms", "TTFT p99")):
        for c in cols:
            xs, ys, lo, hi = _series(c, key)
            if xs:
                ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", capsize=3, label=_plain(c.label))
        ax.set(xscale="log", xlabel="concurrent sessions", ylabel="ms", title=f"{title} vs sessions")
        _session_ticks(ax, cols)
        ax.grid(alpha=.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_dir / "ttft.png", dpi=110)
    plt.close(fig)
    images["ttft"] = "ttft.png"
    return images


def _needle_plot(plt, cols, out_dir: Path) -> dict[str, str]:
    """Needle retrieval per column (context used x depth, green = found); {} without a needle table."""
    needles = [(c, (c.checks.get("needles.retrieval") or {}).get("values") or {}) for c in cols]
    needles = [(c, v) for c, v in needles if v.get("table") and not all_failed(c.checks.get("needles.retrieval"))]
    if not needles:
        return {}
    import numpy as np

    fig, axes = plt.subplots(1, len(needles), figsize=(3.2 * len(needles) + 1, 3), squeeze=False)
    for ax, (c, v) in zip(axes[0], needles):
        fr, dp = list(v["table"]), v.get("depths") or []
        grid = np.array([[1.0 if v["table"][f].get(f"{d:g}") else 0.0 for d in dp] for f in fr])
        ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
        ax.set_xticks(range(len(dp)), labels=[f"{d:g}" for d in dp])
        ax.set_yticks(range(len(fr)), labels=[f"{float(f):.0%}" for f in fr])
        ax.set(xlabel="needle depth", ylabel="context used", title=_plain(c.label[:40]))
        ax.title.set_fontsize(8)
    fig.suptitle("Needle retrieval (green = found)", fontsize=10)
    fig.tight_layout()
    fig.savefig(out_dir / "needles.png", dpi=110)
    plt.close(fig)
    return {"needles": "needles.png"}
