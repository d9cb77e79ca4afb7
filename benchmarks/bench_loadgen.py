"""bakeoff's load generator vs ``vllm bench serve``, both judged against what the server sent.

Part 1: the synthetic SSE server (:mod:`bakeoff.loadgen.synth_server`, 50 ms TTFT, 10 ms ITL,
64 tokens) at 1, 32, 256, 512 concurrent streams. Each tool's TTFT and ITL are compared per
request with the server's own record of when it received the request and wrote each event
(``time.monotonic_ns()``; vLLM's ``perf_counter`` is the same CLOCK_MONOTONIC on Linux).
Requests are matched by ``X-Request-Id`` (vLLM sends ``--request-id-prefix`` + index).

Part 2: a real vLLM CPU server on a tiny Qwen3: output tokens/s of both tools on the same prompts
(sampled by vLLM's own ``get_samples``, random dataset, seed 0), the same request body, same
concurrency, same request count, 64 output tokens with ``ignore_eos``.

``vllm bench serve`` runs through its module in vLLM's environment (docs/field-notes.md): a
``FlexibleArgumentParser`` with ``vllm.benchmarks.serve.add_cli_args`` then
``vllm.benchmarks.serve.main(args)``, in a child process (this file with ``--vllm-child``).

Usage::

    .venv/bin/python benchmarks/bench_loadgen.py [--concurrency 1,32,256,512] [--real-concurrency 8,32]
        [--skip-real] [--out result.json]
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


def _vllm_args(args_json: str):
    """``vllm bench serve``'s own parser applied to a JSON list of arguments (in vLLM's env)."""
    from vllm.benchmarks import serve
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    serve.add_cli_args(parser)
    return parser.parse_args(json.loads(args_json))


def vllm_child(args_json: str, out_path: str) -> None:
    """Runs inside vLLM's environment: one ``vllm bench serve`` run, result JSON to ``out_path``."""
    from vllm.benchmarks import serve

    res = serve.main(_vllm_args(args_json))
    Path(out_path).write_text(json.dumps(res, default=str))


def vllm_samples_child(args_json: str, out_path: str) -> None:
    """Runs inside vLLM's environment: the prompts ``vllm bench serve`` would send for these
    arguments (its own ``get_samples`` with the same seed), as JSON, to ``out_path``."""
    from vllm.benchmarks.datasets import get_samples
    from vllm.tokenizers import get_tokenizer

    args = _vllm_args(args_json)
    samples = get_samples(args, get_tokenizer(args.tokenizer, tokenizer_mode=args.tokenizer_mode))
    Path(out_path).write_text(json.dumps([s.prompt for s in samples]))


