"""Soak: qualify one backend N times in a row in one process, then report what accumulated.

Each run is the evaluations suite (``pytest evaluations/``) started in-process with
``pytest.main``, so this process *is* the parent of every engine: anything the plugin, the
load generator or a backend leaks (memory, file descriptors, threads, child processes) piles
up here. After each run it records the parent's RSS, open file descriptors and threads, and
the engine processes still alive (found by ``BAKEOFF_ENGINE_WORKDIR``, which every engine
process carries) or still children of this process.

Reported: RSS growth between the 2nd and the Nth run (the 1st run pays for imports and
caches), fd and thread growth, leftover processes, each run's verdict and duration. Exits 1
when a process is left behind (or a run did not produce a verdict), else 0.

Usage::

    # the full soak (about 20 x 3-4 min with vLLM on a 2-core CPU host)
    .venv/bin/python benchmarks/soak.py --backend vllm --runs 20 --model fixture:tiny-qwen3-untrained
    # a short proof
    .venv/bin/python benchmarks/soak.py --runs 3 --out soak.json
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]


def engine_processes(root: Path) -> list[dict]:
    """Live engine processes whose ``BAKEOFF_ENGINE_WORKDIR`` is under ``root`` or that are our children."""
    me = psutil.Process()
    children = {p.pid for p in me.children(recursive=True)}
    out = []
    for p in psutil.process_iter(["pid", "name", "status"]):
        try:
            wd = p.environ().get("BAKEOFF_ENGINE_WORKDIR", "") if p.pid != me.pid else ""
            if p.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            if wd.startswith(str(root)) or p.pid in children:
                out.append({"pid": p.pid, "name": p.info["name"], "cmd": " ".join(p.cmdline())[:120]})
        except (psutil.Error, OSError):
            continue
    return out


def one_run(args: argparse.Namespace, art: Path, i: int) -> dict:
    """One in-process suite run; returns its figures (measured after the run, after a GC)."""
    import pytest

    before = {p.name for p in (art / "runs").iterdir()} if (art / "runs").is_dir() else set()
    cmd = [str(ROOT / "evaluations"), "-p", "no:cacheprovider", "-q", "--rootdir", str(ROOT), "--backend", args.backend,
           "--model", args.model, "--artifacts", str(art), "--profile", args.profile, *args.pytest_args]
    t0 = time.monotonic()
    sink = io.StringIO()
    with contextlib.redirect_stdout(sink):
        rc = pytest.main(cmd)
    (art / f"run{i}.out").write_text(sink.getvalue())
    wall_s = time.monotonic() - t0
    new = sorted({p.name for p in (art / "runs").iterdir()} - before) if (art / "runs").is_dir() else []
    status = "no run"
    if new:
        try:
            status = json.loads((art / "runs" / new[0] / "verdict.json").read_text())["status"]
        except (OSError, ValueError, KeyError):
            status = "unreadable verdict"
    time.sleep(args.settle_s)  # let the engine's reaped children disappear from the process table
    gc.collect()
    me = psutil.Process()
    return {"run": i, "pytest_exit": int(rc), "status": status, "wall_s": round(wall_s, 1),
            "rss_mib": round(me.memory_info().rss / 2**20, 1), "fds": me.num_fds(), "threads": me.num_threads(),
            "left": engine_processes(art)}


def table(rows: list[dict]) -> str:
    cols = ("run", "status", "pytest_exit", "wall_s", "rss_mib", "fds", "threads", "left")
    lines = [" | ".join(f"{c:>11}" for c in cols)]
    for r in rows:
        lines.append(" | ".join(f"{(len(r[c]) if c == 'left' else r[c])!s:>11}" for c in cols))
    return "\n".join(lines)


def summary(rows: list[dict]) -> dict:
    """Growth between the 2nd and the last run (the 1st pays for imports and caches)."""
    base = rows[1] if len(rows) > 1 else rows[0]
    last = rows[-1]
    return {"runs": len(rows), "rss_growth_mib_2nd_to_last": round(last["rss_mib"] - base["rss_mib"], 1),
            "rss_growth_pct_2nd_to_last": round(100 * (last["rss_mib"] - base["rss_mib"]) / base["rss_mib"], 2),
            "fd_growth_2nd_to_last": last["fds"] - base["fds"], "thread_growth_2nd_to_last": last["threads"] - base["threads"],
            "rss_mib_first": rows[0]["rss_mib"], "rss_mib_last": last["rss_mib"],
            "processes_left": last["left"], "statuses": [r["status"] for r in rows]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="vllm")
    ap.add_argument("--model", default="fixture:tiny-qwen3-untrained")
    ap.add_argument("--runs", "-n", type=int, default=20)
    ap.add_argument("--profile", default="quick")
    ap.add_argument("--artifacts", default=None, help="where the runs go (default: a temporary folder)")
    ap.add_argument("--settle-s", type=float, default=3.0, help="seconds to wait after each run before measuring")
    ap.add_argument("--out", default=None, help="also write the figures as JSON here")
    ap.add_argument("pytest_args", nargs="*", help="more pytest arguments after --, e.g. -- -k 'test_load or test_sweep'")
    args = ap.parse_args(argv)
    if args.runs < 1:
        ap.error("--runs must be at least 1")
    os.chdir(ROOT)
    sys.path.insert(0, str(ROOT))
    art = Path(args.artifacts or tempfile.mkdtemp(prefix="bakeoff-soak-"))
    art.mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(1, args.runs + 1):
        rows.append(one_run(args, art, i))
        r = rows[-1]
        print(f"run {i}/{args.runs}: {r['status']} in {r['wall_s']} s; RSS {r['rss_mib']} MiB, {r['fds']} fds, "
              f"{r['threads']} threads, {len(r['left'])} processes left", file=sys.stderr, flush=True)
    s = summary(rows)
    print(table(rows))
    print(f"\nRSS growth run 2 -> run {len(rows)}: {s['rss_growth_mib_2nd_to_last']} MiB "
          f"({s['rss_growth_pct_2nd_to_last']:+.2f}%); fds {s['fd_growth_2nd_to_last']:+d}; "
          f"threads {s['thread_growth_2nd_to_last']:+d}; processes left: {len(s['processes_left'])}")
    for p in s["processes_left"]:
        print(f"  left: pid {p['pid']} {p['name']}: {p['cmd']}")
    print(f"artifacts: {art}")
    if args.out:
        Path(args.out).write_text(json.dumps({"summary": s, "runs": rows}, indent=2))
    failed = [r for r in rows if r["left"] or r["status"] in ("no run", "unreadable verdict")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
