"""Source patches of an engine environment: an exact text edit of one installed file, applied by
bakeoff after it installs the environment, and recorded.

Used where a package the engine does not need for the model at hand is imported on its path
anyway and cannot be installed here (vLLM CPU's Qwen3.5 modules reach a torchvision import that
only image processing uses; no CPU torchvision for its torch is on this host's package sources:
``backends/vllm/backend.py``, docs/field-notes.md). The rules:

- a patch names the file (relative to ``site-packages``), the exact text it replaces (found once),
  the replacement and why; the environment's key includes it, so a patched environment is never
  mistaken for an unpatched one;
- a patch whose text is not found (another release of the package) is not forced: it is recorded
  ``not-found`` and the engine then says what it says;
- the outcome of each patch is written into the environment's ``.bakeoff-ready`` record, which a
  backend puts into its run's evidence (:func:`recorded`);
- a preinstalled interpreter (``BAKEOFF_ENVS``) is never edited: its record says so.

Drop a patch once the pinned release no longer needs it.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class SourcePatch:
    """One exact text edit of an installed file.

    Attributes:
        path: the file, relative to the environment's ``site-packages``.
        old: the text replaced; it must occur exactly once.
        new: its replacement.
        why: one line for the evidence: what breaks without it, why the edit is safe.
    """

    path: str
    old: str
    new: str
    why: str

    def key(self) -> list[str]:
        return [self.path, self.old, self.new]


def site_packages(env_root: Path) -> Path:
    """``<venv>/lib/pythonX.Y/site-packages`` of a venv created by this interpreter."""
    return env_root / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def apply(patches: tuple[SourcePatch, ...], root: Path) -> list[dict[str, Any]]:
    """Apply ``patches`` to the files under ``root`` (a ``site-packages``); idempotent.

    Returns:
        One record per patch: ``path``, ``status`` (``applied``, ``already-applied``,
        ``not-found``: the text is absent or not unique, the file is left as it is), ``why``, and
        the file's sha256 prefix before and after.
    """
    out = []
    for p in patches:
        rec: dict[str, Any] = {"path": p.path, "why": p.why, "replaces": p.old, "with": p.new}
        target = root / p.path
        try:
            text = target.read_text()
        except OSError as exc:
            out.append({**rec, "status": "not-found", "detail": f"{type(exc).__name__}: {exc}"})
            continue
        rec["sha256_before"] = _sha(text)
        if p.new in text:  # first: the replacement may contain the text it replaces
            rec.update(status="already-applied", sha256_after=rec["sha256_before"])
        elif text.count(p.old) == 1:
            patched = text.replace(p.old, p.new)
            tmp = target.with_name(f".{target.name}.{os.getpid()}.bakeoff")
            tmp.write_text(patched)
            os.replace(tmp, target)  # atomic: a process importing it sees one version or the other
            rec.update(status="applied", sha256_after=_sha(patched))
        else:
            rec.update(status="not-found", detail=f"the text to replace occurs {text.count(p.old)} times (expected once)")
        out.append(rec)
    return out


def recorded(python: Path | str) -> dict[str, Any]:
    """What the environment of ``python`` records about itself (``.bakeoff-ready``: requirements,
    uninstalled packages, notes, patches); ``{"preinstalled": ...}`` for an interpreter bakeoff did
    not build (nothing of it was edited), ``{}`` when the record is unreadable."""
    root = Path(python).parent.parent
    marker = root / ".bakeoff-ready"
    if not marker.is_file():
        return {"preinstalled": str(python), "patches": "none applied: bakeoff never edits an interpreter it did not build"}
    try:
        return json.loads(marker.read_text())
    except (OSError, ValueError):
        return {}


def summary(record: dict[str, Any]) -> str:
    """One line: each patch's file and status (empty when the environment has none)."""
    patches = record.get("patches")
    if not isinstance(patches, list):
        return ""
    return "; ".join(f"{p.get('path')}: {p.get('status')}" for p in patches)