def _in_vllm_env(python: str, mode: str, argv: list[str], what: str, timeout_s: float):
    """Run this file as ``mode`` (``--vllm-child`` / ``--vllm-samples``) in vLLM's environment
    with vLLM's benchmark arguments ``argv``; returns the JSON the child wrote."""
    out = tempfile.mktemp(suffix=".json")
    env = dict(os.environ, VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    p = subprocess.run([python, __file__, mode, json.dumps(argv), out], capture_output=True, text=True,
                       timeout=timeout_s, env=env)
    if p.returncode != 0 or not Path(out).exists():
        raise RuntimeError(f"{what} failed ({p.returncode}): {p.stderr[-3000:]}")
    try:
        return json.loads(Path(out).read_text())
    finally:
        Path(out).unlink()


def vllm_prompts(python: str, argv: list[str], timeout_s: float = 300) -> list:
    """The prompts vLLM's benchmark samples for ``argv`` (same order)."""
    return _in_vllm_env(python, "--vllm-samples", argv, "vLLM's get_samples", timeout_s)


def run_vllm_bench(python: str, argv: list[str], timeout_s: float = 900) -> dict:
    """One ``vllm bench serve`` run with ``argv``; its result JSON."""
    return _in_vllm_env(python, "--vllm-child", argv, "vllm bench serve", timeout_s)


def vllm_errors(res: dict, sent: dict[str, dict]) -> dict:
    """vLLM's per-request TTFT/ITL error against the server's records (ms).

    vLLM stamps its start (``perf_counter``) before aiohttp prepares and writes the request,
    and the true write time is not observable from outside, so its TTFT error is given as a
    lower bound (``ttft_error``: its first-token stamp - the server's first-token write, the
    same definition as bakeoff's) and an upper bound (``ttft_error_vs_receipt``: against the
    server's TTFT from its receipt stamp). ``receive_lag`` = server receipt - vLLM's start.
    """
    import numpy as np

    from bakeoff.loadgen.calibrate import _pcts

    ttft_err, ttft_rcpt, itl_err, recv_lag, tok_lag = [], [], [], [], []
    for text, ttft, itls, st in zip(res["generated_texts"], res["ttfts"], res["itls"], res["start_times"]):
        if not text or not text.startswith("[") or "]" not in text or not ttft:
            continue
        s = sent.get(text[1:text.index("]")])
        if s is None:
            continue
        ev = [a for _, a, k, kind in s["events"] if kind in ("text", "reasoning")]
        first_stamp_ns = (st + ttft) * 1e9
        ttft_err.append((first_stamp_ns - ev[0]) / 1e6)
        ttft_rcpt.append(ttft * 1e3 - (ev[0] - s["recv_ns"]) / 1e6)
        recv_lag.append((s["recv_ns"] / 1e9 - st) * 1e3)
        if len(itls) == len(ev) - 1:
            itl_err.extend(np.abs(np.asarray(itls) * 1e3 - np.diff(np.asarray(ev)) / 1e6))
            stamps = first_stamp_ns + np.concatenate([[0.0], np.cumsum(itls) * 1e9])
            tok_lag.extend((stamps - np.asarray(ev)) / 1e6)
    out = {"matched_requests": len(ttft_err)}
    out.update(_pcts(ttft_err, "ttft_error"))
    out.update(_pcts(ttft_rcpt, "ttft_error_vs_receipt"))
    out.update(_pcts(itl_err, "itl_abs_error"))
    out.update(_pcts(recv_lag, "receive_lag"))
    out.update(_pcts(tok_lag, "token_lag"))
    return out


def tokenizer_path() -> Path:
    """The tiny Qwen3 fixture (trained if built, else its untrained twin, built here)."""
    from bakeoff.models import fixtures

    if fixtures.is_built("tiny-qwen3"):
        return fixtures.folder_for("tiny-qwen3")
    return Path(fixtures.build("tiny-qwen3-untrained", log=lambda s: None))


def synthetic(vpy: str, tok: Path, levels: list[int], turns: int, output_tokens: int, procs_at: int,
              workers_at: int, reps: int = 1) -> list[dict]:
    """Each level ``reps`` times, the tools alternating; the run with the median bakeoff TTFT error
    p50 is kept for the table, every run's p50s are listed (a shared box is noisy)."""
    rows = []
    for c in levels:
        runs = [synthetic_once(vpy, tok, c, turns, output_tokens, procs_at, workers_at) for _ in range(reps)]
        runs.sort(key=lambda r: r["bakeoff"]["ttft_error_p50_ms"] or 0.0)
        row = dict(runs[len(runs) // 2])
        row["runs_ttft_error_p50_ms"] = {"bakeoff": [r["bakeoff"]["ttft_error_p50_ms"] for r in runs],
                                         "vllm_bench": [r["vllm_bench"]["ttft_error_p50_ms"] for r in runs]}
        rows.append(row)
        print(json.dumps({"concurrency": c, **row["runs_ttft_error_p50_ms"]}), flush=True)
    return rows


def synthetic_once(vpy: str, tok: Path, c: int, turns: int, output_tokens: int, procs_at: int,
                   workers_at: int) -> dict:
    from bakeoff.loadgen.calibrate import calibrate, server_slip
    from bakeoff.loadgen.synth_launch import SynthServer

    if True:
        workers = 2 if c >= workers_at else 1
        procs = 2 if c >= procs_at else 1
        with SynthServer({"ttft": {"ms": 50}, "itl": {"ms": 10}, "output_tokens": output_tokens},
                         workers=workers) as srv:
            ours = calibrate(c, server=srv, output_tokens=output_tokens, requests_per_session=turns, processes=procs,
                             measure_max_throughput=False)
            srv.reset()
            argv = ["--backend", "openai", "--base-url", srv.url, "--endpoint", "/v1/completions", "--model", "synth",
                    "--tokenizer", str(tok), "--dataset-name", "random", "--random-input-len", "32",
                    "--random-output-len", str(output_tokens), "--num-prompts", str(c * (turns - 1)),
                    "--max-concurrency", str(c), "--request-rate", "inf", "--ignore-eos", "--num-warmups", str(c),
                    "--disable-tqdm", "--save-detailed", "--request-id-prefix", f"vb{c}-", "--seed", "0",
                    "--ready-check-timeout-sec", "0", "--temperature", "0"]
            t0 = time.monotonic()
            vres = run_vllm_bench(vpy, argv)
            sent = srv.records(expect=c * turns)
            theirs = vllm_errors(vres, sent)
            theirs["output_tokens_per_s"] = vres.get("output_throughput")
            theirs["server_slip"] = server_slip({k: v for k, v in sent.items() if k.startswith(f"vb{c}-")})
            theirs["wall_s"] = time.monotonic() - t0
    return {"concurrency": c, "client_processes": procs, "server_workers": workers, "bakeoff": ours,
            "vllm_bench": theirs, "nominal_output_tokens_per_s": ours["nominal_output_tokens_per_s"]}


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
            prompts = vllm_prompts(vpy, argv)

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
                vres = run_vllm_bench(vpy, argv)
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
    return "-" if v is None else f"{v:.{nd}f}"


def table(syn: list[dict], real: list[dict]) -> str:
    lines = ["| streams | tool | TTFT err p50 ms | TTFT err p99 ms | TTFT err vs receipt p50 ms | ITL abs err p50 ms | "
             "ITL abs err p99 ms | server receive lag p50 ms | out tok/s (nominal) | server slip p50 ms |",
             "|" + "---|" * 10]
    for r in syn:
        for name, key in (("bakeoff", "bakeoff"), ("vllm bench serve", "vllm_bench")):
            x = r[key]
            lines.append(f"| {r['concurrency']} | {name} | {fmt(x['ttft_error_p50_ms'])} | {fmt(x['ttft_error_p99_ms'])} | "
                         f"{fmt(x['ttft_error_vs_receipt_p50_ms'])} | "
                         f"{fmt(x['itl_abs_error_p50_ms'])} | {fmt(x['itl_abs_error_p99_ms'])} | "
                         f"{fmt(x['receive_lag_p50_ms'])} | {fmt(x['output_tokens_per_s'], 0)} "
                         f"({fmt(r['nominal_output_tokens_per_s'], 0)}) | {fmt(x['server_slip']['slip_p50_ms'])} |")
    if real:
        lines += ["", "| streams (real vLLM) | bakeoff out tok/s (runs) | vllm bench out tok/s (runs) | ratio of medians | "
                  "ratio of means | paired ratio median |", "|---|---|---|---|---|---|"]
        for r in real:
            lines.append(f"| {r['concurrency']} | {' / '.join(f'{v:.0f}' for v in r['bakeoff_tokens_per_s'])} | "
                         f"{' / '.join(f'{v:.0f}' for v in r['vllm_tokens_per_s'])} | {r['ratio']:.3f} | "
                         f"{r['ratio_of_means']:.3f} | {r['paired_ratio_median']:.3f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", default="1,32,256,512")
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
    sys.path.insert(0, str(ROOT))
    from backends.vllm.backend import env_spec
    from bakeoff.host import envs

    vpy = str(envs.ensure(env_spec(False)))
    tok = tokenizer_path()
    syn = [] if a.skip_synthetic else synthetic(vpy, tok, [int(x) for x in a.concurrency.split(",")], a.turns,
                                                a.output_tokens, a.processes_at, a.server_workers_at, a.reps)
    real = [] if a.skip_real else real_server(vpy, tok, [int(x) for x in a.real_concurrency.split(",")],
                                              a.real_requests_per_session, a.output_tokens, a.real_reps or a.reps)
    print(table(syn, real))
    if a.out:
        Path(a.out).write_text(json.dumps({"synthetic": syn, "real": real, "model": str(tok)}, indent=1, default=str))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--vllm-child":
        vllm_child(sys.argv[2], sys.argv[3])
    elif len(sys.argv) > 1 and sys.argv[1] == "--vllm-samples":
        vllm_samples_child(sys.argv[2], sys.argv[3])
    else:
        main()
