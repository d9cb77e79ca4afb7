"""The transformers worker: ``generate`` in an engine process of its own, the HTTP loop in the worker.

The real model (the shipped ``tiny-qwen3`` fixture) on CPU: bakeoff's thread default reaches torch
in the thread that generates, a dropped stream stops its generation, ``/v1/score`` is answered by
the engine process, and with continuous batching a request that asks for logprobs runs through
``generate`` with the manager paused: the reference's tokens and logprobs.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request

import pytest

from backends import resolve
from backends._hosting.threads import default_threads
from bakeoff.api.specs import BackendConfig, GenerationRequest
from bakeoff.loadgen.sweep import run_request
from bakeoff.models.resolve import resolve as resolve_model

pytestmark = [pytest.mark.slow, pytest.mark.engine("transformers")]


@pytest.fixture(scope="module")
def model() -> str:
    return str(resolve_model("fixture:tiny-qwen3").path)


def _start(model: str, tmp_path, **options):
    b = resolve("transformers")(BackendConfig(backend="transformers", model=model, workdir=str(tmp_path),
                                              options=options))
    b.start()
    return b


def _probe(b, prompt: str, max_tokens: int, logprobs: int | None = None, ignore_eos: bool = False):
    async def go():
        rec = await run_request(b, GenerationRequest(request_id="p", prompt=prompt, max_tokens=max_tokens,
                                                     temperature=0.0, logprobs=logprobs, ignore_eos=ignore_eos))
        await b.aclose()
        return rec
    return asyncio.run(go())


def test_generate_runs_in_its_own_process_with_the_thread_default(model, tmp_path):
    import http.client
    import urllib.parse

    b = _start(model, tmp_path, batching="none")
    try:
        info = b.ready_payload["info"]
        assert info["engine_process"] != b.ready_payload["pid"]
        n = default_threads()[0]
        assert info["num_threads"] == n and b.info.notes["num_threads"].startswith(f"{n} (bakeoff's CPU default")
        rec = _probe(b, "count: 12 13 14 15 =>", 8, logprobs=3)
        assert rec.status == "ok" and rec.output_tokens == len(rec.output_logprobs) >= 1

        req = urllib.request.Request(b.base_url.rstrip("/") + "/v1/score", json.dumps(
            {"prompt": "count: 12 13 14 15 =>", "continuation_ids": rec.output_token_ids, "top_k": 2}).encode(),
            {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            scored = json.loads(r.read())
        assert scored["token_ids"] == rec.output_token_ids and len(scored["logprobs"]) == rec.output_tokens

        # a stream of 20,000 tokens dropped after its first event stops generating
        url = urllib.parse.urlparse(b.base_url)
        conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
        conn.request("POST", "/v1/completions", json.dumps({"model": b.config.model, "prompt": "count: 1 2 =>",
                                                            "max_tokens": 20000, "ignore_eos": True, "stream": True}),
                     {"Content-Type": "application/json"})
        assert conn.getresponse().readline().startswith(b"data: ")
        conn.close()
        time.sleep(1.0)
        t0 = time.monotonic()
        assert _probe(b, "count: 3 4 =>", 4).status == "ok"  # served at once: the dropped one stopped
        assert time.monotonic() - t0 < 10
        generated = b.metrics()["bakeoff_worker:generated_tokens_engine"]
        assert generated < 20000, f"the dropped stream ran on: {generated} tokens generated"
    finally:
        b.stop()


def test_continuous_batching_serves_logprob_requests_through_generate(model, tmp_path):
    ref = _start(model, tmp_path / "ref", batching="none")
    try:
        want = _probe(ref, "count: 21 22 23 24 =>", 12, logprobs=3)
    finally:
        ref.stop()
    b = _start(model, tmp_path / "cb", batching="continuous")
    try:
        assert b.info.notes["batching"] == "continuous" and not b.info.fallbacks, b.info.fallbacks
        got = _probe(b, "count: 21 22 23 24 =>", 12, logprobs=3)
        assert got.output_token_ids == want.output_token_ids and got.output_logprobs == want.output_logprobs
        plain = _probe(b, "count: 21 22 23 24 =>", 12, ignore_eos=True)  # the manager's own path
        assert plain.status == "ok" and plain.output_tokens == 12
        assert b.metrics()["bakeoff_worker:requests_outside_the_batch"] == 1
    finally:
        b.stop()
