"""The ``openai`` backend against servers broken on purpose (``tests/fakes/stalling_servers.py``).

A server that answers ``/health`` and never a completion: every request the backend sends
(completions, chat, messages, ``/tokenize``, ``/v1/models``, ``/metrics``, ``/health``) ends
within ``read_timeout_s`` as ``hang`` with its elapsed time, and the whole evaluations suite
against it ends in bounded time. An HTML login page on the port is named as such; a dead port
is told before any reference work.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from backends.openai.backend import OpenAIBackend
from bakeoff.api.errors import EngineFailure
from bakeoff.api.specs import BackendConfig, GenerationRequest
from bakeoff.host.procs import free_port
from bakeoff.loadgen.sweep import run_request
from tests.fakes.stalling_servers import stalling_app
from tests.test_tokenizer_check import serving

REPO = Path(__file__).resolve().parent.parent
TIMEOUT_S = 1.0
# a read timeout of 1 s is watched every 0.5 s (bakeoff/loadgen/http.py Pool._watch); the rest is slack
# for a loaded 2-core host
WITHIN_S = 4.0


def make(tmp_path, url, **options) -> OpenAIBackend:
    return OpenAIBackend(BackendConfig(backend="openai", model="remote", workdir=str(tmp_path), start_timeout_s=30,
                                       options={"base_url": url, "read_timeout_s": TIMEOUT_S, **options}))


def timed(fn):
    t0 = time.monotonic()
    try:
        return fn(), time.monotonic() - t0
    except EngineFailure as exc:
        return exc, time.monotonic() - t0


def stream_once(backend, request_id="r") -> tuple:
    async def main():
        try:
            return await run_request(backend, GenerationRequest(request_id=request_id, prompt="hello", max_tokens=4))
        finally:
            await backend.aclose()
    return timed(lambda: asyncio.run(main()))


@pytest.fixture(scope="module")
def stall_url():
    with serving(stalling_app("stall")) as url:
        yield url


@pytest.mark.parametrize("api", ["completions", "chat", "messages"])
def test_every_api_stream_is_a_hang_within_the_read_timeout(stall_url, tmp_path, api):
    b = make(tmp_path, stall_url, api=api)
    assert b.start().served_model == "fake-stall"
    # no token counters on /metrics (it stalls): a timeout is a hang as before, and the run says so
    assert b.info.notes["progress"].startswith("none: GET /metrics shows no token counters"), b.info.notes
    rec, took = stream_once(b)
    assert took < WITHIN_S, f"{api}: {took:.1f} s for a {TIMEOUT_S} s read timeout"
    assert rec.status == "error" and rec.error_class == "hang", rec
    assert "no byte for 1 s" in rec.error and "the request was open" in rec.error, rec.error
    # the server is wedged: the next request fails at once, naming the first
    rec2, took2 = stream_once(b, "r2")
    assert rec2.error_class == "hang" and rec2.error.startswith("engine hung earlier:") and took2 < 0.5


def test_a_trickle_is_cut_at_its_time_bound_and_later_streams_are_not_sent(tmp_path):
    """A byte every 50 ms resets the read timeout: the stream is cut at its time bound
    (``stream_bounds``: 5 read timeouts + 2 s a token) as ``protocol-violation``, and the next
    stream fails at once naming it (each would take the bound again: 240 probes took 10 min)."""
    with serving(stalling_app("trickle")) as url:
        b = make(tmp_path, url)
        b.start()
        rec, took = stream_once(b)
        assert rec.error_class == "protocol-violation" and "still streaming after" in rec.error, rec
        assert 5 * TIMEOUT_S + 4 * 2.0 - 1 <= took < 5 * TIMEOUT_S + 4 * 2.0 + WITHIN_S, took
        rec2, took2 = stream_once(b, "r2")
        assert rec2.error_class == "protocol-violation" and rec2.error.startswith("not sent: an earlier stream ran past"), rec2
        assert took2 < 0.5


def test_tokenize_and_metrics_are_hangs_within_the_read_timeout(stall_url, tmp_path):
    b = make(tmp_path, stall_url)
    b.start()
    for call in (lambda: b.tokenize(["a b c"]), b.metrics):
        exc, took = timed(call)
        assert isinstance(exc, EngineFailure) and exc.failure_class == "hang", exc
        assert took < WITHIN_S and "no byte for 1 s" in exc.message and "open" in exc.message, (took, exc.message)
        assert json.loads(exc.evidence["hang.json"])["elapsed_s"] >= TIMEOUT_S * 0.9
    exc, took = timed(b.metrics)  # a wedged /metrics is not read again (counters are polled)
    assert exc.failure_class == "hang" and exc.message.startswith("engine hung earlier: GET") and took < 0.5


def test_a_server_that_never_answers_is_a_hang_at_start(tmp_path):
    with serving(stalling_app("stall-all")) as url:
        exc, took = timed(make(tmp_path, url).start)
    assert isinstance(exc, EngineFailure) and exc.failure_class == "hang", exc
    assert "GET /health nor GET /v1/models within 1 s" in exc.message and took < 2 * WITHIN_S


@pytest.mark.parametrize("model", [None, "named"])
def test_an_html_login_page_is_not_an_openai_server(tmp_path, model):
    with serving(stalling_app("html")) as url:
        b = make(tmp_path, url, **({"model": model} if model else {}))
        exc, _ = timed(b.start)
    assert isinstance(exc, EngineFailure) and exc.failure_class == "load-failure", exc
    assert "answered HTML, not JSON (Content-Type text/html)" in exc.message and "<!DOCTYPE html>" in exc.message
    assert "first bytes: '<!DOCTYPE html>" in exc.evidence["probe.txt"]


def test_an_html_404_beside_a_json_health_is_still_an_api(tmp_path):
    with serving(stalling_app("html-404")) as url:
        assert make(tmp_path, url, model="named").start().served_model == "named"
        exc, _ = timed(make(tmp_path, url).start)
    assert isinstance(exc, EngineFailure) and exc.failure_class == "config-rejected" and "lists none" in exc.message


def test_a_dead_port_is_told_in_seconds(tmp_path):
    exc, took = timed(make(tmp_path, f"http://127.0.0.1:{free_port()}").probe)
    assert isinstance(exc, EngineFailure) and exc.failure_class == "load-failure" and "nothing answers at" in exc.message
    assert took < 5


# ---- the whole suite ------------------------------------------------------------------------

def tiny_checkpoint(folder: Path) -> Path:
    """A checkpoint folder with a config and a real (word-level) tokenizer, no weights: enough
    for the suite's reference tokenizer; nothing here needs the model to run."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder.mkdir(parents=True)
    words = ["[UNK]", "<|endoftext|>"] + [str(i) for i in range(100)] + "count copy the a of to and =>".split()
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                              "unk_token": "[UNK]", "eos_token": "<|endoftext|>"}))
    (folder / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
                                                    "vocab_size": len(words), "hidden_size": 64,
                                                    "num_hidden_layers": 1, "num_attention_heads": 2,
                                                    "num_key_value_heads": 1, "intermediate_size": 128}))
    return folder


