"""Which dtype a half-precision checkpoint runs in on this CPU, when the user did not say.

A bf16 (or fp16) checkpoint asks the engine to compute in that dtype. CPUs with native bf16
arithmetic (x86 ``avx512_bf16`` or ``amx_bf16``; the AVX-512 kind of this project's hosts has
``avx512_bf16``) run it at full speed; the others (the AVX2-only kind) emulate it, converting
every operand, and are several times slower than in float32 (docs/field-notes.md: the
transformers reference ran SmolLM2-135M-Instruct's bf16 checkpoint at 6 tok/s at 1 session on
such a host). So where an engine's ``dtype`` is left to bakeoff, a half-precision checkpoint
runs in float32 on a CPU without native support for its dtype, and in its own dtype on one with
it; :func:`default_dtype` says which and why, for the run's notes. The figures behind the rule
(float32 against bf16 per engine, both CPU kinds) are in ``docs/field-notes.md`` "Each engine's
dtype on the CPU".

float32 is also what the transformers reference runs on CPU (``evaluations/reference.py``): the
reference is the yardstick, not a measured engine, and float32 makes its answers the least
sensitive to the host's kernels.
"""

from __future__ import annotations

import json
import platform
from dataclasses import dataclass
from pathlib import Path

NATIVE = {"bfloat16": ("avx512_bf16", "amx_bf16"), "float16": ("avx512_fp16", "amx_fp16")}
ARM_NATIVE = {"bfloat16": ("bf16",), "float16": ("fphp", "asimdhp")}


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The CPU's feature flags (``/proc/cpuinfo``: x86 ``flags``, ARM ``Features``); empty where
    unreadable."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return set()
    for line in cpuinfo.splitlines():
        key = line.split(":", 1)[0].strip().lower()
        if key in ("flags", "features") and ":" in line:
            return set(line.split(":", 1)[1].split())
    return set()


def native(dtype: str, flags: set[str] | None = None, machine: str | None = None) -> bool:
    """Whether this CPU computes ``dtype`` natively (float32 always)."""
    if dtype == "float32":
        return True
    flags = cpu_flags() if flags is None else flags
    machine = (machine or platform.machine()).lower()
    want = ARM_NATIVE if machine in ("aarch64", "arm64") else NATIVE
    return any(f in flags for f in want.get(dtype, ()))


def checkpoint_dtype(model: str | Path) -> str | None:
    """The dtype a local checkpoint's ``config.json`` states (``dtype`` or ``torch_dtype``), or None."""
    try:
        cfg = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(cfg, dict):
        return None
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}
    for c in (cfg, text):
        for key in ("dtype", "torch_dtype"):
            if isinstance(c.get(key), str):
                return c[key]
    return None


@dataclass
class DtypeChoice:
    """``dtype``: what to pass the engine (None: leave the engine its own default); ``note``: why,
    one line for the run's notes."""

    dtype: str | None
    note: str


def default_dtype(model: str | Path, flags: set[str] | None = None, machine: str | None = None) -> DtypeChoice:
    """bakeoff's dtype for ``model`` on this CPU when the user left it unset (module docstring)."""
    ckpt = checkpoint_dtype(model)
    if ckpt not in NATIVE:
        return DtypeChoice(None, f"the checkpoint's ({ckpt or 'unstated'})")
    flags = cpu_flags() if flags is None else flags
    if native(ckpt, flags, machine):
        have = next(f for f in (*NATIVE[ckpt], *ARM_NATIVE[ckpt]) if f in flags)
        return DtypeChoice(None, f"the checkpoint's ({ckpt}): this CPU computes it natively ({have})")
    return DtypeChoice("float32", f"float32, not the checkpoint's {ckpt}: this CPU has no native {ckpt} "
                                  f"({' / '.join(NATIVE[ckpt])} absent), where float32 is faster (bakeoff.host.cpu_dtype)")
