"""TensorRT-LLM's quantized input: NVIDIA ModelOpt PTQ (INT4 AWQ, FP8, NVFP4) and unified-HF export.

TensorRT-LLM refuses llm-compressor's W4A16 checkpoints (:mod:`bakeoff.analysis.preflight`); its own
quantized input is a ModelOpt checkpoint. :func:`modelopt_quantize` produces one with
``mtq.quantize(model, mtq.INT4_AWQ_CFG | mtq.FP8_DEFAULT_CFG | mtq.NVFP4_DEFAULT_CFG,
forward_loop)`` and ``export_hf_checkpoint(model, export_dir=...)``, in ModelOpt's own
environment (``nvidia-modelopt[hf]``), through :mod:`adapters.trtllm_build.modelopt_quant`.
TensorRT-LLM's PyTorch backend then loads the folder directly (no engine build step).

ModelOpt PTQ runs on an NVIDIA GPU here: on a host without one, :func:`modelopt_quantize`
ends ``unavailable`` with the nvidia-smi output as evidence, before installing anything.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any, Callable, Literal

from pydantic import Field

from bakeoff.host import envs
from bakeoff.api.errors import EngineFailure, UserError
from bakeoff.analysis.preflight import describe_quantization
from bakeoff.host.procs import tail
from bakeoff.api.specs import Spec

__all__ = ["modelopt_quantize", "ModeloptResult", "env_spec", "RESULT_FILE"]

MODELOPT = "nvidia-modelopt[hf]>=0.37"
RESULT_FILE = "bakeoff-quantization.json"
SCRIPT = Path(__file__).with_name("modelopt_quant.py")
QFormat = Literal["int4_awq", "fp8", "nvfp4"]


def env_spec() -> envs.EnvSpec:
    """ModelOpt's environment (CUDA torch from the package index; created on GPU hosts only)."""
    return envs.EnvSpec("modelopt", (MODELOPT,), notes=("NVIDIA ModelOpt PTQ; created only on a host with an NVIDIA GPU",),
                         modules=("modelopt", "torch"))


class ModeloptResult(Spec):
    """What :func:`modelopt_quantize` produced (also ``bakeoff-quantization.json`` in the output).

    Attributes:
        path: the exported checkpoint folder (load it with TensorRT-LLM).
        source: the source checkpoint.
        qformat: ``int4_awq``, ``fp8`` or ``nvfp4``.
        config: the ModelOpt config used (``INT4_AWQ_CFG``...).
        calibration: ``source``, ``num_samples``, ``max_seq_length``.
        duration_s: wall time of the script, seconds; quantize_s: of ``mtq.quantize``.
        versions: modelopt, torch, transformers, python.
        device: the GPU name.
        quantization: :func:`describe_quantization` of the output.
        log_path: the log.
    """

    path: str
    source: str
    tool: str = "modelopt"
    qformat: str
    config: str
    calibration: dict[str, Any]
    duration_s: float = Field(ge=0)
    quantize_s: float | None = None
    versions: dict[str, str]
    device: str
    quantization: dict[str, Any] = Field(default_factory=dict)
    quantization_config: dict[str, Any] = Field(default_factory=dict)
    log_path: str


def _no_gpu_evidence() -> str:
    exe = shutil.which("nvidia-smi")
    if not exe:
        return "nvidia-smi: not found on PATH (no NVIDIA driver)"
    out = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=20)
    return f"$ nvidia-smi -L (exit {out.returncode})\n{out.stdout}{out.stderr}"


def modelopt_quantize(model_path: str | Path, out_dir: str | Path, qformat: QFormat = "int4_awq",
                      dataset: str | Path | None = None, num_samples: int = 64, max_seq_length: int = 256,
                      log: Callable[[str], None] = print, timeout_s: float = 4 * 3600) -> ModeloptResult:
    """Quantize a checkpoint with ModelOpt and export it for TensorRT-LLM.

    Args:
        model_path: a local float Hugging Face checkpoint.
        out_dir: output folder; must not exist or be empty.
        qformat: ``int4_awq`` (W4A16 AWQ), ``fp8`` (W8A8 FP8) or ``nvfp4``.
        dataset: calibration texts (``.jsonl`` with ``text``, or one per line); default built-in.
        num_samples: at most this many calibration samples.
        max_seq_length: tokens per calibration sample.
        log: progress lines.
        timeout_s: deadline for the script, seconds.

    Raises:
        UserError: bad inputs (missing source, already quantized, non-empty output, bad qformat).
        EngineFailure: ``unavailable`` on a host without an NVIDIA GPU (nothing installed) or
            when ModelOpt cannot be installed; ``export-defect`` when the script fails; ``hang``.
    """
    src, out = Path(model_path).resolve(), Path(out_dir).resolve()
    if qformat not in ("int4_awq", "fp8", "nvfp4"):
        raise UserError(f"unknown qformat {qformat!r}; choose int4_awq, fp8 or nvfp4")
    if not (src / "config.json").is_file():
        raise UserError(f"{model_path} is not a checkpoint folder (no config.json)")
    existing = describe_quantization(src)
    if existing.get("quantized"):
        raise UserError(f"{model_path} is already quantized ({existing.get('method')}); pass it to a backend as it is")
    if out.exists() and any(out.iterdir()):
        raise UserError(f"output folder {out_dir} exists and is not empty; choose a new one")
    if not envs.has_cuda():
        raise EngineFailure("unavailable", "ModelOpt PTQ for TensorRT-LLM needs an NVIDIA GPU (CUDA kernels for "
                            "calibration and FP8/FP4 casts); this host has none", {"probe.txt": _no_gpu_evidence()})
    python = envs.ensure(env_spec(), log=log)
    out.mkdir(parents=True, exist_ok=True)
    result_tmp = out.parent / f".{out.name}.modelopt-result.json"
    log_path = out.parent / f"{out.name}.modelopt.log"
    cmd = [str(python), str(SCRIPT), "--model", str(src), "--out", str(out), "--qformat", qformat,
           "--num-samples", str(num_samples), "--max-seq-length", str(max_seq_length), "--result-json", str(result_tmp)]
    if dataset is not None:
        cmd += ["--dataset", str(Path(dataset).resolve())]
    log(f"quantizing {src.name} with ModelOpt {qformat}; log: {log_path}")
    with open(log_path, "w") as fh:
        fh.write("$ " + " ".join(cmd) + "\n")
        fh.flush()
        try:
            proc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, timeout=timeout_s,
                                  env=envs.child_env({"TOKENIZERS_PARALLELISM": "false"}))
        except subprocess.TimeoutExpired:
            raise EngineFailure("hang", f"ModelOpt quantization did not finish within {timeout_s:.0f} s",
                                {"modelopt.log.tail": tail(log_path, 80), "command.txt": " ".join(cmd)}) from None
    if proc.returncode != 0 or not result_tmp.is_file():
        text = tail(log_path, 120)
        raise EngineFailure("export-defect", f"ModelOpt quantization failed (exit {proc.returncode}): "
                            f"{(text.splitlines() or [''])[-1][:300]}", {"modelopt.log.tail": text, "command.txt": " ".join(cmd)})
    raw = json.loads(result_tmp.read_text())
    result_tmp.unlink()
    result = ModeloptResult(path=str(out), source=str(src), log_path=str(log_path),
                            quantization={k: v for k, v in describe_quantization(out).items() if k != "raw"}, **raw)
    (out / RESULT_FILE).write_text(result.model_dump_json(indent=2))
    log(f"ModelOpt {qformat} done in {result.duration_s} s")
    return result
