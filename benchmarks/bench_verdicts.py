"""Verdict stability: ``bakeoff qualify`` N times on a freshly built fixture; print every verdict.

The product is the verdict: the same model and engine must get the same verdict on every
repeat. This builds the fixture fresh (a temporary ``BAKEOFF_CACHE`` whose ``envs`` folder is
linked to the usual cache, so engine environments are reused but fixtures, ORT exports and
reference outputs are not), then runs ``bakeoff qualify --backends transformers,vllm,ort-genai``
``--repeats`` times and prints, per run and backend: the status, the failed checks, the
reference agreement's exact / tie / real divergence counts and the McNemar decision.

Exit status 0 when every repeat gave every backend the same status, 1 otherwise.

Usage::

    .venv/bin/python benchmarks/bench_verdicts.py                 # 5 repeats, ~30 min on 2 cores
    .venv/bin/python benchmarks/bench_verdicts.py --repeats 2 --backends transformers,vllm
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _usual_cache() -> Path:
    return Path(os.environ.get("BAKEOFF_CACHE") or Path.home() / ".cache" / "bakeoff")


def _row(v: dict) -> dict:
    checks = {c["name"]: c for c in v["checks"]}
    agr = (checks.get("sanity.reference_agreement") or {}).get("values") or {}
    ka = (checks.get("sanity.known_answers") or {}).get("values") or {}
    d = agr.get("decision") or {}
    judge = (checks.get("sanity.nll_judge") or {}).get("values") or {}
    return {"backend": v["backend"], "status": v["status"], "failed": [r.split(":")[0] for r in v.get("reasons", [])],
            "accuracy": ka.get("accuracy"), "exact": agr.get("exact"), "tie": agr.get("tie_divergences"),
            "real": agr.get("real_divergences"), "undetermined": agr.get("undetermined_divergences"),
            "p": d.get("p_value"), "diff": d.get("difference"), "kl": judge.get("mean_kl_nats"),
            "top1": judge.get("top1_agreement")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--backends", default="transformers,vllm,ort-genai")
    ap.add_argument("--model", default="fixture:tiny-qwen3")
    ap.add_argument("--keep", action="store_true", help="keep the temporary cache and artifacts")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="bench-verdicts-"))
    cache = tmp / "cache"
    cache.mkdir()
    envs = _usual_cache() / "envs"
    envs.mkdir(parents=True, exist_ok=True)
    (cache / "envs").symlink_to(envs)
    env = dict(os.environ, BAKEOFF_CACHE=str(cache))
    cpu = "avx512f" if "avx512f" in Path("/proc/cpuinfo").read_text() else "avx2-only"
    print(f"# bench_verdicts: {args.repeats} x qualify --backends {args.backends} --model {args.model} "
          f"(fresh fixture in {cache}; CPU {cpu})", flush=True)
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-m", "cli.main", "fixture", "build", args.model.removeprefix("fixture:")],
                   cwd=ROOT, env=env, check=True) if args.model.startswith("fixture:") else None
    print(f"# fixture built in {time.monotonic() - t0:.0f} s", flush=True)
    rows: list[dict] = []
    for i in range(args.repeats):
        art = tmp / f"art{i}"
        t1 = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "cli.main", "qualify", "--backends", args.backends,
                               "--model", args.model, "--artifacts", str(art)], cwd=ROOT, env=env,
                              capture_output=True, text=True)
        verdicts = [json.loads(p.read_text()) for p in sorted((art / "runs").glob("*/verdict.json"))]
        if not verdicts:
            print(f"repeat {i + 1}: no verdict (exit {proc.returncode})\n{proc.stderr[-2000:]}", flush=True)
            return 1
        for v in verdicts:
            r = {"repeat": i + 1, **_row(v)}
            rows.append(r)
            print(f"repeat {r['repeat']} {r['backend']:<13} {r['status']:<13} accuracy {r['accuracy']} "
                  f"exact {r['exact']} tie {r['tie']} real {r['real']} undetermined {r['undetermined']} "
                  f"diff {r['diff']} p {r['p']} top1 {r['top1']} KL {r['kl']} failed {r['failed']}", flush=True)
        print(f"# repeat {i + 1} took {time.monotonic() - t1:.0f} s", flush=True)
    by_backend: dict[str, set] = {}
    for r in rows:
        by_backend.setdefault(r["backend"], set()).add(r["status"])
    same = all(len(s) == 1 for s in by_backend.values())
    summary = {b: sorted(s) for b, s in by_backend.items()}
    print(f"# statuses per backend over {args.repeats} repeats: {summary} -> "
          f"{'identical' if same else 'NOT identical'}; total {time.monotonic() - t0:.0f} s", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2))
    if not args.keep:
        import shutil

        (cache / "envs").unlink()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
