"""A FAKE of llama-cpp-python's OpenAI server (``python -m llama_cpp.server``), in the ways that
mis-judged it (issue 37), for ``tests/test_greedy_chat_probes.py``.

- ``GET /v1/models`` lists the model ``owned_by`` ``me``, as llama-cpp-python does.
- ``/v1/chat/completions`` renders the messages with a ChatML template itself; ``/v1/completions``
  takes the prompt as given.
- Its "model" answers ``Paris`` to a prompt holding the template once, and ``Lyon`` where text
  already rendered with the template was sent as a message (the template twice).
- A request without ``repeat_penalty: 1.0`` gets llama-cpp-python's default penalty of 1.1: the
  chosen token is no longer its own top logprob (``Lyon`` chosen at -2.5 nats, ``Paris`` -0.1).
- Logprobs are keyed by token text, never ids (both OpenAI shapes).
- ``interrupt=True`` (llama-cpp-python's default ``interrupt_requests``): a stream that another request
  overlaps ends with ``[DONE]`` after its token, without a finish_reason.

Every request body is kept in ``FakeLlamaCppPython.bodies``.
"""

from __future__ import annotations

import http.server
import json
import threading
import time

TEMPLATE_OPEN = "<|im_start|>"


def render(messages: list[dict]) -> str:
    return "".join(f"{TEMPLATE_OPEN}{m['role']}\n{m['content']}<|im_end|>\n" for m in messages) + f"{TEMPLATE_OPEN}assistant\n"


def answer(twice: bool, body: dict) -> tuple[str, float, dict[str, float]]:
    """``(chosen text, its logprob, top logprobs)`` of the one token the FAKE model generates;
    ``twice``: its prompt holds the chat template twice (a message that was already rendered)."""
    if twice:
        return " Lyon", -0.2, {" Lyon": -0.2, " Paris": -1.9}
    if body.get("repeat_penalty") != 1.0:  # llama-cpp-python's default repeat_penalty=1.1 applied
        return " Lyon", -2.5, {" Paris": -0.1, " Lyon": -2.5}
    return " Paris", -0.1, {" Paris": -0.1, " Lyon": -2.5}


class FakeLlamaCppPython:
    """The FAKE server on 127.0.0.1, in a thread; ``with FakeLlamaCppPython() as srv: srv.url``."""

    def __init__(self, interrupt: bool = False):
        self.bodies: list[dict] = []
        self.in_flight = 0
        self.lock = threading.Lock()
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def _json(self, obj: dict) -> None:
                data = json.dumps(obj).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._json({"object": "list", "data": [{"id": "m", "object": "model", "owned_by": "me"}]}
                           if self.path == "/v1/models" else {"status": "ok"})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.bodies.append(body)
                with fake.lock:
                    fake.in_flight += 1
                time.sleep(0.05)  # long enough for concurrent requests to overlap
                with fake.lock:
                    overlapped = fake.in_flight > 1
                cut = interrupt and overlapped
                chat = self.path == "/v1/chat/completions"
                twice = chat and any(TEMPLATE_OPEN in m["content"] for m in body["messages"])
                text, lp, top = answer(twice, body)
                if chat:
                    choice = {"index": 0, "delta": {"content": text}, "finish_reason": None,
                              "logprobs": {"content": [{"token": text, "logprob": lp, "top_logprobs": [
                                  {"token": t, "logprob": v} for t, v in top.items()]}]}}
                else:
                    choice = {"index": 0, "text": text, "finish_reason": None,
                              "logprobs": {"tokens": [text], "token_logprobs": [lp], "top_logprobs": [top]}}
                events = [{"id": "x", "object": "chunk", "choices": [choice]}] + ([] if cut else [
                    {"id": "x", "object": "chunk", "choices": [{"index": 0, "finish_reason": "stop",
                                                                **({"delta": {}} if chat else {"text": ""})}]}])
                data = b"".join(b"data: " + json.dumps(e).encode() + b"\r\n\r\n" for e in events) + b"data: [DONE]\r\n\r\n"
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                with fake.lock:
                    fake.in_flight -= 1

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def __enter__(self) -> "FakeLlamaCppPython":
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
