"""The peer load generators of ``benchmarks/bench_loadgen.py``, matched to the synthetic server's records.

Peers: ``vllm bench serve`` (vLLM's environment, ``backends/vllm``), NVIDIA AIPerf and GuideLLM.
Each runs from its own environment through bakeoff's engine-environment mechanism
(``bakeoff/host/envs.py``: a venv under the cache keyed by its pins, created on first use and
reused; or this interpreter when it already imports the tool), as a child process, against the
same synthetic schedule as bakeoff's own generator. Nothing in bakeoff's core imports this file.

Matching a tool's requests to what the server sent (``SynthServer.records()``, keyed by the
server's request id): by the request id the tool sent (``X-Request-ID``) where its export lists
it (AIPerf), else by the server-issued token that opens every response text, ``[<request id>]``
(the id the tool sent in ``X-Request-Id`` for ``vllm bench serve``, the server's own serial for
GuideLLM, which sends none); see :func:`server_id`.

Clocks: the server stamps with ``time.monotonic_ns()``; vLLM and AIPerf's ``perf_counter`` is the
same CLOCK_MONOTONIC on Linux. GuideLLM stamps with ``time.time()`` and AIPerf's per-request
export with ``time.time_ns()``; those wall-clock stamps are moved onto CLOCK_MONOTONIC by the
offset :func:`clock_offset_ns` measures before and after the run (its drift is reported).

Every tool sends ``streams * turns`` requests with at most ``streams`` in flight; the first
``streams`` (one per stream: they open the connections) are left out of the figures: bakeoff's
turn 0, vLLM's ``--num-warmups``, AIPerf's ``--warmup-request-count``, and GuideLLM's first
``streams`` requests by start time (it has no request-count warm-up of that meaning).

This file also runs as vLLM's child (``--vllm-child`` / ``--vllm-samples``), so at module level it
imports the standard library only.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

AIPERF = "aiperf==0.13.0"
GUIDELLM = "guidellm==0.8.1"
TORCH = "torch==2.13.0"  # GuideLLM requires torch; this pin takes the local CPU wheel on CPU hosts
PEERS = ("vllm", "aiperf", "guidellm")
LABELS = {"bakeoff": "bakeoff", "vllm": "vllm bench serve", "aiperf": f"AIPerf {AIPERF.split('==')[1]}",
          "guidellm": f"GuideLLM {GUIDELLM.split('==')[1]}"}
CHILD_ENV = {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def env_spec(tool: str):
    """The :class:`bakeoff.host.envs.EnvSpec` of a peer (``vllm``: vLLM's CPU environment, the one
    the vLLM backend uses on a host without CUDA).

    Raises:
        ValueError: for a tool not in :data:`PEERS`.
    """
    from bakeoff.host import envs

    if tool == "vllm":
        from backends.vllm.backend import env_spec as vllm_spec

        return vllm_spec(False)
    if tool == "aiperf":
        return envs.EnvSpec("aiperf", (AIPERF,), modules=("aiperf",))
    if tool == "guidellm":
        return envs.EnvSpec("guidellm", (GUIDELLM, TORCH), notes=(f"{TORCH}: the CPU wheel on CPU hosts",),
                            modules=("guidellm", "torch"))
    raise ValueError(f"unknown peer {tool!r}; one of {', '.join(PEERS)}")


@dataclass
class Observation:
    """One request as a tool recorded it.

    Attributes:
        request_id: the id the tool sent with it (header or body), when its export lists it.
        text: the generated text, when its export lists it (opens with ``[<server id>]``).
        start_ns: the tool's request start stamp, CLOCK_MONOTONIC ns (None: not exported).
        first_token_ns: the tool's first-token stamp, CLOCK_MONOTONIC ns.
    """

    request_id: str | None
    text: str | None
    start_ns: int | None
    first_token_ns: int


def server_id(obs: Observation, sent: dict[str, dict]) -> str | None:
    """The server's id of ``obs``: its request id where the server has a record under it, else
    the ``[<id>]`` token that opens its text; None when neither names a record."""
    if obs.request_id and obs.request_id in sent:
        return obs.request_id
    text = obs.text or ""
    if text.startswith("[") and "]" in text:
        rid = text[1:text.index("]")]
        if rid in sent:
            return rid
    return None


def first_token_write_ns(rec: dict) -> int | None:
    """When the server wrote the first token of a record (CLOCK_MONOTONIC ns)."""
    return next((a for _, a, k, kind in rec["events"] if kind in ("text", "reasoning") and k), None)


def held_tokens_per_s(recs: list[dict]) -> float | None:
    """Streamed tokens/s the server wrote for these requests: their tokens over the span from the
    first one's receipt to the last token written (a tool slow to send the next request of a
    stream leaves the server idle and lowers it)."""
    toks = [(a, k) for r in recs for _, a, k, kind in r["events"] if kind in ("text", "reasoning") and k]
    if not toks:
        return None
    span_s = (max(a for a, _ in toks) - min(r["recv_ns"] for r in recs)) / 1e9
    return sum(k for _, k in toks) / span_s if span_s > 0 else None


def compare(observations: list[Observation], sent: dict[str, dict]) -> dict:
    """Each tool-recorded request against the server's record of it (ms).

    ``ttft_error`` = the tool's first-token stamp - the server's write of the first token (the
    definition of bakeoff's calibration); ``ttft_error_vs_receipt`` = the tool's TTFT - the
    server's TTFT from its receipt stamp (also counts the tool's lag between its start stamp and
    the write); ``receive_lag`` = server receipt - the tool's start stamp.

    Returns:
        ``matched_requests``, ``unmatched_requests``, percentiles of the three, the server's slip
        over the matched requests and ``held_output_tokens_per_s`` (:func:`held_tokens_per_s`).
    """
    from bakeoff.loadgen.calibrate import _pcts, server_slip

    ttft_err, ttft_rcpt, recv_lag, recs, unmatched = [], [], [], {}, 0
    for o in observations:
        rid = server_id(o, sent)
        first = first_token_write_ns(sent[rid]) if rid else None
        if first is None or rid in recs:
            unmatched += 1
            continue
        s = recs[rid] = sent[rid]
        ttft_err.append((o.first_token_ns - first) / 1e6)
        if o.start_ns is not None:
            ttft_rcpt.append((o.first_token_ns - o.start_ns - (first - s["recv_ns"])) / 1e6)
            recv_lag.append((s["recv_ns"] - o.start_ns) / 1e6)
    out: dict = {"matched_requests": len(recs), "unmatched_requests": unmatched}
    out.update(_pcts(ttft_err, "ttft_error"))
    out.update(_pcts(ttft_rcpt, "ttft_error_vs_receipt"))
    out.update(_pcts(recv_lag, "receive_lag"))
    out["server_slip"] = server_slip(recs)
    out["held_output_tokens_per_s"] = held_tokens_per_s(list(recs.values()))
    return out


def clock_offset_ns(samples: int = 9) -> int:
    """``time.time_ns() - time.monotonic_ns()`` now: the median of ``samples`` tight pairs."""
    vals = []
    for _ in range(samples):
        m0 = time.monotonic_ns()
        w = time.time_ns()
        m1 = time.monotonic_ns()
        vals.append(w - (m0 + m1) // 2)
    return sorted(vals)[len(vals) // 2]


_WORKDIRS: list[str] = []


def _workdir(prefix: str) -> str:
    """A temporary folder for one peer run's exports; :func:`run_peer` removes it afterwards."""
    work = tempfile.mkdtemp(prefix=prefix)
    _WORKDIRS.append(work)
    return work


