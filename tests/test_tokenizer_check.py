"""``sanity.tokenizer``: the engine's own token ids against the reference tokenizer's.

Fast part: the comparison rules on hand-made ids, the ``/tokenize`` client against FAKE servers
(``tests/fakes/tokenize_servers.py``) of every shape it must tell apart, the workers' route with
a FAKE engine, and the TensorRT-LLM worker with the FAKE ``tensorrt_llm``. Slow part: the real
suite (``pytest evaluations/ -k tokenizer``) on real engines over the trained fixture, which
must pass, and on engines broken on purpose, which must fail: a copy of the fixture whose
``tokenizer_config.json`` names ``Qwen3_5Tokenizer``, a class ONNX Runtime GenAI refuses (its
engine then falls back to ``tokenizer.json``) and that transformers honours with its own
pre-tokenizer (the user's report), and a FAKE server whose ``/tokenize`` shifts every id.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from backends._tokenize import server_tokenize
from bakeoff.models import fixtures
from bakeoff.api.errors import EngineFailure
from bakeoff.host.procs import free_port
from evaluations.tokenizing import describer, first_difference, mismatches, reference_ids, reference_tokenizer
from tests.fakes.tokenize_servers import tokenize_app

REPO = Path(__file__).resolve().parent.parent
REFUSED_CLASS = "Qwen3_5Tokenizer"  # og 0.18.0: "Unsupported tokenizer class"; transformers 5: its own pipeline


@pytest.fixture(scope="module")
def trained() -> Path:
    return Path(fixtures.build("tiny-qwen3"))


@pytest.fixture(scope="module")
def refused_class_copy(trained, tmp_path_factory) -> Path:
    """The fixture with ``tokenizer_class`` set to a class ORT GenAI refuses (weights unchanged)."""
    dst = tmp_path_factory.mktemp("tok") / "tiny-qwen3-qwen35-tokenizer"
    shutil.copytree(trained, dst)
    cfg = json.loads((dst / "tokenizer_config.json").read_text())
    cfg["tokenizer_class"] = REFUSED_CLASS
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1))
    return dst


@contextlib.contextmanager
def serving(app):
    """Serve an aiohttp ``app`` on a loop in a thread; yields its base URL."""
    from aiohttp import web

    loop, port, up = asyncio.new_event_loop(), free_port(), threading.Event()
    runner = web.AppRunner(app, access_log=None)

    def run():
        asyncio.set_event_loop(loop)
        loop.run_until_complete(runner.setup())
        loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
        up.set()
        loop.run_forever()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert up.wait(10)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


# ---- the rules ------------------------------------------------------------------------------

def test_first_difference_and_mismatch_rows(trained):
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2  # a prefix differs at the shorter one's end
    tok, why = reference_tokenizer(str(trained))
    assert tok is not None, why
    texts = ["count: 26 27 28 29 =>", "copy: ab =>"]
    want, _ = reference_ids(tok, texts, chat=False)
    bos = tok.convert_tokens_to_ids("<|startoftext|>")
    got = [[bos] + want[0], list(want[1])]
    got[1][2] += 1
    rows = mismatches(texts, want, got, "text", describer(tok), set(tok.all_special_ids))
    assert [r["prompt"] for r in rows] == texts
    assert rows[0]["first_difference"] == 0 and "engine adds id" in rows[0]["note"]
    assert rows[0]["engine_token"]["piece"] == "<|startoftext|>"
    assert rows[1]["first_difference"] == 2 and rows[1]["note"] == ""
    assert rows[1]["reference_token"]["id"] == want[1][2] and rows[1]["engine_token"]["id"] == want[1][2] + 1
    assert rows[1]["reference_token"]["text"] == tok.decode([want[1][2]])
    assert mismatches(texts, want, [list(w) for w in want], "text", describer(tok)) == []
    chat, _ = reference_ids(tok, texts[:1], chat=True)
    assert chat[0][:1] == [tok.convert_tokens_to_ids("<|im_start|>")] and len(chat[0]) > len(want[0])


def test_server_tokenize_tells_the_shapes_apart(trained):
    texts = ["count: 1 2 3 =>", "copy: ab =>"]
    from tokenizers import Tokenizer

    real = [Tokenizer.from_file(str(trained / "tokenizer.json")).encode(t).ids for t in texts]
    with serving(tokenize_app("shifted", str(trained))) as url:
        ids, note = server_tokenize(url, texts, model="m")
        assert ids == [[t + 1 for t in r] for r in real] and note == ""
    app = tokenize_app("faithful", str(trained))
    with serving(app) as url:
        assert server_tokenize(url, texts[:1], chat=True)[0] is not None
        assert app["seen"][-1] == {"messages": [{"role": "user", "content": texts[0]}], "add_generation_prompt": True,
                                   "add_special_tokens": False}
    with serving(tokenize_app("sglang", str(trained))) as url:  # only /v1/tokenize
        assert server_tokenize(url, texts)[0] == real
    with serving(tokenize_app("no-route")) as url:
        ids, note = server_tokenize(url, texts)
        assert ids is None and "no /tokenize route" in note
    with serving(tokenize_app("other-shape")) as url:  # 200 with no ids: not believed
        ids, note = server_tokenize(url, texts)
        assert ids is None and "shape" in note
    with serving(tokenize_app("broken")) as url:
        with pytest.raises(EngineFailure) as ei:
            server_tokenize(url, texts)
        assert ei.value.failure_class == "runtime-crash" and "500" in ei.value.message


class FakeWorkerEngine:
    """FAKE worker engine (``backends._hosting.worker_server.WorkerEngine``): ids are the characters' code points."""

    def info(self):
        return {"max_model_len": 64}

    def metrics(self):
        return {}

    def tokenize(self, prompt):
        if prompt == "boom":
            raise ValueError("FAKE: cannot encode")
        return [ord(c) for c in prompt]


