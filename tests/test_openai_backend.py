"""The ``openai`` backend (attach to a running server) against the synthetic SSE server."""

from __future__ import annotations

import asyncio
import json

import pytest

import backends
from backends.openai.backend import OpenAIBackend
from bakeoff.api.errors import EngineFailure, UserError
from bakeoff.loadgen.sweep import closed_loop, run_request
from bakeoff.loadgen.synth_launch import SynthServer
from bakeoff.host.procs import free_port
from bakeoff.api.specs import BackendConfig, GenerationRequest


@pytest.fixture(scope="module")
def server():
    with SynthServer({"ttft": {"ms": 5}, "itl": {"ms": 1}, "output_tokens": 6, "model": "served-x",
                      "reasoning_tokens": 2}) as srv:
        yield srv


def make(tmp_path, **options) -> OpenAIBackend:
    return OpenAIBackend(BackendConfig(backend="openai", model="remote", workdir=str(tmp_path), options=options,
                                       start_timeout_s=10))


def run(backend, req):
    async def main():
        try:
            return await run_request(backend, req)
        finally:
            await backend.aclose()
    return asyncio.run(main())


def test_the_context_length_the_server_states_bounds_the_long_prompts(tmp_path):
    """A vLLM server started with --max-model-len 512 states it in GET /v1/models: attached, the
    long-context checks size within it (before, they assumed 2,048 tokens: HTTP 400 on 513-token
    prompts and a wrong `config-rejected` verdict); --backend-opt max_model_len states it by hand."""
    with SynthServer({"model": "m", "max_model_len": 512, "output_tokens": 2}) as srv:
        info = make(tmp_path, base_url=srv.url).start()
        assert info.max_model_len == 512 and info.notes["max_model_len"] == "GET /v1/models"
        info = make(tmp_path, base_url=srv.url, max_model_len=300).start()
        assert info.max_model_len == 300 and info.notes["max_model_len"] == "--backend-opt max_model_len"
    with SynthServer({"model": "m", "output_tokens": 2}) as srv:
        info = make(tmp_path, base_url=srv.url).start()
        assert info.max_model_len is None and "max_model_len" not in info.notes


def test_a_dropped_models_answer_is_asked_again_not_read_as_an_empty_list(tmp_path):
    """Census 5.13: a server that drops every second connection dropped GET /v1/models, and the
    run was config-rejected "lists none (status 0)"; asked again, it answers."""
    import http.server
    import threading

    seen = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_GET(self):
            seen.append(self.path)
            if self.path == "/v1/models" and seen.count("/v1/models") == 1:
                self.close_connection = True
                self.connection.shutdown(2)  # dropped: no status line
                return
            body = json.dumps({"data": [{"id": "m"}]} if self.path == "/v1/models" else {"status": "ok"}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        info = make(tmp_path, base_url=f"http://127.0.0.1:{httpd.server_address[1]}").start()
        assert info.served_model == "m" and seen.count("/v1/models") == 2
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_registry_resolves_openai():
    assert backends.resolve("openai") is OpenAIBackend


def test_unknown_option_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="unknown option 'colour'"):
        make(tmp_path, base_url="http://127.0.0.1:1", colour="red")
    with pytest.raises(UserError, match="base_url"):
        make(tmp_path)


def test_start_learns_model_and_stop_leaves_server_running(server, tmp_path):
    b = make(tmp_path, base_url=server.url + "/v1")
    info = b.start()
    assert info.backend == "openai" and info.served_model == "served-x" and info.base_url == server.url
    b.stop()
    b.stop()
    b2 = make(tmp_path, base_url=server.url, model="explicit")
    assert b2.start().served_model == "explicit"
    rec = run(b2, GenerationRequest(request_id="after-stop", prompt="hi", max_tokens=6))
    assert rec.status == "ok", "stop() must not touch the remote server"


@pytest.mark.parametrize("api", ["completions", "chat", "messages"])
def test_streams_each_api_with_reasoning_apart(server, tmp_path, api):
    b = make(tmp_path, base_url=server.url, api=api)
    b.start()
    rec = run(b, GenerationRequest(request_id=f"be-{api}", prompt="hello there", max_tokens=6))
    assert rec.status == "ok" and rec.output_tokens == 6 and rec.output_tokens_source.startswith("server-usage")
    assert rec.reasoning_tokens == (0 if api == "completions" else 2)
    assert rec.first_token_ns > rec.sent_ns and len(rec.token_times_ns) == 6


def test_unreachable_server_is_a_load_failure(tmp_path):
    b = make(tmp_path, base_url=f"http://127.0.0.1:{free_port()}")
    with pytest.raises(EngineFailure) as ei:
        b.start()
    assert ei.value.failure_class == "load-failure"


def test_api_key_is_sent_but_never_recorded(server, tmp_path, monkeypatch):
    monkeypatch.setenv("BAKEOFF_TEST_KEY", "sk-secret-123")
    b = make(tmp_path, base_url=server.url, api_key_env="BAKEOFF_TEST_KEY")
    info = b.start()
    assert "sk-secret-123" not in json.dumps(info.model_dump()) + json.dumps(b.options.model_dump())
    rec = run(b, GenerationRequest(request_id="keyed", prompt="x", max_tokens=6))
    assert rec.status == "ok"
    assert server.records(expect=1)["keyed"]["auth"] is True


def test_tokenizer_option_counts_tokens(server, tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers

    tok = tokenizers.Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "tokenizer.json"))
    b = make(tmp_path, base_url=server.url, tokenizer=str(tmp_path), extra_body={"synth": {"usage": "never"}})
    b.start()
    assert b.count_tokens("a b c") == 3

    async def main():
        try:
            return await run_request(b, GenerationRequest(request_id="tok", prompt="x", max_tokens=6),
                                     count_tokens=b.count_tokens)
        finally:
            await b.aclose()
    rec = asyncio.run(main())
    assert rec.output_tokens == 6 and rec.output_tokens_source == "client-tokenizer"


def test_closed_loop_through_backend(server, tmp_path):
    b = make(tmp_path, base_url=server.url, api="chat")
    b.start()

    async def main():
        try:
            return await closed_loop(b, lambda i, t: GenerationRequest(request_id=f"cl-{i}-{t}", prompt="p",
                                                                       max_tokens=6), 4, 2)
        finally:
            await b.aclose()
    recs, wall = asyncio.run(main())
    assert len(recs) == 8 and all(r.status == "ok" for r in recs) and wall > 0