def _child(cmd: list[str], what: str, timeout_s: float, cwd: str | None = None, offline: bool = True) -> str:
    env = dict(os.environ, **CHILD_ENV)
    if not offline:
        env.pop("HF_HUB_OFFLINE", None)
    p = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout_s, cwd=cwd, env=env)
    if p.returncode != 0:
        raise RuntimeError(f"{what} failed ({p.returncode}): {(p.stderr or p.stdout)[-3000:]}")
    return p.stdout


# --- vllm bench serve ---------------------------------------------------------------------------

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

    Path(out_path).write_text(json.dumps(serve.main(_vllm_args(args_json)), default=str))


def vllm_samples_child(args_json: str, out_path: str) -> None:
    """Runs inside vLLM's environment: the prompts ``vllm bench serve`` would send for these
    arguments (its own ``get_samples`` with the same seed), as JSON, to ``out_path``."""
    from vllm.benchmarks.datasets import get_samples
    from vllm.tokenizers import get_tokenizer

    args = _vllm_args(args_json)
    samples = get_samples(args, get_tokenizer(args.tokenizer, tokenizer_mode=args.tokenizer_mode))
    Path(out_path).write_text(json.dumps([s.prompt for s in samples]))


def in_vllm_env(python: str, mode: str, argv: list[str], what: str, timeout_s: float):
    """Run this file as ``mode`` (``--vllm-child`` / ``--vllm-samples``) in vLLM's environment
    with vLLM's benchmark arguments ``argv``; returns the JSON the child wrote."""
    fd, out = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        _child([python, __file__, mode, json.dumps(argv), out], what, timeout_s)
        return json.loads(Path(out).read_text())
    finally:
        Path(out).unlink(missing_ok=True)


