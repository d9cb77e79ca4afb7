"""Secrets never reach the disk: environment values, engine log output, verdicts, reports.

Planted: ``HF_TOKEN=hf_...``, ``OPENAI_API_KEY=sk-...``, a secret-named value that matches no
pattern (``MY_SERVICE_PASSWORD``), and an ``Authorization: Bearer ...`` header value in a
recorded variable (``OPENAI_DEFAULT_HEADERS``). An engine echoes them into its log (a child
given the secrets in its own environment only), and the real suite runs with them set, on
a checkpoint whose error message quotes the password. Every file under the artifacts
folder is then searched for every value.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from backends._server import ChildServerBackend
from bakeoff.api.errors import EngineFailure
from bakeoff.api.specs import BackendConfig, Spec

REPO = Path(__file__).resolve().parent.parent
TOKEN = "hf_" + secrets.token_hex(16)
API_KEY = "sk-" + secrets.token_hex(16)
PASSWORD = "horse-battery-" + secrets.token_hex(6)  # matches no pattern: masked because of its variable's name
BEARER = secrets.token_hex(20)
SECRET_ENV = {"HF_TOKEN": TOKEN, "OPENAI_API_KEY": API_KEY, "MY_SERVICE_PASSWORD": PASSWORD,
              "OPENAI_DEFAULT_HEADERS": f"Authorization: Bearer {BEARER}"}
VALUES = (TOKEN, API_KEY, PASSWORD, BEARER)


def leaks(root: Path) -> list[str]:
    """``file: value`` for every planted value found in any file under ``root``."""
    found = []
    for f in root.rglob("*"):
        if f.is_file():
            data = f.read_bytes()
            found += [f"{f.relative_to(root)}: {v[:6]}..." for v in VALUES if v.encode() in data]
    return found


class EchoBackend(ChildServerBackend):
    """A child that prints its secrets the way a chatty engine would, then serves nothing."""

    name = "echo"
    Options = Spec
    ready_mode = "file"
    exit_code = 0

    def command(self, port: int) -> tuple[list[str], dict[str, str]]:
        code = ("import os, sys, json\n"
                "print('token', os.environ['HF_TOKEN'], 'key', os.environ['OPENAI_API_KEY'])\n"
                "print('password=' + os.environ['MY_SERVICE_PASSWORD'])\n"
                "print('sending headers', os.environ['OPENAI_DEFAULT_HEADERS'], file=sys.stderr)\n"
                "print(json.dumps({'headers': {'Authorization': 'Bearer ' + os.environ['OPENAI_DEFAULT_HEADERS'].split()[-1]}}))\n"
                f"sys.exit({self.exit_code}) if {self.exit_code} else None\n"
                f"open({str(self.ready_file)!r}, 'w').write('{{}}')\n"
                "import time; time.sleep(60)\n")
        # the secrets exist in the child's environment only, not in the parent's
        return [sys.executable, "-c", code], {**os.environ, **SECRET_ENV}

    def start(self):
        self.launch(0)


class FailingEchoBackend(EchoBackend):
    exit_code = 3


def test_engine_log_and_failure_evidence_are_redacted(tmp_path):
    assert not any(k in os.environ for k in SECRET_ENV)
    ok = EchoBackend(BackendConfig(backend="echo", model="m", workdir=str(tmp_path / "ok"), start_timeout_s=60))
    ok.start()
    ok.stop()
    log = (tmp_path / "ok" / "echo.log").read_text()
    assert "token ***REDACTED*** key ***REDACTED***" in log and "password=***REDACTED***" in log, log
    bad = FailingEchoBackend(BackendConfig(backend="echo", model="m", workdir=str(tmp_path / "bad"), start_timeout_s=60))
    with pytest.raises(EngineFailure) as err:
        bad.start()
    bad.stop()
    assert err.value.failure_class == "load-failure" and "exited with code 3" in err.value.message
    text = err.value.message + "\n".join(err.value.evidence.values())
    assert not [v for v in VALUES if v in text], text
    assert not leaks(tmp_path)


@pytest.fixture(scope="module")
def secret_runs(tmp_path_factory):
    """The real suite (transformers, untrained fixture) with secrets set: one run loads, one run's
    checkpoint makes the engine quote the password in its error; then a report and a comparison."""
    from bakeoff.models.resolve import resolve

    root = tmp_path_factory.mktemp("secrets")
    art = root / "art"
    src = Path(resolve("fixture:tiny-qwen3-untrained", log=lambda s: None).path)
    echoing = shutil.copytree(src, root / "echoing-model")
    cfg = json.loads((echoing / "config.json").read_text())
    (echoing / "config.json").write_text(json.dumps({**cfg, "model_type": PASSWORD}))
    env = {**os.environ, **SECRET_ENV}
    procs = [subprocess.Popen([sys.executable, "-m", "pytest", "evaluations/", "-p", "no:cacheprovider", "-q",
                               "--backend", "transformers", "--model", model, "--artifacts", str(art),
                               "-k", "test_load or test_capacity"], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for model in ("fixture:tiny-qwen3-untrained", str(echoing))]
    outputs = [p.communicate(timeout=400)[0] for p in procs]
    for sub in (["report", "--artifacts", str(art), "--name", "secrets"],
                ["compare", str(art / "runs"), "--artifacts", str(art), "--name", "secrets-compare"]):
        out = subprocess.run([sys.executable, "-m", "cli.main", *sub], cwd=REPO, env=env, capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
    runs = {json.loads((d / "verdict.json").read_text())["model"]: d for d in (art / "runs").iterdir()}
    return art, runs, outputs, echoing


def test_no_secret_in_any_artifact(secret_runs):
    art, runs, outputs, echoing = secret_runs
    assert len(runs) == 2, outputs
    echo_run = runs[str(echoing)]
    load = {c["name"]: c for c in json.loads((echo_run / "verdict.json").read_text())["checks"]}["load"]
    assert load["failure_class"] == "unsupported-architecture", load  # the engine quoted the password ...
    assert "model type `***REDACTED***`" in load["summary"], load["summary"]  # ... and it was masked
    assert "***REDACTED***" in (echo_run / "engine" / "transformers.log").read_text()
    assert (art / "reports" / "secrets" / "report.md").is_file()
    assert any((art / "reports" / "secrets-compare").iterdir())
    assert not leaks(art)


def test_fingerprint_masks_secret_env_and_headers(secret_runs):
    _, runs, _, _ = secret_runs
    v = json.loads((runs["fixture:tiny-qwen3-untrained"] / "verdict.json").read_text())
    env = v["fingerprint"]["env"]
    assert env["HF_TOKEN"] == "***REDACTED***" and env["OPENAI_API_KEY"] == "***REDACTED***"
    assert env["OPENAI_DEFAULT_HEADERS"] == "Authorization: ***REDACTED***"


def test_trust_remote_code_recorded_false_by_default(secret_runs):
    _, runs, _, _ = secret_runs
    v = json.loads((runs["fixture:tiny-qwen3-untrained"] / "verdict.json").read_text())
    assert v["backend_info"]["notes"]["trust_remote_code"] == "False"
    assert v["options"].get("trust_remote_code", False) is False
    launch = " ".join(v["backend_info"]["launch_command"])
    assert '"trust_remote_code": false' in launch
