"""Side requests (health, models, metrics, tokenize) against hostile servers on 127.0.0.1
(bakeoff/loadgen/side_http.py): a redirect is not followed and the key never leaves its origin;
an endless body and a trickling one are cut at their bounds, in bounded time."""

from __future__ import annotations

import http.server
import json
import threading
import time
import urllib.error
import urllib.request

import pytest

from bakeoff.loadgen.side_http import BodyDeadline, BodyTooLarge, error_body, open_bounded


class _Server:
    """A ThreadingHTTPServer on a free port running ``handler(self)`` for every GET and POST."""

    def __init__(self, handler):
        outer = self
        self.seen: list[dict[str, str]] = []

        class H(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                outer.seen.append(dict(self.headers))
                handler(self)

            do_POST = do_GET

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def serve():
    servers = []

    def make(handler):
        s = _Server(handler)
        servers.append(s)
        return s
    yield make
    for s in servers:
        s.close()


def _ok(h, body=b'{"ok": true}'):
    h.send_response(200)
    h.send_header("Content-Length", str(len(body)))
    h.end_headers()
    h.wfile.write(body)


def _redirect_to(target: "_Server", code: int):
    """A handler answering every request with ``code`` and a Location on ``target``."""
    def redirect(h):
        h.send_response(code)
        h.send_header("Location", target.url + h.path)
        h.send_header("Content-Length", "0")
        h.end_headers()
    return redirect


def test_a_redirect_to_another_port_is_not_followed_and_the_key_stays_home(serve):
    """Fails before: urllib followed the 302 and re-sent ``Authorization`` to the other port."""
    elsewhere = serve(_ok)

    origin = serve(_redirect_to(elsewhere, 302))
    req = urllib.request.Request(origin.url + "/v1/models", headers={"Authorization": "Bearer sk-secret"})
    with pytest.raises(urllib.error.HTTPError) as info:
        open_bounded(req, 5)
    assert info.value.code == 302 and elsewhere.seen == []  # nothing reached the other port
    assert origin.seen[0]["Authorization"] == "Bearer sk-secret"
    text = error_body(info.value, 5)
    assert "redirect to " + elsewhere.url + "/v1/models not followed" in text


def test_the_openai_backends_probe_names_the_redirect(serve, monkeypatch, tmp_path):
    from backends.openai.backend import OpenAIBackend

    elsewhere = serve(_ok)

    origin = serve(_redirect_to(elsewhere, 307))
    monkeypatch.setenv("BAKEOFF_TEST_KEY", "sk-secret")
    from bakeoff.api.specs import BackendConfig

    b = OpenAIBackend(BackendConfig(backend="openai", model="m", workdir=str(tmp_path), options={"base_url": origin.url,
                                                                           "api_key_env": "BAKEOFF_TEST_KEY"}))
    ans = b._get("/health", 5)
    assert ans.status == 307 and "not followed" in ans.body and elsewhere.seen == []


def test_an_endless_body_is_cut_at_the_size_bound(serve):
    def endless(h):
        h.send_response(200)
        h.end_headers()
        try:
            while True:
                h.wfile.write(b"x" * 65536)
        except OSError:
            pass
    s = serve(endless)
    t0 = time.monotonic()
    with pytest.raises(BodyTooLarge, match="passed 1,048,576 bytes"):
        open_bounded(s.url + "/metrics", 5, max_bytes=1 << 20)
    assert time.monotonic() - t0 < 10


def test_a_trickle_is_cut_at_the_whole_request_deadline(serve):
    """One byte every 0.2 s never trips a 1 s read timeout; the 2 s deadline cuts it (fails
    before: each byte reset the timer, and the read went on for as long as the server liked)."""
    def trickle(h):
        h.send_response(200)
        h.end_headers()
        try:
            for _ in range(200):
                h.wfile.write(b"x")
                h.wfile.flush()
                time.sleep(0.2)
        except OSError:
            pass
    s = serve(trickle)
    t0 = time.monotonic()
    with pytest.raises(BodyDeadline, match="still arriving"):
        open_bounded(s.url + "/health", 1, deadline_s=2)
    assert 1.5 < time.monotonic() - t0 < 5


def test_a_plain_answer_still_reads(serve):
    s = serve(_ok)
    status, body, headers = open_bounded(s.url + "/health", 5)
    assert status == 200 and body == b'{"ok": true}' and headers["Content-Length"] == "12"


def test_a_redirected_stream_is_named_not_parsed_and_not_followed(serve, monkeypatch):
    """``POST /v1/completions`` answered 307 (issue 36's census: the stream's failure did not say why):
    the load generator's client ends the request naming the redirect and its Location as
    ``config-rejected`` (the address given is not the server's); nothing reaches the other port."""
    from bakeoff.api.errors import EngineFailure
    from bakeoff.loadgen.client import OpenAIClient

    elsewhere = serve(_ok)
    origin = serve(_redirect_to(elsewhere, 307))
    monkeypatch.setenv("BAKEOFF_TEST_KEY", "sk-secret")
    client = OpenAIClient(origin.url, "m", api_key_env="BAKEOFF_TEST_KEY", read_timeout_s=5)

    with pytest.raises(EngineFailure) as info:
        _stream_one(client)
    assert info.value.failure_class == "config-rejected", info.value
    assert f"HTTP 307: redirect to {elsewhere.url}/v1/completions not followed" in info.value.message, info.value.message
    assert origin.seen[0]["Authorization"] == "Bearer sk-secret" and elsewhere.seen == []


def test_an_answer_that_is_not_well_formed_http_is_an_oserror(serve):
    """Census 5.18: 150 headers made http.client raise HTTPException (not an OSError), and the
    tokenizer check ended ``error`` with no class."""
    import urllib.error

    def many_headers(h):
        h.send_response(200)
        for i in range(150):
            h.send_header(f"X-H{i}", "v")
        h.send_header("Content-Length", "2")
        h.end_headers()
        h.wfile.write(b"{}")

    s = serve(many_headers)
    with pytest.raises(urllib.error.URLError) as info:
        open_bounded(s.url + "/tokenize", 5)
    assert isinstance(info.value, OSError) and "not well-formed HTTP: HTTPException" in str(info.value)


def test_a_body_cut_short_is_an_oserror_naming_the_cut_not_a_traceback(serve):
    """``Content-Length: 100000`` and 10 bytes, then the connection closed (issue 36's census: the
    tokenizer check ended ``error`` with ``IncompleteRead``, a cut ``/metrics`` failed the load):
    a :class:`BodyCut`, which every side request's ``except OSError`` handles."""
    from bakeoff.loadgen.side_http import BodyCut

    def cut(h):
        h.send_response(200)
        h.send_header("Content-Length", "100000")
        h.end_headers()
        h.wfile.write(b'{"tokens": ')
        h.close_connection = True

    s = serve(cut)
    with pytest.raises(BodyCut) as info:
        open_bounded(s.url + "/tokenize", 5)
    assert isinstance(info.value, OSError) and "the body was cut after 11 bytes" in str(info.value)


def test_the_probe_names_a_redirect_at_once_and_a_failing_server_in_bounded_time(serve, monkeypatch, tmp_path):
    """Issue 36's census: 302/307 and HTTP 500 on every route were probed until the 420 s start deadline.
    A redirect on both probe routes ends the probe at once (``config-rejected``, naming it); 5xx but 503
    (a loading server says 503) on both for PROBE_5XX_S ends it as ``load-failure``."""
    import time

    from backends.openai import backend as openai_backend
    from bakeoff.api.errors import EngineFailure
    from bakeoff.api.specs import BackendConfig

    def make(url):
        return openai_backend.OpenAIBackend(BackendConfig(backend="openai", model="m", workdir=str(tmp_path),
                                                          options={"base_url": url}, start_timeout_s=120))

    elsewhere = serve(_ok)
    origin = serve(_redirect_to(elsewhere, 302))
    t0 = time.monotonic()
    with pytest.raises(EngineFailure) as info:
        make(origin.url).probe()
    assert info.value.failure_class == "config-rejected" and time.monotonic() - t0 < 10
    assert f"redirect to {elsewhere.url}/health not followed" in info.value.message and elsewhere.seen == []

    def failing(code):
        def answer(h):
            body = b'{"error": "boom"}'
            h.send_response(code)
            h.send_header("Content-Length", str(len(body)))
            h.end_headers()
            h.wfile.write(body)
        return answer

    monkeypatch.setattr(openai_backend, "PROBE_5XX_S", 1.0)
    t0 = time.monotonic()
    with pytest.raises(EngineFailure) as info:
        make(serve(failing(500)).url).probe()
    assert info.value.failure_class == "load-failure" and "it is up and failing" in info.value.message
    assert time.monotonic() - t0 < 10
    loading = make(serve(failing(503)).url)
    loading.config = loading.config.model_copy(update={"start_timeout_s": 3.0})
    with pytest.raises(EngineFailure) as info:  # 503 waits for the start deadline: a server still loading
        loading.probe()
    assert "does not answer" in info.value.message and "up and failing" not in info.value.message


def test_a_server_that_ignores_stream_true_is_named_not_a_transport_fault(serve):
    """One JSON body where an event stream was asked for (census: ``transport-distortion``, "stream ended
    without [DONE]", blaming a hop): ``protocol-violation`` naming the content type and the first bytes."""

    from bakeoff.api.errors import EngineFailure
    from bakeoff.loadgen.client import OpenAIClient

    def whole(h):
        body = json.dumps({"choices": [{"text": " Paris", "finish_reason": "stop"}],
                           "usage": {"completion_tokens": 1}}).encode()
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    client = OpenAIClient(serve(whole).url, "m", read_timeout_s=5)

    with pytest.raises(EngineFailure) as info:
        _stream_one(client)
    assert info.value.failure_class == "protocol-violation", info.value
    assert "answered one JSON body (Content-Type application/json), not an event stream" in info.value.message
    assert "Paris" in info.value.message


def _stream_one(client) -> list:
    """One streamed completion through the load generator's client (its events; the client closed)."""
    import asyncio

    from bakeoff.api.specs import GenerationRequest

    async def one():
        try:
            return [e async for e in client.stream(GenerationRequest(request_id="r", prompt="hi", max_tokens=4))]
        finally:
            await client.aclose()

    return asyncio.run(one())