def run_vllm(python: str, url: str, tok: Path, streams: int, turns: int, output_tokens: int,
             timeout_s: float = 900) -> tuple[list[Observation], dict]:
    """``vllm bench serve`` at ``streams``: its observations (matched by the ``[id]`` text token
    carrying its ``--request-id-prefix`` id) and its own figures."""
    argv = ["--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions", "--model", "synth",
            "--tokenizer", str(tok), "--dataset-name", "random", "--random-input-len", "32",
            "--random-output-len", str(output_tokens), "--num-prompts", str(streams * (turns - 1)),
            "--max-concurrency", str(streams), "--request-rate", "inf", "--ignore-eos", "--num-warmups", str(streams),
            "--disable-tqdm", "--save-detailed", "--request-id-prefix", f"vb{streams}-", "--seed", "0",
            "--ready-check-timeout-sec", "0", "--temperature", "0"]
    res = in_vllm_env(python, "--vllm-child", argv, "vllm bench serve", timeout_s)
    return vllm_observations(res), {"tool_output_tokens_per_s": res.get("output_throughput"),
                                    "tool_errors": res.get("failed")}


def vllm_observations(res: dict) -> list[Observation]:
    """Observations from ``vllm bench serve``'s ``--save-detailed`` result (``perf_counter`` s)."""
    return [Observation(None, text, int(st * 1e9), int((st + ttft) * 1e9))
            for text, ttft, st in zip(res["generated_texts"], res["ttfts"], res["start_times"]) if text and ttft]


# --- NVIDIA AIPerf ------------------------------------------------------------------------------

