"""The Markdown of ``bakeoff compare`` (``report.md``): the tables :func:`bakeoff.reporting.compare.build`
makes, every cell escaped (a label ``*x*`` or ``<b>x</b>``, an engine's ``[grid](...)`` stay literal),
links relative to the report folder; the HTML of the same data is :mod:`bakeoff.reporting.compare_html`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any
from urllib.parse import quote

from bakeoff.reporting.compare_tables import md_escape, words_markdown


def link(path: str | Path, out_dir: Path) -> str:
    """``path`` relative to the report folder, percent-encoded (a space is ``%20``): Markdown ends
    a link target at a space, and an HTML ``href`` must not hold one either."""
    return quote(os.path.relpath(path, out_dir).replace(os.sep, "/"))


def _md_cell(c: dict[str, Any], out_dir: Path) -> str:
    """A cell as Markdown: its text escaped (a label ``*x*`` or ``<b>x</b>``, a CPU name with a
    newline, an engine's ``[grid](...)`` stay literal), bold where it fails, a link where it has one."""
    text = md_escape(c["text"])
    if c.get("cls") in ("fail", "error", "disqualified", "worse"):
        text = f"**{text}**"
    if c.get("href"):
        return f"[{text}]({link(c['href'], out_dir)})"
    return text


def reasons_markdown(entries: list[dict[str, Any]], out_dir: Path) -> str:
    """The "Why not qualified" section: per run that is not qualified, its status and every reason
    whole (:func:`bakeoff.reporting.compare_tables.why_not_qualified`), all escaped."""
    lines = ["## Why not qualified", ""]
    for e in entries:
        lines.append(f"- **{md_escape(e['run'])}** ({_md_cell({'text': e['run_id'], 'href': e['href']}, out_dir)}): "
                     f"{md_escape(e['status'])}")
        lines += [f"  - {md_escape(r)}" for r in e["reasons"]]
    return "\n".join(lines) + "\n"


def md_table(t: dict[str, Any], out_dir: Path) -> str:
    """A table of :func:`bakeoff.reporting.compare.build` (``title``, ``header``, ``rows`` of cells)
    as a ``###`` heading and a Markdown table."""
    lines = [f"### {md_escape(t['title'])}", "", "| " + " | ".join(md_escape(h) for h in t["header"]) + " |",
             "|" + "---|" * len(t["header"])]
    lines += ["| " + " | ".join(_md_cell(c, out_dir) for c in row) + " |" for row in t["rows"]]
    return "\n".join(lines) + "\n"


def render_markdown(data: dict[str, Any], out_dir: Path, images: dict[str, str]) -> str:
    """The whole ``report.md``: ``data`` of :func:`bakeoff.reporting.compare.build`, ``images`` the
    plots by name (file names in ``out_dir``)."""
    parts = [f"# bakeoff compare\n\n{len(data['columns'])} runs; baseline: **{md_escape(data['baseline'])}**. A difference is "
             "called *real* only when the 95% bootstrap interval of the difference (over `--repeats`) excludes 0; "
             "otherwise *within noise*; with 1 repeat the noise is unknown.\n",
             "## Recommendation per objective\n\n| objective | run | why |\n|---|---|---|"]
    parts += [f"| {md_escape(r['objective'])} | {_md_cell({'text': r['run'], 'href': r.get('href')}, out_dir)} | {md_escape(r['why'])} |"
              for r in data["recommendations"]]
    if data["findings"]:  # built from labels, options and run ids: every one escaped
        parts.append("\n## Option effects (runs one option apart)\n")
        parts += [f"- {md_escape(f)}" for f in data["findings"]] + [""]
    parts.append("\n## Machines and configs\n\n" + md_table(data["fingerprint"], out_dir))
    parts.append("## Verdicts\n\n" + md_table(data["verdicts"], out_dir))
    if data["reasons"]:
        parts.append(reasons_markdown(data["reasons"], out_dir))
    if data["words"]:
        parts.append(words_markdown(data["words"]))
    parts.append("## Throughput and latency\n")
    parts += [md_table(t, out_dir) for t in data["sweeps"]]
    parts += [f"![{name}]({quote(rel)})\n" for name, rel in images.items() if name != "needles"]
    if data["measurements"]["rows"]:
        parts.append("## Engine-side measurements\n\n" + md_table(data["measurements"], out_dir))
    if data["spec"]:
        parts.append("## Speculative decoding acceptance\n\n" + md_table(data["spec"], out_dir))
    if data["needles"]:
        parts.append("## Long-context needles\n")
        parts += [md_table(t, out_dir) for t in data["needles"]]
        if "needles" in images:
            parts.append(f"![needles]({quote(images['needles'])})\n")
    return "\n".join(parts) + "\n"