class NoTokenizeEngine:
    """FAKE worker engine without ``tokenize``."""

    def info(self):
        return {}

    def metrics(self):
        return {}


def test_worker_route_serves_the_engines_ids():
    from backends._hosting.worker_server import build_app

    with serving(build_app(FakeWorkerEngine(), "m")) as url:
        assert server_tokenize(url, ["ab", "c"]) == ([[97, 98], [99]], "")
        # chat: what the worker's chat route feeds the engine (contents, one per line)
        assert server_tokenize(url, ["ab"], chat=True)[0] == [[97, 98]]
        req = urllib.request.Request(url + "/tokenize", json.dumps({"prompt": "ab", "add_special_tokens": False}).encode(),
                                     {"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=10)
        assert err.value.code == 400 and "add_special_tokens" in err.value.read().decode()
        with pytest.raises(EngineFailure, match="FAKE: cannot encode"):
            server_tokenize(url, ["boom"])
    with serving(build_app(NoTokenizeEngine(), "m")) as url:  # an engine without tokenize: 404, cannot say
        ids, note = server_tokenize(url, ["ab"])
        assert ids is None and "404" in note


def test_trtllm_worker_reports_its_llm_tokenizer(tmp_path, monkeypatch):
    """The FAKE tensorrt_llm's tokenizer (code points) answers through the real worker and route."""
    from backends.trtllm.backend import TrtllmBackend
    from bakeoff.host import envs
    from bakeoff.api.specs import BackendConfig

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO / "tests" / "fakes"), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setattr(envs, "has_cuda", lambda: True)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"]}))
    b = TrtllmBackend(BackendConfig(backend="trtllm", model=str(model), workdir=str(tmp_path / "w"),
                                    options={"python": sys.executable}, start_timeout_s=120))
    try:
        b.start()
        assert b.tokenize(["Say hi", "é"]) == [[ord(c) for c in "Say hi"], [233]]
    finally:
        b.stop()


# ---- the real suite -------------------------------------------------------------------------

def _suite(tmp: Path, backend: str, model: str, *opts: str) -> dict:
    """``pytest evaluations/ -k tokenizer``; returns the ``sanity.tokenizer`` check (its evidence loaded)."""
    art = tmp / "art"
    cmd = [sys.executable, "-m", "pytest", "evaluations/", "-p", "no:cacheprovider", "-q", "--backend", backend,
           f"--model={model}", f"--artifacts={art}", *opts, "-k", "tokenizer"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=900)
    runs = sorted((art / "runs").glob("*/checks/sanity.tokenizer.json"))
    assert runs, proc.stdout[-3000:] + proc.stderr[-3000:]
    check = json.loads(runs[-1].read_text())
    check["files"] = {Path(p).name: json.loads((runs[-1].parent.parent / p).read_text()) for p in check["evidence"]}
    return check


def _assert_pass(check: dict, forms: tuple[str, ...] = ("text",)) -> None:
    assert check["status"] == "pass", check["summary"]
    v = check["values"]
    assert v["mismatched"] == 0 and tuple(v["compared"]) == forms and all(n == v["prompts"] > 0 for n in v["compared"].values())
    assert all(r["engine_ids"] == r["reference_ids"] and r["engine_ids"] for r in check["files"]["sample.json"])


def _assert_refused_class_fails(check: dict) -> None:
    assert check["status"] == "fail" and check["failure_class"] == "accuracy-regression", check["summary"]
    rows = check["files"]["mismatches.json"]
    assert rows and check["values"]["mismatched"] == len(rows) < check["values"]["prompts"]
    r = rows[0]
    i = r["first_difference"]
    assert r["reference_ids"][:i] == r["engine_ids"][:i] and r["reference_ids"][i] != r["engine_ids"][i]
    assert r["reference_token"]["text"] is not None and r["engine_token"]["text"] is not None
    assert r["prompt"][:20] in check["summary"]


@pytest.mark.slow
@pytest.mark.engine("transformers")
def test_transformers_worker_passes_and_a_tokenizer_class_change_fails(tmp_path, trained, refused_class_copy):
    _assert_pass(_suite(tmp_path / "same", "transformers", "fixture:tiny-qwen3"))
    # the candidate honours Qwen3_5Tokenizer, the reference (the original fixture) tokenizer.json
    check = _suite(tmp_path / "class", "transformers", str(refused_class_copy), "--reference-model=fixture:tiny-qwen3")
    _assert_refused_class_fails(check)
    assert check["values"]["reference_tokenizer"].startswith("TokenizersBackend")


@pytest.mark.slow
@pytest.mark.engine("ort-genai")
def test_ort_genai_int4_passes_and_its_tokenizer_fallback_fails(tmp_path, trained, refused_class_copy):
    _assert_pass(_suite(tmp_path / "same", "ort-genai", "fixture:tiny-qwen3", "--backend-opt", "precision=int4"))
    check = _suite(tmp_path / "class", "ort-genai", str(refused_class_copy), "--backend-opt", "precision=int4")
    _assert_refused_class_fails(check)
    assert check["values"]["reference_tokenizer"].startswith(REFUSED_CLASS)
    assert REFUSED_CLASS in check["values"]["engine_tokenizer_notes"]["fallback"]
    assert "fallback: " in check["summary"]


@pytest.mark.slow
@pytest.mark.engine("vllm")
def test_vllm_chat_run_passes_as_text_and_as_chat(tmp_path, trained):
    # 1 GiB of KV, explicitly: vLLM CPU fills its default (half the node, 11 GiB here) at every
    # start, 10-12 s on an idle host and about 30 s on a busy one; 0.5 s for 1 GiB
    _assert_pass(_suite(tmp_path, "vllm", "fixture:tiny-qwen3", "--backend-opt", "api=chat", "--backend-opt",
                        "kv_cache_space_gib=1"), ("text", "chat"))


class _Fake:
    """A FAKE tokenize server (``tests/fakes/tokenize_servers.py``) in a child process."""

    def __init__(self, kind: str, tokenizer: Path, log: Path):
        self.port = free_port()
        self.log = open(log, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.fakes.tokenize_servers", kind, "--port",
                                      str(self.port), "--tokenizer", str(tokenizer)], cwd=REPO, stdout=self.log,
                                     stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2):
                    return
            except OSError:
                assert self.proc.poll() is None, log.read_text()
                time.sleep(0.3)
        raise AssertionError(log.read_text())

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)
        self.log.close()


@pytest.mark.slow
@pytest.mark.engine("transformers")
def test_openai_server_with_shifted_ids_fails_and_without_route_skips(tmp_path, trained):
    for kind in ("shifted", "no-route"):
        fake = _Fake(kind, trained, tmp_path / f"{kind}.log")
        try:
            check = _suite(tmp_path / kind, "openai", "fixture:tiny-qwen3", "--backend-opt", f"base_url={fake.url}")
        finally:
            fake.close()
        if kind == "shifted":
            assert check["status"] == "fail" and check["failure_class"] == "accuracy-regression", check["summary"]
            rows = check["files"]["mismatches.json"]
            assert len(rows) == check["values"]["prompts"]  # every prompt
            assert all(r["engine_ids"] == [t + 1 for t in r["reference_ids"]] and r["first_difference"] == 0 for r in rows)
        else:
            assert check["status"] == "skip" and "no /tokenize route" in check["summary"], check["summary"]
            assert check["values"]["compared"] == {}
