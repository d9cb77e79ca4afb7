"""Speculative decoding per fresh start, for real: llama.cpp's server (``xllamacpp``) on the real model's GGUF
with the same GGUF as its draft (``draft_gguf=self``), two starts. The model drafting for itself must have
nearly every drafted token accepted at every start (``SELF_DRAFT_FLOOR``), the engine restarted between
them by the check, and its 64-token outputs must agree with the reference's (``spec_decode.lossless``); a
draft value that is not a file is the user's one-line error."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bakeoff.api.errors import UserError
from bakeoff.api.specs import BackendConfig
from backends.llamacpp.backend import LlamaCppBackend

REPO = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.slow, pytest.mark.engine("llamacpp")]


def test_a_draft_that_is_not_a_file_is_refused_in_one_line(tmp_path):
    with pytest.raises(UserError) as e:
        LlamaCppBackend(BackendConfig(backend="llamacpp", model=str(tmp_path), workdir=str(tmp_path / "w"),
                                      options={"draft_gguf": str(tmp_path / "missing.gguf")}))
    assert "draft_gguf" in str(e.value) and "self" in str(e.value) and "\n" not in str(e.value)


def test_the_model_as_its_own_draft_accepts_nearly_every_token_at_each_fresh_start(tmp_path):
    art = tmp_path / "art"
    cmd = [sys.executable, "-m", "pytest", "evaluations/", "-p", "no:cacheprovider", "-q", "--backend", "llamacpp",
           "--model=smollm2-135m-instruct", f"--artifacts={art}", "--backend-opt", "draft_gguf=self",
           "--backend-opt", "parallel_slots=4", "--spec-starts=2", "-k", "test_load or test_acceptance or test_spec_lossless"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=900)
    runs = sorted((art / "runs").glob("*/verdict.json"))
    assert runs, proc.stdout[-3000:] + proc.stderr[-3000:]
    checks = {c["name"]: c for c in json.loads(runs[-1].read_text())["checks"]}
    acc = checks["spec_decode.acceptance"]
    assert acc["status"] == "pass", (acc, proc.stdout[-2000:])
    v = acc["values"]
    assert v["self_draft"] is True and v["fresh_starts"] == 2 and [s["start"] for s in v["starts"]] == [1, 2]
    assert all(s["drafts"] > 0 and s["acceptance_rate"] >= v["self_draft_floor"] for s in v["starts"]), v["starts"]
    log = (runs[-1].parent / "engine" / "llamacpp.log").read_text(errors="replace")
    assert log.count("llamacpp worker: serving") == 2, log[-2000:]  # started twice: the run's start and one restart
    lossless = checks["spec_decode.lossless"]
    assert lossless["status"] == "pass" and lossless["values"]["real"] == 0, lossless