def suite(tmp_path: Path, url: str, timeout_s: float = 240) -> tuple[subprocess.CompletedProcess, float, Path]:
    art = tmp_path / "art"
    cmd = [sys.executable, "-m", "pytest", str(REPO / "evaluations"), "-q", "-p", "no:cacheprovider",
           "--backend", "openai", "--backend-opt", f"base_url={url}", "--backend-opt", "read_timeout_s=1",
           "--model", str(tiny_checkpoint(tmp_path / "ckpt")), "--artifacts", str(art)]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=timeout_s,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    runs = list((art / "runs").iterdir())
    assert len(runs) == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, time.monotonic() - t0, runs[0]


def test_the_suite_against_a_stalling_server_ends_in_bounded_time_as_hang(tmp_path):
    """``pytest evaluations/ --backend openai ... read_timeout_s=1`` against a server that
    answers ``/health`` and ``/v1/models`` and nothing else: done well within a minute, the
    checks that sent requests failed as ``hang`` (none as ``runtime-crash``), no reference
    computed, the verdict disqualified."""
    with serving(stalling_app("stall")) as url:
        proc, took, run = suite(tmp_path, url)
    verdict = json.loads((run / "verdict.json").read_text())
    checks = {c["name"]: c for c in verdict["checks"]}
    assert took < 60, f"{took:.0f} s: {proc.stdout[-2000:]}"
    assert checks["load"]["status"] == "pass", checks["load"]
    failed = {n: c for n, c in checks.items() if c["status"] == "fail"}
    assert "sanity.tokenizer" in failed and "sanity.known_answers" in failed, sorted(failed)
    assert {c["failure_class"] for c in failed.values()} == {"hang"}, {n: c["failure_class"] for n, c in failed.items()}
    assert "the request was open" in failed["sanity.tokenizer"]["summary"]
    # an attached server's reference is computed when first asked for, and not once the engine hung
    assert not (run / "engine" / "reference").exists(), "a reference was computed for a hung engine"
    assert verdict["status"] == "disqualified" and any(r.startswith("sanity.tokenizer: hang:") for r in verdict["reasons"])


def test_the_suite_against_a_dead_port_ends_in_seconds_before_any_reference(tmp_path):
    """A dead port is the load check's failure in seconds: no transformers reference is
    started first (it is what took 97 s before the port was named)."""
    proc, took, run = suite(tmp_path, f"http://127.0.0.1:{free_port()}")
    checks = {c["name"]: c for c in json.loads((run / "verdict.json").read_text())["checks"]}
    assert checks["load"]["status"] == "fail" and checks["load"]["failure_class"] == "load-failure", checks["load"]
    assert "nothing answers at" in checks["load"]["summary"]
    assert not (run / "engine" / "reference").exists(), "the reference was started before the dead port was named"
    assert all(c["status"] in ("skip", "fail") for n, c in checks.items() if n not in ("load", "loadgen.calibration"))
    assert took < 60, f"{took:.0f} s"
