"""The engines' own tools of ``benchmarks/bench_fidelity.py``, driven from bakeoff's side.

Each :class:`ToolSide` holds one long-lived process in the engine's environment (the model loaded
once, or for vLLM the benchmark module imported once) and runs one measurement per call, on the
export / server the started backend uses and over bakeoff's own prompts (module docstring of
``benchmarks/bench_fidelity.py``). The loops themselves are ``benchmarks/fidelity_bare.py`` and,
for ORT GenAI, ``benchmarks/ort_genai_bare.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

BARE = Path(__file__).resolve().parent / "fidelity_bare.py"
TOOLS = {
    "vllm": "vllm bench serve against bakeoff's server",
    "ort-genai": "bare og.Generator batch per turn / og.Engine closed loop on the worker's export, the better "
                 "chosen in the untimed run",
    "openvino": "bare ContinuousBatchingPipeline (LLMPipeline with batching=pipeline) on the worker's IR",
    "optimum-ort": "bare ORTModelForCausalLM.generate on the worker's export: one at a time or one batch per turn, "
                   "the better chosen in the untimed run",
    "llamacpp": "llama.cpp's server code in process (xllamacpp handle_completions, no HTTP), the worker's "
                "configuration, a thread per session",
    "transformers": "bare generate one at a time, one generate batch per turn, or a ContinuousBatchingManager "
                    "closed loop, the best chosen in the untimed run",
}
# keys of bakeoff's completions body that are not extra fields (vllm bench serve sends its own)
STANDARD_KEYS = {"model", "max_tokens", "stream", "temperature", "top_p", "prompt", "messages", "stream_options",
                 "ignore_eos", "seed", "stop", "logprobs", "top_logprobs"}


def prompts(fixture: bool, sessions: int, rounds: int, warmup: int) -> tuple[list[list[str]], list[str]]:
    """bakeoff's throughput prompts ``[session][turn]`` and its warm-up prompts (``run_sweep``'s)."""
    from evaluations.probing import throughput_prompt

    return ([[throughput_prompt(s, t, fixture) for t in range(rounds)] for s in range(sessions)],
            [throughput_prompt(10_000 + k, 0, fixture) for k in range(warmup)])


def proc_cpu_s(pid: int) -> tuple[str, float]:
    """``(comm, user + system CPU seconds)`` of a live process (``/proc/PID/stat``), ``("", 0)`` if gone."""
    import os

    try:
        with open(f"/proc/{pid}/stat") as fh:
            raw = fh.read()
        with open(f"/proc/{pid}/comm") as fh:
            comm = fh.read().strip()
    except OSError:
        return "", 0.0
    f = raw.rsplit(")", 1)[1].split()
    return comm, (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def role(pid: int, comm: str) -> str:
    """A process's name for the CPU columns: its ``comm``, or for a Python process started with
    ``-m MODULE`` the module's last two parts (``ort_genai.worker``: the HTTP side,
    ``ort_genai.engine``: the engine process)."""
    if not comm.startswith("python"):
        return comm
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            argv = fh.read().split(b"\0")
    except OSError:
        return comm
    if b"-m" in argv and argv.index(b"-m") + 1 < len(argv):
        return ".".join(argv[argv.index(b"-m") + 1].decode().split(".")[-2:])
    return comm


def engine_cpu_s(engine) -> dict[str, float]:
    """CPU seconds of the backend's processes so far, summed per process role (:func:`role`;
    vLLM: its API server's module, ``VLLM::EngineCor``, ``VLLM::Worker``)."""
    out: dict[str, float] = {}
    proc = getattr(engine, "proc", None)
    for pid in (proc.members() if proc is not None else []):
        comm, s = proc_cpu_s(pid)
        if comm:
            name = role(pid, comm)
            out[name] = out.get(name, 0.0) + s
    return out


def cpu_per_token(before: dict[str, float], after: dict[str, float], tokens: int | None) -> dict[str, float]:
    """CPU microseconds per output token of each process (name) between two readings."""
    if not tokens:
        return {}
    return {k: round((after.get(k, 0.0) - before.get(k, 0.0)) / tokens * 1e6, 1) for k in after}


def _p50(xs: list[float] | None) -> float | None:
    return float(np.percentile(xs, 50)) if xs else None


