"""TensorRT-LLM backend: its LLM API in a worker process (default), or ``trtllm-serve``.

TensorRT-LLM needs an NVIDIA GPU and CUDA 13 and pins its own torch (docs/field-notes.md,
"TensorRT-LLM"), so it runs in its own environment, created only on a host with a GPU. Before
anything else :meth:`TrtllmBackend.start` probes the host: no GPU, or ``tensorrt_llm`` not
importable, ends the run ``unavailable`` with the probe output as evidence. Then the
checkpoint's quantization is checked against TensorRT-LLM's reader
(:func:`bakeoff.analysis.preflight.raise_if_rejected`): an llm-compressor W4A16 checkpoint, for one,
ends ``config-rejected`` before anything is launched.

Server mode runs ``trtllm-serve MODEL --host --port --backend --tp_size --max_batch_size
--max_num_tokens --max_seq_len --kv_cache_free_gpu_memory_fraction [--trust_remote_code]
[--extra_llm_api_options FILE]`` (``tensorrt_llm/commands/serve.py`` and
``common_llm_options.py``), ready on ``/health``; its ``/metrics`` is JSON iteration stats and
``/prometheus/metrics`` the Prometheus exposition.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from backends.trtllm.preflight import rule as preflight_rule
from backends._server import ChildServerBackend, http_get, parse_prometheus
from bakeoff.host import envs
from bakeoff.api.errors import EngineFailure, UserError
from bakeoff.analysis.preflight import raise_if_rejected
from bakeoff.api.specs import BackendInfo, Spec

TRTLLM = "tensorrt-llm==1.2.1"
# "[MemUsageChange] Allocated 10.5 GiB for max tokens in paged KV cache (123456)."
KV_LINE = re.compile(r"max tokens in paged KV cache \((\d+)\)")
PROBE_CODE = "import tensorrt_llm, sys; print('tensorrt_llm', tensorrt_llm.__version__, 'from', tensorrt_llm.__file__)"


def env_spec() -> envs.EnvSpec:
    """TensorRT-LLM's environment (created only on a host with an NVIDIA GPU: gigabytes of wheels)."""
    return envs.EnvSpec("trtllm", (TRTLLM, "aiohttp"), notes=(
        "tensorrt-llm needs an NVIDIA GPU and CUDA 13 and pins its own torch; never installed on a host without a GPU",),
        modules=("tensorrt_llm", "aiohttp"))


class TrtllmOptions(Spec):
    """``--backend-opt`` keys of the TensorRT-LLM backend (names as in ``trtllm-serve`` / ``LlmArgs``).

    Attributes:
        mode: ``worker`` (the LLM API in bakeoff's worker server) or ``server`` (``trtllm-serve``).
        backend: TensorRT-LLM's backend: ``pytorch`` (default), ``tensorrt`` (engine build), ``_autodeploy``.
        max_batch_size: maximum requests scheduled at once.
        max_num_tokens: maximum batched tokens per iteration (after padding removal).
        max_seq_len: maximum prompt + output tokens of one request (default: from the model).
        kv_cache_free_gpu_memory_fraction: fraction (0-1] of the GPU memory left after weights
            given to the KV cache.
        enable_block_reuse: KV cache block reuse (prefix cache) on/off; engine default when unset.
        tp_size: tensor parallel size (GPUs).
        trust_remote_code: off unless turned on.
        extra_llm_api_options: a YAML file of more ``LlmArgs`` (same as trtllm-serve's flag).
        python: an interpreter that already has ``tensorrt_llm`` (e.g. an NGC container's);
            default: bakeoff's ``trtllm`` environment, created on first use on a GPU host.
        served_model_name: model name in requests (worker mode; trtllm-serve serves the path).
        api: ``completions`` or ``chat``.
        preflight: predict the loader's verdict on the checkpoint's quantization first.
    """

    mode: Literal["worker", "server"] = "worker"
    backend: Literal["pytorch", "tensorrt", "_autodeploy"] = "pytorch"
    max_batch_size: int | None = Field(None, gt=0)
    max_num_tokens: int | None = Field(None, gt=0)
    max_seq_len: int | None = Field(None, gt=0)
    kv_cache_free_gpu_memory_fraction: float = Field(0.9, gt=0, le=1)
    enable_block_reuse: bool | None = None
    tp_size: int = Field(1, ge=1)
    trust_remote_code: bool = False
    extra_llm_api_options: str | None = None
    python: str | None = None
    served_model_name: str = "model"
    api: Literal["completions", "chat"] = "completions"
    preflight: bool = True


