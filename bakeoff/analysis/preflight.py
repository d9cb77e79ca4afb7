"""Preflight: will an engine's loader accept this checkpoint? Predicted before launching it.

Reads ``config.json`` (architecture, dtype, ``quantization_config``) and ModelOpt's
``hf_quant_config.json`` when present, and applies the engine's documented rules, which live
in the engine's own folder (``backends/<engine>/preflight.py``, ``Backend.preflight_rule``;
``backends.preflight`` looks them up by name). Each rule
names its source (a documentation URL or the engine source file that implements it), so a
predicted refusal is evidence a maintainer can check. A predicted refusal ends a run as
``config-rejected`` before anything is launched (:func:`raise_if_rejected`).

A backend may also have a checkpoint rule (``Backend.preflight_checkpoint_rule``): it reads the
safetensors headers against the quantization config (``bakeoff/analysis/checkpoint_layout.py``),
today vLLM's MTP head check. Its defect decides the prediction only when the run asks for the
feature that needs those tensors (``speculative_config`` method ``mtp``): the target model
loads and serves without its MTP head, so refusing a run that does not use it would
disqualify a checkpoint for a feature nobody asked for. Otherwise the defect is a warning
(``warnings``, with the finding and its patch in ``findings``), recorded in the load check's
evidence. The class of a refusal is ``config-rejected``, not ``incompatible-features``: the
engine's loader is refused by what the checkpoint's ``quantization_config`` says (its
exclusion list contradicts the stored tensors) and a config edit fixes it (``--patch``); the
engine and the hardware can do MTP, so no feature is incompatible.

This module imports no engine.

Example:
    >>> from backends import preflight
    >>> r = preflight("/models/qwen3-awq-w4a16", "trtllm")
    >>> r.accepted, r.reason
    (False, "TensorRT-LLM reads compressed-tensors FP8 and NVFP4 only; this is int4 W4A16 ...")
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from pydantic import Field

from bakeoff.analysis.checkpoint_layout import config_beyond_weights, mtp_requested, truncated_files
from bakeoff.api.errors import EngineFailure
from bakeoff.api.specs import Spec
from bakeoff.host.artifacts import read_json
from bakeoff.host.envs import has_cuda

# (accepted, reason, rule source[, failure class when refused: default config-rejected])
Rule = tuple


class PreflightResult(Spec):
    """One backend's predicted verdict on one checkpoint.

    Attributes:
        backend: registry name.
        accepted: True (the loader accepts it), False (it refuses: end the run as
            ``failure_class``), None (no rule predicts it; launch and see).
        reason: one line, naming the engine's own words where the rule quotes them.
        rule_source: the documentation URL or source file of the rule applied.
        failure_class: ``config-rejected``, ``unsupported-architecture`` or
            ``incompatible-features`` (loads, cannot run on this hardware) when refused.
        quantization: :func:`describe_quantization` of the checkpoint.
        architecture: ``config.architectures[0]``.
        dtype: ``torch_dtype`` / ``dtype`` of the config.
        warnings: defects that do not decide this run (e.g. the MTP head's, without MTP
            speculative decoding requested).
        findings: the checkpoint rule's findings (``MtpFinding`` dumps).
        suggested_patches: checkpoint patches that fix the defects found (``--patch`` syntax).
    """

    backend: str
    accepted: bool | None
    reason: str
    rule_source: str = ""
    failure_class: str | None = None
    quantization: dict[str, Any]
    architecture: str | None = None
    dtype: str | None = None
    warnings: list[str] = Field(default_factory=list)
    findings: list[dict[str, Any]] = Field(default_factory=list)
    suggested_patches: list[str] = Field(default_factory=list)


def read_config(model_path: str | Path) -> dict[str, Any]:
    """``config.json`` of a local checkpoint folder; ``{}`` for a hub id, an unreadable file or
    one that does not hold a JSON object (the engine's reaction to it is the evidence)."""
    try:
        cfg = read_json(Path(model_path) / "config.json")  # a FIFO or 200,000-deep nesting: a ValueError
    except (OSError, ValueError):  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        return {}
    return cfg if isinstance(cfg, dict) else {}


def _modelopt_file(model_path: str | Path) -> dict[str, Any] | None:
    try:
        cfg = read_json(Path(model_path) / "hf_quant_config.json")
    except (OSError, ValueError):
        return None
    return cfg if isinstance(cfg, dict) else None


def _scheme(w_bits: Any, w_type: Any, a_bits: Any, a_type: Any, strategy: Any, group: Any) -> str | None:
    if w_bits is None:
        return None
    if w_type == "float" and w_bits == 4:
        return "NVFP4" if a_bits == 4 else ("NVFP4A16" if a_bits is None else f"FP4-A{a_bits}")
    if w_type == "float" and w_bits == 8:
        return "FP8" + ("-block" if strategy == "block" else "") + ("" if a_bits else "-weight-only")
    if a_bits is None:
        return f"W{w_bits}A16"
    return f"W{w_bits}A{a_bits}" + ("-FP8" if a_type == "float" else "-INT")


def describe_quantization(model_path: str | Path) -> dict[str, Any]:
    """What quantization a checkpoint already carries, read from its config (no weights read).

    Recognises AutoAWQ (``quant_method: awq``), GPTQ, compressed-tensors (llm-compressor),
    FP8, ModelOpt (``hf_quant_config.json`` or ``quant_method: modelopt``), Quark and others by
    ``quant_method``, so an already quantized checkpoint goes to a backend as it is.

    Returns:
        ``{"quantized": False}`` for a float checkpoint, else ``quantized``, ``method``,
        ``scheme`` (``W4A16``, ``FP8``, ``NVFP4``...), ``bits``, ``weight_type`` (int/float),
        ``group_size``, ``symmetric``, ``strategy``, ``activation_bits``, ``format``,
        ``ignore`` (modules left unquantized), ``producer``, ``source`` (the file read) and
        ``raw`` (the config as found).
    """
    qc, source = _quantization_config(model_path)
    if not isinstance(qc, dict) or not qc:
        return {"quantized": False}
    method, producer = _method_and_producer(qc)
    out: dict[str, Any] = {"quantized": method is not None, "method": method, "producer": producer,
                           "format": qc.get("format"), "source": source, "raw": qc}
    if method == "modelopt":
        out.update(_modelopt_fields(qc))
    elif method == "compressed-tensors":
        out.update(_compressed_tensors_fields(qc))
    else:
        out.update(_quant_method_fields(qc, method))
    return out


def _quantization_config(model_path: str | Path) -> tuple[Any, str]:
    """``(quantization config, the file it came from)``: config.json's ``quantization_config``, else
    ModelOpt's ``hf_quant_config.json``."""
    qc = read_config(model_path).get("quantization_config")
    mo = _modelopt_file(model_path)
    if not qc and mo:
        return mo, "hf_quant_config.json"
    return qc, "config.json"


def _method_and_producer(qc: dict[str, Any]) -> tuple[str | None, str | None]:
    """``(quant_method lower-cased, producer name)``; any ModelOpt config's method is ``modelopt``."""
    method = str(qc.get("quant_method") or "").lower() or None
    producer = (qc.get("producer") or {}).get("name") if isinstance(qc.get("producer"), dict) else None
    if producer == "modelopt" or (method or "").startswith("modelopt"):
        method = "modelopt"
    return method, producer


def _modelopt_fields(qc: dict[str, Any]) -> dict[str, Any]:
    """A ModelOpt config's scheme (its ``quant_algo``), group size, exclusions, KV cache, bits and weight type."""
    inner = qc.get("quantization") if isinstance(qc.get("quantization"), dict) else qc
    algo = str(inner.get("quant_algo") or "")
    return {"scheme": algo or None, "group_size": inner.get("group_size"),
            "ignore": list(inner.get("exclude_modules") or qc.get("ignore") or []),
            "kv_cache": inner.get("kv_cache_quant_algo"),
            "bits": 4 if "4" in algo else (8 if "8" in algo else None),
            "weight_type": "float" if ("FP" in algo.upper()) else ("int" if algo else None)}


def _compressed_tensors_fields(qc: dict[str, Any]) -> dict[str, Any]:
    """A compressed-tensors config's weights and input activations of its first config group, its
    exclusions, KV cache and scheme (:func:`_scheme`)."""
    groups = qc.get("config_groups") or {}
    g = next(iter(groups.values()), {}) if groups else {}
    w, a = g.get("weights") or {}, g.get("input_activations") or {}
    return {"bits": w.get("num_bits"), "weight_type": w.get("type"), "group_size": w.get("group_size"),
            "symmetric": w.get("symmetric"), "strategy": w.get("strategy"), "activation_bits": a.get("num_bits"),
            "activation_type": a.get("type"), "activation_strategy": a.get("strategy"),
            "ignore": list(qc.get("ignore") or []), "n_config_groups": len(groups), "targets": g.get("targets"),
            "kv_cache": qc.get("kv_cache_scheme"),
            "scheme": _scheme(w.get("num_bits"), w.get("type"), a.get("num_bits"), a.get("type"),
                              w.get("strategy"), w.get("group_size"))}


def _quant_method_fields(qc: dict[str, Any], method: str | None) -> dict[str, Any]:
    """Any other config (AWQ, GPTQ, FP8, MXFP4, ...) by ``quant_method``: bits, weight type, group
    size, symmetry, version, activation scheme, exclusions and scheme."""
    bits = qc.get("bits") or qc.get("w_bit") or qc.get("weight_bits")
    is_fp8 = method in ("fp8", "fbgemm_fp8")
    return {"bits": 8 if is_fp8 else bits,
            "weight_type": "float" if is_fp8 or method in ("mxfp4", "nvfp4") else "int",
            "group_size": qc.get("group_size") or qc.get("q_group_size") or qc.get("weight_block_size"),
            "symmetric": qc.get("sym") if "sym" in qc else (not qc["zero_point"] if "zero_point" in qc else None),
            "version": qc.get("version"), "activation_scheme": qc.get("activation_scheme"),
            "ignore": list(qc.get("modules_to_not_convert") or qc.get("ignored_layers") or []),
            "scheme": "FP8" if is_fp8 else (method.upper() if method in ("mxfp4", "nvfp4") else
                                            (f"W{bits}A16" if bits else None))}


Rule = tuple[bool | None, str, str]  # accepted, reason, source


def cpu_flags() -> set[str]:
    """This host's CPU flags (``/proc/cpuinfo``); empty when unreadable."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def preflight(model_path: str | Path, backend: str, rule: Callable[..., Rule] | None, cuda: bool | None = None,
              flags: set[str] | None = None, options: dict[str, Any] | None = None,
              checkpoint_rule: Callable[..., Any] | None = None) -> PreflightResult:
    """Predict whether ``backend``'s loader accepts the checkpoint at ``model_path``.

    Args:
        model_path: a local checkpoint folder (a hub id gives ``accepted=None``: nothing read).
        backend: the backend's name (recorded).
        rule: the backend's rule (``Backend.preflight_rule``, in its own folder); None: no
            prediction (``backends.preflight`` looks it up by name).
        cuda: whether the engine runs on an NVIDIA GPU; default: this host has one.
        flags: the CPU's flags (``avx512f``...); default: this host's ``/proc/cpuinfo``.
        options: the run's backend options (decide whether a checkpoint defect is blocking).
        checkpoint_rule: ``Backend.preflight_checkpoint_rule``: ``(model_path, quantization,
            options) -> MtpFinding | None``.

    Returns:
        The prediction with its reason and the source of the rule applied.
    """
    cfg = read_config(model_path)
    q = describe_quantization(model_path)
    arch = (cfg.get("architectures") or [None])[0]
    dtype = cfg.get("torch_dtype") or cfg.get("dtype") or (cfg.get("text_config") or {}).get("dtype")
    base = {"backend": backend, "quantization": {k: v for k, v in q.items() if k != "raw"} | (
        {"quantization_config": q["raw"]} if "raw" in q else {}), "architecture": arch, "dtype": dtype}
    if not cfg:
        return PreflightResult(**base, accepted=None, reason=f"no readable config.json at {model_path}; nothing to predict")
    damaged = truncated_files(model_path)
    if damaged:  # no engine loads it: the checkpoint's damage, named before anything starts
        return PreflightResult(**base, accepted=False, failure_class="load-failure", rule_source="safetensors headers "
                               "(bakeoff.analysis.checkpoint_layout.truncated_files)",
                               reason=f"the checkpoint is damaged, not loadable by any engine: {'; '.join(damaged[:3])}")
    beyond = config_beyond_weights(model_path, cfg)
    if beyond:  # an engine would allocate it for minutes before failing: refused in the time a config takes to read
        return PreflightResult(**base, accepted=False, failure_class="config-rejected", reason=beyond,
                               rule_source="config.json against the weight files' sizes "
                                           "(bakeoff.analysis.checkpoint_layout.config_beyond_weights)")
    if rule is None:
        return PreflightResult(**base, accepted=None, reason=f"no preflight rules for backend {backend!r}")
    if cuda is None:
        cuda = has_cuda()
    accepted, reason, source, *named = rule(q, arch, cuda, flags)
    fclass = (named[0] if named else "config-rejected") if accepted is False else None
    result = PreflightResult(**base, accepted=accepted, reason=reason, rule_source=source, failure_class=fclass)
    finding = checkpoint_rule(model_path, q, options or {}) if checkpoint_rule else None
    return _with_finding(result, finding, mtp_requested(options or {})) if finding is not None else result


def _with_finding(result: PreflightResult, finding: Any, blocking: bool) -> PreflightResult:
    """Fold a checkpoint rule's finding into the prediction: a defect refuses the run when the
    feature is requested (it is then the first thing the loader trips on: the engine rule's own
    reason becomes a warning), else it is a warning."""
    result.findings.append(finding.model_dump(mode="json"))
    if finding.status != "defect":
        return result
    if finding.patch:
        result.suggested_patches.append(finding.patch)
    if not blocking:
        result.warnings.append(f"not blocking (no MTP speculative decoding requested): {finding.reason}")
        return result
    if result.accepted is False:
        result.warnings.append(f"also predicted: {result.reason}")
    return result.model_copy(update={
        "accepted": False, "reason": f"speculative_config method mtp: {finding.reason}",
        "rule_source": finding.source, "failure_class": "config-rejected"})


def raise_if_rejected(model_path: str | Path, backend: str, rule: Callable[..., Rule] | None,
                      cuda: bool | None = None, flags: set[str] | None = None, options: dict[str, Any] | None = None,
                      checkpoint_rule: Callable[..., Any] | None = None) -> PreflightResult:
    """Run :func:`preflight`; raise when it predicts a refusal, so nothing is launched.

    Raises:
        EngineFailure: ``config-rejected`` (or ``unsupported-architecture``) with the reason,
            and ``preflight.json`` (the prediction, its rule source, the quantization config)
            as evidence.
    """
    result = preflight(model_path, backend, rule, cuda, flags, options, checkpoint_rule)
    if result.accepted is False:
        raise EngineFailure(result.failure_class or "config-rejected", f"{backend} preflight: {result.reason}",
                            {"preflight.json": json.dumps(result.model_dump(mode="json"), indent=2, default=str)})
    return result