class ToolSide:
    """One engine's own tool: ``run(sessions)`` -> ``output_tokens_per_s``, ``ttft_p50_ms``, ``tpot_p50_ms``.

    A tool with several ways to serve the load (``kinds``: e.g. one ``generate`` at a time, a batched
    ``generate``, a continuous batching loop) measures each in its first run at a session count (the
    untimed one of :func:`benchmarks.bench_fidelity.alternate`) and keeps the best (:func:`best_of`):
    the engine's best way to serve that many concurrent requests on this host; the timed runs use
    that kind alone. Taking the best of several kinds in every timed run would report the maximum of
    noisy figures (kinds that are one configuration at 1 session, such as ``serial`` and ``batched``,
    differ only by noise): biased up by about half the run-to-run spread, and slower.
    """

    name = "tool"
    kinds: tuple[str, ...] = ()

    def run(self, sessions: int) -> dict[str, Any]:
        """The kind chosen for ``sessions`` (the best of every kind on the first call), and the
        kinds that failed in that first call under ``failed_kinds``."""
        chosen = getattr(self, "_chosen", None)
        if chosen is None:
            chosen = self._chosen = {}
        if len(self.kinds) < 2 or sessions in chosen:
            return self.run_kind(sessions, chosen.get(sessions, self.kinds[0] if self.kinds else None))
        runs, failed = [], {}
        for k in self.kinds:
            try:
                runs.append(self.run_kind(sessions, k))
            except RuntimeError as exc:
                if not self.alive():
                    raise
                failed[k] = str(exc).splitlines()[0][:200]
        if not runs:
            raise RuntimeError(f"{self.name}: every kind failed: {failed}")
        best = best_of(runs)
        chosen[sessions] = best["kind"]
        if failed:
            best["failed_kinds"] = failed
        return best

    def run_kind(self, sessions: int, kind: str | None) -> dict[str, Any]:
        raise NotImplementedError

    def alive(self) -> bool:
        """Whether the tool can run another kind after one failed."""
        return True

    def describe(self, sessions: int) -> str:
        chosen = (getattr(self, "_chosen", None) or {}).get(sessions)
        return self.name + (f", {chosen} (the best of {' / '.join(self.kinds)} in the untimed run)"
                            if len(self.kinds) > 1 else "")

    def close(self) -> None:
        pass