def _probe_import(python: str, timeout_s: float = 300) -> tuple[bool, str]:
    """Import ``tensorrt_llm`` in ``python``; returns (ok, output)."""
    try:
        out = subprocess.run([python, "-c", PROBE_CODE], capture_output=True, text=True, timeout=timeout_s,
                             env=envs.child_env())
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"{type(exc).__name__}: {exc}"
    text = (out.stdout + out.stderr).strip()
    return out.returncode == 0, text[-4000:]


def _nvidia_smi() -> str:
    exe = shutil.which("nvidia-smi")
    if not exe:
        return "nvidia-smi: not found on PATH (no NVIDIA driver)"
    try:
        out = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=20)
        return f"$ nvidia-smi -L (exit {out.returncode})\n{out.stdout}{out.stderr}"
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"nvidia-smi -L failed: {exc}"


def _last_line(text: str) -> str:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return lines[-1][:300] if lines else "(no output)"


class TrtllmBackend(ChildServerBackend):
    """TensorRT-LLM, in its own environment: LLM API worker or ``trtllm-serve``."""

    preflight_rule = staticmethod(preflight_rule)

    name = "trtllm"
    Options = TrtllmOptions

    def __init__(self, config):
        super().__init__(config)
        o = self.options
        self.ready_mode = "file" if o.mode == "worker" else "health"
        self.api = o.api
        if o.extra_llm_api_options and o.enable_block_reuse is not None and o.mode == "server":
            raise UserError("trtllm: give kv_cache_config.enable_block_reuse inside the extra_llm_api_options "
                            "file, not both")
        self.python: str | None = o.python
        self.engine_version: str | None = None
        self.probe_text = ""
        self.preflight_result = None

    # -- availability -------------------------------------------------------------------
    def probe(self) -> str:
        """Check the host before anything: an NVIDIA GPU, and ``tensorrt_llm`` importable.

        Returns:
            The interpreter to run TensorRT-LLM with.

        Raises:
            EngineFailure: ``unavailable`` with ``probe.txt`` (nvidia-smi output, import error).
        """
        smi = _nvidia_smi()
        if not envs.has_cuda():
            spec = env_spec()
            candidate = self.python or (str(spec.python) if spec.is_ready() else sys.executable)
            ok, text = _probe_import(candidate, timeout_s=120)
            self.probe_text = (f"{smi}\n\n$ {candidate} -c \"import tensorrt_llm\"\n{text}\n\n"
                               f"environment {spec.path}: {'ready' if spec.is_ready() else 'not created (needs a GPU host)'}")
            raise EngineFailure("unavailable", "TensorRT-LLM needs an NVIDIA GPU (CUDA 13); this host has none "
                                f"({_last_line(smi)}); import probe: {_last_line(text)}", {"probe.txt": self.probe_text})
        python = self.python or str(envs.ensure(env_spec()))
        ok, text = _probe_import(python)
        self.probe_text = f"{smi}\n\n$ {python} -c \"import tensorrt_llm\"\n{text}"
        if not ok:
            raise EngineFailure("unavailable", f"tensorrt_llm is not importable in {python}: {_last_line(text)}",
                                {"probe.txt": self.probe_text})
        m = re.search(r"tensorrt_llm (\S+) from", text)
        self.engine_version = m.group(1) if m else None
        self.python = python
        return python

    # -- launch -------------------------------------------------------------------------
    def engine_options(self) -> dict[str, Any]:
        """Options passed to the worker (``--options`` JSON)."""
        return self.options.model_dump(exclude={"mode", "python", "served_model_name", "api", "preflight"})

    def command(self, port: int) -> tuple[list[str], dict[str, str]]:
        o = self.options
        python = self.python or sys.executable
        extra = {"TOKENIZERS_PARALLELISM": "false"}
        if o.mode == "worker":
            cmd = [python, "-m", "backends.trtllm.worker", "--model", self.config.model, "--port", str(port),
                   "--ready-file", str(self.ready_file), "--served-model", o.served_model_name,
                   "--options", json.dumps(self.engine_options())]
            return cmd, envs.child_env(extra, huge_pages=self.huge_pages)
        serve = str(Path(python).parent / "trtllm-serve")
        cmd = [serve, self.config.model, "--host", "127.0.0.1", "--port", str(port), "--backend", o.backend,
               "--tp_size", str(o.tp_size), "--kv_cache_free_gpu_memory_fraction", str(o.kv_cache_free_gpu_memory_fraction)]
        for key in ("max_batch_size", "max_num_tokens", "max_seq_len"):
            if getattr(o, key) is not None:
                cmd += [f"--{key}", str(getattr(o, key))]
        if o.trust_remote_code:
            cmd.append("--trust_remote_code")
        extra_file = o.extra_llm_api_options
        if o.enable_block_reuse is not None:  # YAML is a superset of JSON
            extra_file = str(self.workdir / "trtllm-extra-llm-api-options.yaml")
            Path(extra_file).write_text(json.dumps({"kv_cache_config": {"enable_block_reuse": o.enable_block_reuse}}))
        if extra_file:
            cmd += ["--extra_llm_api_options", extra_file]
        return cmd, envs.child_env(extra, huge_pages=self.huge_pages)

    def start(self) -> BackendInfo:
        """Probe the host, preflight the checkpoint, then launch.

        Raises:
            EngineFailure: ``unavailable`` (no GPU, no tensorrt_llm), ``config-rejected``
                (preflight or the engine's own refusal), ``load-failure``, ``hang``.
        """
        return super().start()

    def prepare(self) -> None:
        self.probe()
        if self.options.preflight:
            self.preflight_result = raise_if_rejected(self.config.model, self.name, self.preflight_rule, cuda=True)

    def classify_start_failure(self, exc: EngineFailure) -> EngineFailure:
        text = exc.evidence.get("engine.log.tail", "")
        if "Unsupported quantization_config" in text or "Unsupported quant_bits" in text:
            exc.failure_class = "config-rejected"
        exc.evidence.setdefault("probe.txt", self.probe_text)
        return exc

    def served_model(self) -> str:
        return self.options.served_model_name if self.options.mode == "worker" else self.config.model

    def describe(self, startup_s: float) -> BackendInfo:
        worker = self.options.mode == "worker"
        info = self.ready_payload.get("info", {}) if worker else {}
        served = self.served_model()
        kv = [int(m.group(1)) for m in KV_LINE.finditer(self.proc.tail(2000) if self.proc else "")]
        notes = {"mode": self.options.mode, "trtllm_backend": self.options.backend,
                 "kv_cache_free_gpu_memory_fraction": str(self.options.kv_cache_free_gpu_memory_fraction)}
        if self.preflight_result is not None:
            notes["preflight"] = self.preflight_result.reason
        return BackendInfo(
            backend=self.name, engine="tensorrt-llm", engine_version=info.get("engine_version") or self.engine_version,
            device=info.get("device", "cuda"), kv_cache_tokens=kv[-1] if kv else None,
            max_model_len=self.options.max_seq_len, launch_command=self.launch_cmd, base_url=self.base_url,
            served_model=served, startup_s=startup_s, notes=notes)

    def metrics(self) -> dict[str, Any]:
        if not self.base_url:
            return {}
        if self.options.mode == "worker":
            return super().metrics()
        status, body = http_get(self.base_url + "/prometheus/metrics", timeout_s=10)
        if status == 200 and body.strip():
            return parse_prometheus(body)
        status, body = http_get(self.base_url + "/metrics", timeout_s=10)  # JSON iteration stats
        try:
            stats = json.loads(body) if status == 200 else []
        except json.JSONDecodeError:
            return {}
        return dict(_flatten(stats[-1], "trtllm:")) if isinstance(stats, list) and stats else {}


def _flatten(obj: Any, prefix: str):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _flatten(v, f"{prefix}{k}.")
    elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
        yield prefix.rstrip("."), float(obj)