def run_aiperf(python: str, url: str, tok: Path, streams: int, turns: int, output_tokens: int,
               timeout_s: float = 900) -> tuple[list[Observation], dict]:
    """``aiperf profile`` at ``streams`` (its defaults otherwise: worker count, ``records``
    export level): observations from ``profile_export.jsonl``'s profiling phase, matched by
    the ``X-Request-ID`` it sent. Its per-request stamps are wall clock: ``request_start_ns``
    (``time.time_ns()``, taken with its ``perf_counter`` start) + its ``time_to_first_token``."""
    work = _workdir("bench-aiperf-")
    cmd = [python, "-m", "aiperf", "profile", "--model", "synth", "--url", url, "--endpoint-type", "completions",
           "--streaming", "--tokenizer", str(tok), "--concurrency", str(streams),
           "--request-count", str(streams * (turns - 1)), "--warmup-request-count", str(streams),
           "--synthetic-input-tokens-mean", "32", "--output-tokens-mean", str(output_tokens),
           "--extra-inputs", "ignore_eos:true", "--random-seed", "0", "--ui-type", "none",
           "--no-server-metrics", "--no-gpu-telemetry", "--artifact-dir", work]
    off0 = clock_offset_ns()
    # no HF_HUB_OFFLINE: AIPerf 0.13.0 then looks a local tokenizer folder up in the hub cache
    # and fails ("Repo id must be in the form ..."); a local folder loads without the network
    _child(cmd, "aiperf profile", timeout_s, cwd=work, offline=False)
    off1 = clock_offset_ns()
    obs, errors = aiperf_observations((Path(work) / "profile_export.jsonl").read_text(), (off0 + off1) // 2)
    agg = json.loads((Path(work) / "profile_export_aiperf.json").read_text())
    tput = (agg.get("output_token_throughput") or {}).get("avg")
    return obs, {"tool_output_tokens_per_s": tput, "tool_errors": errors, "clock_drift_ms": (off1 - off0) / 1e6}


def aiperf_observations(jsonl: str, offset_ns: int) -> tuple[list[Observation], int]:
    """Observations of the profiling phase from AIPerf's ``profile_export.jsonl`` (wall-clock
    stamps moved onto CLOCK_MONOTONIC by ``offset_ns`` = wall - monotonic), and the count of
    its profiling records that failed or have no TTFT."""
    obs, errors = [], 0
    for line in jsonl.splitlines():
        r = json.loads(line)
        m = r["metadata"]
        if m.get("benchmark_phase") != "profiling":
            continue
        ttft = (r.get("metrics") or {}).get("time_to_first_token")
        if r.get("error") or not ttft:
            errors += 1
            continue
        start = m["request_start_ns"] - offset_ns
        obs.append(Observation(m["x_request_id"], None, start, start + int(ttft["value"] * 1e6)))
    return obs, errors


# --- GuideLLM -----------------------------------------------------------------------------------

def run_guidellm(python: str, url: str, tok: Path, streams: int, turns: int, output_tokens: int,
                 timeout_s: float = 900) -> tuple[list[Observation], dict]:
    """``guidellm run`` with a concurrent profile of ``streams`` (its defaults otherwise):
    observations from its JSON report (every request's text and timings), matched by the
    ``[id]`` token the server put in the text. Its stamps are ``time.time()``: ``request_start``
    (first header write) and ``first_token_iteration`` (the first line carrying a token)."""
    work = _workdir("bench-guidellm-")
    report = Path(work) / "benchmarks.json"
    cmd = [python, "-m", "guidellm", "run",
           "--backend", f"kind=openai_http,target={url},model=synth,request_format=/v1/completions",
           "--profile", f"kind=concurrent,streams={streams}",
           "--constraint", f"kind=max_requests,count={streams * turns}",
           "--tokenizer", f"kind=huggingface_auto,model={tok}",
           "--data", f"kind=synthetic_text,prompt_tokens=32,output_tokens={output_tokens}",
           "--output", f"kind=json,path={report}", "--disable-console-interactive"]
    off0 = clock_offset_ns()
    _child(cmd, "guidellm run", timeout_s, cwd=work)
    off1 = clock_offset_ns()
    bench = json.loads(report.read_text())["benchmarks"][0]
    obs = guidellm_observations(bench, streams, (off0 + off1) // 2)
    totals = (bench.get("metrics") or {}).get("output_tokens_per_second", {})
    tput = ((totals.get("successful") or {}).get("mean")) if isinstance(totals, dict) else None
    return obs, {"tool_output_tokens_per_s": tput, "tool_errors": len(bench["requests"].get("errored") or []),
                 "clock_drift_ms": (off1 - off0) / 1e6}


def guidellm_observations(bench: dict, skip_first: int, offset_ns: int) -> list[Observation]:
    """Observations from one benchmark of GuideLLM's JSON report: its successful requests with a
    first token, by start time, less the first ``skip_first`` (wall-clock ``time.time()``
    stamps moved onto CLOCK_MONOTONIC by ``offset_ns`` = wall - monotonic)."""
    reqs = sorted((r for r in bench["requests"]["successful"] if r["info"]["timings"].get("first_token_iteration")),
                  key=lambda r: r["info"]["timings"]["request_start"])
    return [Observation(None, r.get("output"), int(r["info"]["timings"]["request_start"] * 1e9) - offset_ns,
                        int(r["info"]["timings"]["first_token_iteration"] * 1e9) - offset_ns)
            for r in reqs[skip_first:]]


RUNNERS = {"vllm": run_vllm, "aiperf": run_aiperf, "guidellm": run_guidellm}


def run_peer(tool: str, python: str, srv, tok: Path, streams: int, turns: int, output_tokens: int) -> dict:
    """One peer run against the started ``SynthServer`` ``srv`` (its records reset first):
    :func:`compare`'s figures plus the tool's own, ``wall_s``, or ``{"error": ...}``."""
    srv.reset()
    t0 = time.monotonic()
    try:
        obs, own = RUNNERS[tool](python, srv.url, tok, streams, turns, output_tokens)
    except (RuntimeError, OSError, ValueError, KeyError, subprocess.TimeoutExpired) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"[-2000:], "wall_s": time.monotonic() - t0}
    finally:
        while _WORKDIRS:
            shutil.rmtree(_WORKDIRS.pop(), ignore_errors=True)
    out = compare(obs, srv.records(expect=streams * turns))
    out.update(own)
    out["wall_s"] = time.monotonic() - t0
    return out


if __name__ == "__main__":
    if sys.argv[1] == "--vllm-child":
        vllm_child(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "--vllm-samples":
        vllm_samples_child(sys.argv[2], sys.argv[3])