class BareChild(ToolSide):
    """``benchmarks/fidelity_bare.py MODE`` in an engine's environment (line protocol: ``@@ JSON``)."""

    def __init__(self, python: str | Path, mode: str, model: str, options: dict[str, Any], name: str,
                 fixture: bool = True, args=None, kinds: tuple[str, ...] = (), huge_pages: bool = False):
        self.name, self.fixture, self.args, self.kinds = name, fixture, args, kinds
        import os

        from bakeoff.host import hugepages

        # the pages bakeoff's engine processes get (bakeoff/host/hugepages.py): the ratio is the serving path's
        env = {**hugepages.engine_env(wanted=huge_pages)[0], "TOKENIZERS_PARALLELISM": "false", "VLLM_NO_USAGE_STATS": "1",
               "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1"}

        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"fidelity-{mode}-", suffix=".log", delete=False)
        self.proc = subprocess.Popen([str(python), str(BARE), mode, model, json.dumps(options)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True, env={**os.environ, **env})
        ready = self._answer()
        if not ready.get("ready"):
            raise RuntimeError(f"{name} did not start: {ready.get('error')}")

    def _answer(self) -> dict[str, Any]:
        while True:
            line = self.proc.stdout.readline()
            if not line:
                self.log.flush()
                tail = Path(self.log.name).read_text()[-1500:]
                return {"error": f"the {self.name} process ended (exit {self.proc.poll()}): {tail}"}
            if line.startswith("@@ "):
                return json.loads(line[3:])

    def ask(self, cmd: dict[str, Any]) -> dict[str, Any]:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        out = self._answer()
        if "error" in out:
            raise RuntimeError(f"{self.name}: {out['error']}" + (f"\n{out['traceback']}" if out.get("traceback") else ""))
        return out

    def cpu(self) -> dict[str, float]:
        """CPU seconds so far of this tool's process and, where it drives the backend's own
        processes (vLLM's server), of those."""
        return {"tool": proc_cpu_s(self.proc.pid)[1], **{f"engine:{k}": v for k, v in engine_cpu_s(self.engine).items()}}

    engine = None

    def alive(self) -> bool:
        return self.proc.poll() is None

    def run_kind(self, sessions: int, kind: str | None) -> dict[str, Any]:
        a = self.args
        ps, warm = prompts(self.fixture, sessions, a.requests_per_session, a.warmup)
        out = self.ask({"prompts": ps, "warmup_prompts": warm, "sessions": sessions, "rounds": a.requests_per_session,
                        "max_tokens": a.max_tokens, "cpu": True, **({"kind": kind} if kind else {})})
        return {"output_tokens_per_s": out["output_tokens"] / out["wall_s"], "output_tokens": out["output_tokens"],
                "wall_s": out["wall_s"], "ttft_p50_ms": _p50(out["ttft_ms"]), "tpot_p50_ms": _p50(out["tpot_ms"]),
                "requests": len(out["ttft_ms"]), "tokens_per_step": out.get("tokens_per_step"), "kind": kind,
                "cpu_us_per_token": {"tool": round(out["cpu_s"] / out["output_tokens"] * 1e6, 1)}}

    def close(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
        Path(self.log.name).unlink(missing_ok=True)


def best_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the most output tokens/s, the others' figures kept under ``kinds``."""
    best = dict(max(runs, key=lambda r: r["output_tokens_per_s"]))
    if len(runs) > 1:
        best["kinds"] = {r["kind"]: round(r["output_tokens_per_s"], 1) for r in runs}
    return best


class VllmBench(BareChild):
    """``vllm bench serve`` against the server bakeoff launched, same prompts, lengths and concurrency."""

    def __init__(self, engine, model: str, fixture: bool, args, extra_body: dict[str, Any], work: str):
        from backends.vllm.backend import env_spec
        from bakeoff.host import envs

        self.engine, self.extra_body, self.work = engine, extra_body, work
        super().__init__(envs.ensure(env_spec(engine.cuda)), "vllm", model, {}, "vllm bench serve", fixture, args)
        self.model = model

    def describe(self, sessions: int) -> str:
        return "vllm bench serve" + (f" --extra-body {json.dumps(self.extra_body)}" if self.extra_body else "")

    def run(self, sessions: int) -> dict[str, Any]:
        a = self.args
        ps, _ = prompts(self.fixture, sessions, a.requests_per_session, a.warmup)
        path = Path(self.work) / f"prompts-{sessions}.jsonl"  # turn-major: the first n requests are the sessions' first
        path.write_text("".join(json.dumps({"prompt": ps[s][t]}) + "\n" for t in range(a.requests_per_session)
                                for s in range(sessions)))
        argv = ["--backend", "openai", "--base-url", self.engine.info.base_url, "--endpoint", "/v1/completions",
                "--model", self.engine.info.served_model, "--tokenizer", self.model, "--dataset-name", "custom",
                "--dataset-path", str(path), "--custom-output-len", str(a.max_tokens), "--skip-chat-template",
                "--disable-shuffle", "--num-prompts", str(sessions * a.requests_per_session),
                "--max-concurrency", str(sessions), "--request-rate", "inf", "--ignore-eos",
                "--num-warmups", str(a.warmup), "--temperature", "0", "--disable-tqdm", "--seed", "0",
                "--ready-check-timeout-sec", "0", "--percentile-metrics", "ttft,tpot,itl,e2el"]
        if self.extra_body:
            argv += ["--extra-body", json.dumps(self.extra_body)]
        before = self.cpu()
        res = self.ask({"argv": argv})
        # CPU over the whole run: its warm-ups too (their tokens counted, as bakeoff's side counts its own)
        cpu = cpu_per_token(before, self.cpu(), (res.get("total_output_tokens") or 0) + a.warmup * a.max_tokens)
        if res.get("failed"):
            raise RuntimeError(f"vllm bench serve: {res['failed']} requests failed")
        return {"output_tokens_per_s": res["output_throughput"], "output_tokens": res.get("total_output_tokens"),
                "wall_s": res.get("duration"), "ttft_p50_ms": res.get("median_ttft_ms"),
                "tpot_p50_ms": res.get("median_tpot_ms"), "requests": res.get("completed"), "cpu_us_per_token": cpu}


class OgBare(ToolSide):
    """``benchmarks/ort_genai_bare.py``'s ``BareOrtGenai`` on the worker's export and thread count."""

    def __init__(self, engine, fixture: bool, args):
        from benchmarks.ort_genai_bare import BareOrtGenai

        o = engine.options
        self.bare = BareOrtGenai(engine.export_result.output_dir, o.execution_provider,
                                 int(engine.threads()[0] or 0), engine.env_python, huge_pages=engine.huge_pages)  # the worker's own count
        self.fixture, self.args = fixture, args
        self.name = f"bare og (onnxruntime-genai {self.bare.version}, paged export: {self.bare.paged})"

    @property
    def kinds(self) -> tuple[str, ...]:
        return ("engine",) if self.bare.paged else ("generator", "engine")

    def describe(self, sessions: int) -> str:
        chosen = (getattr(self, "_chosen", None) or {}).get(sessions)
        return (f"bare og.{'Engine' if chosen == 'engine' else 'Generator batch' if chosen else 'Engine'} "
                f"(paged export: {self.bare.paged}; the better of og.Generator / og.Engine in the untimed run)")

    def run_kind(self, sessions: int, kind: str) -> dict[str, Any]:
        a = self.args
        ps, warm = prompts(self.fixture, sessions, a.requests_per_session, a.warmup)
        if warm:
            self.bare.run(kind, [warm], a.max_tokens, 1, len(warm))
        out = self.bare.run(kind, ps, a.max_tokens, sessions, a.requests_per_session)
        if "error" in out:
            raise RuntimeError(f"bare og.{kind}: {out['error']}")
        got = {k: out.get(k) for k in ("output_tokens_per_s", "output_tokens", "wall_s", "ttft_p50_ms", "tpot_p50_ms",
                                       "tokens_per_step")}
        got["kind"] = kind
        if out.get("cpu_s") is not None and out.get("output_tokens"):
            got["cpu_us_per_token"] = {"tool": round(out["cpu_s"] / out["output_tokens"] * 1e6, 1)}
        return got

    def close(self) -> None:
        self.bare.close()


def vllm_body(variant: str, engine, fixture: bool) -> dict[str, Any]:
    """The extra request fields of a ``--vllm-bodies`` variant: ``sweep`` (what bakeoff's client adds
    to a sweep request), ``none``, or field names joined by ``+`` (each ``true``)."""
    if variant == "none":
        return {}
    if variant == "sweep":
        from bakeoff.api.specs import GenerationRequest
        from evaluations.probing import throughput_prompt

        req = GenerationRequest(request_id="x", prompt=throughput_prompt(0, 0, fixture), max_tokens=8, ignore_eos=True)
        return {k: v for k, v in engine.client.body(req).items() if k not in STANDARD_KEYS}
    return {f: True for f in variant.split("+")}


def make_tool(name: str, engine, model: str, fixture: bool, args, variant: str, work: str) -> ToolSide:
    """The tool of ``name`` for a started backend (and, for vLLM, set bakeoff's client to send the
    variant's extra fields, as the tool will)."""
    if name == "vllm":
        body = vllm_body(variant, engine, fixture)
        if variant != "sweep":
            engine.client.extra_body = dict(body)
        return VllmBench(engine, model, fixture, args, body, work)
    if name == "ort-genai":
        return OgBare(engine, fixture, args)
    if name == "openvino":
        opts = engine.engine_options()  # the worker's engine process's own, threads included
        return BareChild(engine.env_python, "openvino", engine.export_result.output_dir, opts,
                         f"bare openvino_genai ({opts.get('batching')})", fixture, args, huge_pages=engine.huge_pages)
    if name == "optimum-ort":
        opts = {"provider": engine.options.provider, "intra_op_num_threads": engine.threads()[0],
                "onnx_file": engine.export_result.onnx_file}
        return BareChild(engine.env_python, "optimum", engine.export_result.output_dir, opts,
                         "bare ORTModelForCausalLM.generate", fixture, args, kinds=("serial", "batched"),
                         huge_pages=engine.huge_pages)
    if name == "llamacpp":
        return BareChild(engine.env_python, "llamacpp", str(engine.gguf), engine.worker_options(),
                         "llama.cpp in process", fixture, args)
    if name == "transformers":
        return BareChild(sys.executable, "hf", model, {**engine.options.model_dump(include={"device", "dtype"}),
                                                       "num_threads": engine.threads()[0]},
                         "bare transformers", fixture, args, kinds=("serial", "batched", "continuous"),
                         huge_pages=engine.huge_pages)
    raise ValueError(f"no tool for {name!r}")
