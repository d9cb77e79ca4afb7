"""``--patch``: run the engine on a recorded, patched copy of the checkpoint.

``adapters/checkpoint_patches.py`` makes the copy (the source is never modified; each patch is
recorded with the value before and after). ``--patch preflight`` applies the patches the
pre-flight rules suggest for this checkpoint (e.g. ``quantization_config.ignore+=re:.*mtp\\..*``
for a compressed-tensors checkpoint whose BF16 MTP head no ignore pattern covers,
``backends/vllm/preflight.py checkpoint_rule``). The load check records both: the source's
pre-flight finding (``preflight-source.json``), the patches (``checkpoint-patches.json``) and
the patched copy's pre-flight (``preflight.json``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import backends
from adapters.checkpoint_patches import PatchedCheckpoint, apply_patches, parse_patch
from bakeoff.api.errors import UserError
from bakeoff.models.resolve import ResolvedModel

SUGGESTED = "preflight"  # --patch preflight: the pre-flight rules' suggested patches


def check(items: list[str]) -> None:
    """Parse every ``--patch`` before anything is built or written.

    Raises:
        UserError: one line naming the malformed patch and the syntax.
    """
    for item in items:
        if item.strip() != SUGGESTED:
            parse_patch(item)


def apply(model: ResolvedModel, backend: str, options: dict[str, Any], items: list[str]) -> tuple[ResolvedModel, PatchedCheckpoint]:
    """The patched copy of ``model`` (``--patch preflight`` expanded to the rules' suggestions).

    Raises:
        UserError: a model that is not a local folder, or ``preflight`` with nothing suggested.
    """
    if not model.local:
        raise UserError(f"--patch edits a local checkpoint folder; {model.label} is not one (download it first)")
    patches: list[str] = []
    for item in items:
        if item.strip() != SUGGESTED:
            patches.append(item)
            continue
        suggested = backends.preflight(model.path, backend, options=options).suggested_patches
        if not suggested:
            raise UserError(f"--patch {SUGGESTED}: the {backend} pre-flight rules suggest no patch for {model.label}; "
                            "drop it or give the patch (e.g. --patch 'quantization_config.ignore+=re:.*mtp\\..*')")
        patches += [p for p in suggested if p not in patches]
    pc = apply_patches(model.path, patches)
    return dataclasses.replace(model, path=pc.path), pc


def record(scope, source: ResolvedModel, patched: PatchedCheckpoint, backend: str, options: dict[str, Any]) -> None:
    """The load check's record of the patches and of the source's own pre-flight."""
    before = backends.preflight(source.path, backend, options=options)
    scope.evidence("preflight-source.json", before.model_dump())
    scope.evidence("checkpoint-patches.json", patched.record())
    scope.values["patches"] = [c.patch for c in patched.diff]
    scope.values["patched_checkpoint"] = patched.path
    scope.values["preflight_source"] = {"accepted": before.accepted, "reason": before.reason,
                                        "warnings": before.warnings, "suggested_patches": before.suggested_patches}
