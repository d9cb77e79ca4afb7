"""The transformers worker: ``generate`` in an engine process of its own, the HTTP loop in the worker.

The real model (the shipped ``tiny-qwen3`` fixture) on CPU: bakeoff's thread default reaches torch
in the thread that generates, a dropped stream stops its generation, ``/v1/score`` is answered by
the engine process, and with continuous batching requests that ask for logprobs run as static batches
with the manager paused: the reference's tokens and logprobs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
import urllib.request
from pathlib import Path

import pytest

from backends import resolve
from backends._hosting.threads import default_threads
from bakeoff.api.specs import BackendConfig, GenerationRequest
from bakeoff.loadgen.sweep import run_request
from bakeoff.models.resolve import resolve as resolve_model



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


def test_the_reference_is_static_batches_in_float32_on_cpu_whatever_the_backends_default(tmp_path, monkeypatch):
    """The transformers backend batches by default (on CPU static or continuous by the model's decode step,
    continuous on GPU) in the checkpoint's
    dtype where the CPU computes it natively; the suite's reference runs static batches in float32 on a
    CPU, so a default transformers run is a candidate judged against it, and ``batching=static,
    dtype=float32`` is the reference itself; on CUDA (or with ``device=cuda``) the reference keeps the
    checkpoint's dtype."""
    from bakeoff.host import envs as host_envs

    monkeypatch.setattr(host_envs, "has_cuda", lambda: False)
    from types import SimpleNamespace

    from evaluations.reference import is_reference_run, reference_config

    assert resolve("transformers").Options().batching is None  # chosen at start (test_cpu_batching_default...)
    model = SimpleNamespace(path=str(tmp_path))

    def settings(options: dict, reference_options: dict):
        return SimpleNamespace(backend="transformers", model=model, reference_model=model, options=options,
                               reference_options=reference_options, start_timeout_s=60.0, progress_timeout_s=60.0,
                               request_deadline_factor=5.0)

    from backends._hosting.threads import usable_cpus

    # on every usable CPU: the reference computes alone and is not measured
    assert reference_config(settings({}, {}), tmp_path / "r").options == {"batching": "static", "max_batch_size": 32,
                                                                          "dtype": "float32", "num_threads": usable_cpus()}
    assert reference_config(settings({}, {"batching": "continuous"}), tmp_path / "r").options["batching"] == "continuous"
    assert reference_config(settings({}, {"device": "cuda"}), tmp_path / "r").options == {"batching": "static",
                                                                                         "max_batch_size": 32,
                                                                                         "device": "cuda"}
    assert not is_reference_run(settings({}, {}))
    assert is_reference_run(settings({"batching": "static", "dtype": "float32"}, {}))  # threads: rounding only
    assert is_reference_run(settings({"batching": "static", "dtype": "float32", "num_threads": 1}, {}))
    assert is_reference_run(settings({"batching": "static", "dtype": "float32", "max_batch_size": 8}, {}))  # padding: rounding only
    assert is_reference_run(settings({"batching": "continuous", "dtype": "float32"}, {"batching": "continuous"}))
    assert not is_reference_run(settings({"batching": "static"}, {}))  # the checkpoint's dtype: a candidate
    monkeypatch.setattr(host_envs, "has_cuda", lambda: True)
    assert reference_config(settings({}, {}), tmp_path / "r").options == {"batching": "static", "max_batch_size": 32}


@pytest.mark.slow
@pytest.mark.engine("transformers")
def test_generate_runs_in_its_own_process_with_the_thread_default(model, tmp_path):
    import http.client
    import urllib.parse

    b = _start(model, tmp_path, batching="none")
    try:
        info = b.ready_payload["info"]
        assert info["engine_process"] != b.ready_payload["pid"]
        n = default_threads()[0]
        assert info["num_threads"] == n and b.info.notes["num_threads"].startswith(f"{n} (bakeoff's CPU default")
        if not os.environ.get("BAKEOFF_HUGE_PAGES"):  # torch eager measured no gain: not asked by default
            assert b.info.notes["huge_pages"].startswith("not asked"), b.info.notes
        rec = _probe(b, "count: 12 13 14 15 =>", 8, logprobs=3)
        assert rec.status == "ok" and rec.output_tokens == len(rec.output_logprobs) >= 1

        req = urllib.request.Request(b.base_url.rstrip("/") + "/v1/score", json.dumps(
            {"prompt": "count: 12 13 14 15 =>", "continuation_ids": rec.output_token_ids, "top_k": 2}).encode(),
            {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            scored = json.loads(r.read())
        assert scored["token_ids"] == rec.output_token_ids and len(scored["logprobs"]) == rec.output_tokens
        # the judge's scores leave a trailing EOS unscored, so an output streamed with its EOS id
        # and the same output without it score alike (issue 38)
        eos = json.loads((Path(model) / "config.json").read_text())["eos_token_id"]
        eos = eos[0] if isinstance(eos, list) else eos
        both, base = [], list(rec.output_token_ids)
        while base and base[-1] == eos:
            base.pop()
        for ids in (base, base + [eos]):
            req = urllib.request.Request(b.base_url.rstrip("/") + "/v1/score", json.dumps(
                {"prompt": "count: 12 13 14 15 =>", "continuation_ids": ids, "drop_trailing_eos": True}).encode(),
                {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=60) as r:
                both.append(json.loads(r.read()))
        assert both[0]["logprobs"] == both[1]["logprobs"] and [x["eos_dropped"] for x in both] == [0, 1]

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


@pytest.mark.slow
@pytest.mark.engine("transformers")
def test_continuous_batching_serves_logprob_requests_in_static_batches_as_alone(model, tmp_path):
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

        async def probes():  # probes come many at once: a static batch with the manager paused
            recs = await asyncio.gather(*[run_request(b, GenerationRequest(
                request_id=f"p{i}", prompt="count: 21 22 23 24 =>", max_tokens=12, temperature=0.0, logprobs=3))
                for i in range(4)])
            await b.aclose()
            return recs

        for r in asyncio.run(probes()):
            assert r.output_token_ids == want.output_token_ids and r.output_logprobs == want.output_logprobs
        m = b.metrics()
        assert m["bakeoff_worker:requests_in_static_batches"] == 5 and m["bakeoff_worker:static_batches"] < 5
        alone = _probe(b, "count: 21 22 23 24 =>", 12, ignore_eos=True)  # found the engine idle: generate
        assert alone.status == "ok" and alone.output_tokens == 12

        async def together():  # three at once: the manager's batch
            recs = await asyncio.gather(*[run_request(b, GenerationRequest(
                request_id=f"t{i}", prompt=f"count: {30 + i} {31 + i} =>", max_tokens=12, temperature=0.0,
                ignore_eos=True)) for i in range(3)])
            await b.aclose()
            return recs

        assert all(r.status == "ok" and r.output_tokens == 12 for r in asyncio.run(together()))
        m = b.metrics()
        assert m["bakeoff_worker:requests_outside_the_batch"] == 5 and m["bakeoff_worker:lone_requests"] == 1
        assert m["bakeoff_worker:requests_in_the_batch"] >= 2
        assert "idle" in b.info.notes["scheduling"]
    finally:
        b.stop()


class _Chan:
    """The engine side of the pipe, in memory: commands handed out by ``poll``, frames kept."""

    def __init__(self, later: list | None = None):
        self.frames: list = []
        self.later = list(later or [])  # (poll call number, command)
        self.polls = 0
        self.cmd_fd = -1
        self.writes = self.open_batches = 0

    def send(self, msg, urgent: bool = True) -> None:
        self.frames.append(msg)
        self.writes += self.open_batches == 0  # a frame outside a batch is a pipe write of its own

    @contextlib.contextmanager
    def batch(self):
        """ChildPipe.batch: what is sent inside leaves as one write at the end."""
        self.open_batches += 1
        n = len(self.frames)
        try:
            yield
        finally:
            self.open_batches -= 1
            self.writes += self.open_batches == 0 and len(self.frames) > n

    def poll(self) -> list:
        self.polls += 1
        due = [c for n, c in self.later if n <= self.polls]
        self.later = [(n, c) for n, c in self.later if n > self.polls]
        return due

    def ids(self, rid) -> list[int]:
        import array

        return [t for f in self.frames if f[0] == "tok" and f[1] == rid for t in array.array("i", f[2]).tolist()]

    def finish(self, rid):
        return next(f[2] for f in self.frames if f[0] == "end" and f[1] == rid)


@pytest.mark.slow
def test_static_batches_stream_each_row_as_alone_and_take_in_a_late_wave(model):
    """batching=static (optimum-ort's default, backends/transformers/static.py) on the real model:
    each row of a left-padded batch streams the tokens it would alone, stops at its own end, and a
    request arriving while the batch is young restarts it with the newcomer, nobody's tokens lost."""
    import collections

    from backends.transformers.engine import TransformersEngine
    from backends.transformers.static import serve_static

    eng = TransformersEngine(model, {"batching": "static", "device": "cpu", "num_threads": 1, "dtype": "float32"})
    prompts = {1: "count: 12 13 14 15 =>", 2: "count: 40 =>", 3: "count: 7 8 9 10 11 12 =>", 4: "count: 30 31 =>"}
    alone = {}
    for rid, p in prompts.items():
        chan = _Chan()
        eng.generate(rid, {"prompt": p, "max_tokens": 12, "ignore_eos": True}, chan, collections.deque())
        alone[rid] = chan.ids(rid)
    gen = lambda rid, n=12: ("gen", rid, {"prompt": prompts[rid], "max_tokens": n, "ignore_eos": True})  # noqa: E731

    chan = _Chan()
    serve_static(eng, gen(1), chan, collections.deque([gen(2), gen(3, 5)]))
    assert eng.batches == 1 and eng.batched_requests == 3 and eng.restarts == 0
    assert chan.ids(1) == alone[1] and chan.ids(2) == alone[2] and chan.ids(3) == alone[3][:5]
    assert [chan.finish(r) for r in (1, 2, 3)] == ["length"] * 3
    # a step's frames for all its rows leave as one pipe write (ChildPipe.batch): 3 start frames, then
    # one write per step (12 steps), never one per row (the 8 rows' 8 writes and doorbells per step)
    assert chan.writes == 3 + 12

    chan = _Chan(later=[(2, gen(4))])  # request 4 comes while 1 has its first tokens
    serve_static(eng, gen(1), chan, collections.deque())
    assert eng.restarts == 1
    assert chan.ids(1) == alone[1] and chan.ids(4) == alone[4]
    starts = [f[1] for f in chan.frames if f[0] == "start"]
    assert starts == [1, 4]  # one start per request: the restart is invisible to the client

    # cancels that come in the batch's first read, with their requests (the client left at once): the
    # first request and a waiting one are dropped unrun, the others run as alone (a breaker's find: both
    # ran to max_tokens before)
    chan = _Chan(later=[(1, ("cancel", 1)), (1, ("cancel", 4))])
    serve_static(eng, gen(1), chan, collections.deque([gen(2), gen(3, 5), gen(4)]))
    assert {f[1] for f in chan.frames} == {2, 3}
    assert chan.ids(2) == alone[2] and chan.ids(3) == alone[3][:5]


@pytest.mark.slow
@pytest.mark.engine("transformers")
def test_static_batches_serve_logprob_requests_as_generate_does(model, tmp_path):
    """Greedy requests with logprobs share a left-padded static batch (the reference's probes); each
    row's tokens and top-k logprobs are those of ``generate`` one at a time, in float32, up to
    rounding (fails before: logprob requests ran alone, and the batch counters stayed at 0)."""
    prompts = [f"count: {10 + 7 * i} {11 + 7 * i} {12 + 7 * i} =>" for i in range(5)] + ["copy: abc hcd =>"]
    ref = _start(model, tmp_path / "one", batching="none", dtype="float32")
    try:
        want = [_probe(ref, p, 10, logprobs=5) for p in prompts]
    finally:
        ref.stop()
    b = _start(model, tmp_path / "static", batching="static", dtype="float32")
    try:
        async def together():
            recs = await asyncio.gather(*[run_request(b, GenerationRequest(
                request_id=f"s{i}", prompt=p, max_tokens=10, temperature=0.0, logprobs=5)) for i, p in enumerate(prompts)])
            await b.aclose()
            return recs

        got = asyncio.run(together())
        _probe(b, prompts[0], 2)  # the engine's counters are sent with a request's end: one more brings the batch's
        m = b.metrics()
        batches, batched = m["bakeoff_worker:static_batches"], m["bakeoff_worker:requests_in_static_batches"]
        # each request counted once (restarts take newcomers in); the flushing request is counted
        # (a batch of its own) when its end came before the metrics were read
        extra = batched - len(prompts)
        fresh = batches - m["bakeoff_worker:static_batch_restarts"]  # batches not restarted from another
        assert extra in (0, 1) and fresh - extra < len(prompts), m
        for w, g in zip(want, got):
            assert g.status == "ok" and g.output_token_ids == w.output_token_ids, (g.output_text, w.output_text)
            assert len(g.output_logprobs) == len(w.output_logprobs) == len(w.output_token_ids)
            for (tok_a, lp_a, top_a), (tok_c, lp_c, top_c) in zip(g.output_logprobs, w.output_logprobs):
                assert tok_a == tok_c and lp_a == pytest.approx(lp_c, abs=1e-3)
                assert sorted(top_a, key=top_a.get)[-3:] == sorted(top_c, key=top_c.get)[-3:]
    finally:
        b.stop()


def test_cpu_batching_default_follows_the_measured_decode_step():
    """Unset ``batching`` on CPU: continuous for a model whose decode step takes at least
    CONTINUOUS_MIN_STEP_MS (SmolLM2-135M, 49 ms), static for a faster one (the 2 ms fixture); the
    run's notes name the measured step. A fake engine (named so) stands in for the step's timing."""
    from types import SimpleNamespace

    from backends.transformers.engine import CONTINUOUS_MIN_STEP_MS, TransformersEngine

    def decide(step_ms: float):
        return TransformersEngine.cpu_batching_default(SimpleNamespace(decode_step_ms=lambda: step_ms))

    mode, why = decide(49.0)
    assert mode == "continuous" and "49.0 ms" in why
    mode, why = decide(2.0)
    assert mode == "static" and "2.00 ms" in why
    assert decide(CONTINUOUS_MIN_STEP_MS)[0] == "continuous" and decide(CONTINUOUS_MIN_STEP_MS * 0.99)[0] == "static"


@pytest.mark.slow
@pytest.mark.engine("transformers")
def test_the_fixture_gets_static_batches_by_default_with_its_step_in_the_notes(model, tmp_path):
    b = _start(model, tmp_path)
    try:
        assert b.info.notes["batching"] == "static", b.info.notes
        assert b.info.notes["batching_default"].startswith("static on CPU: a decode step of one sequence took")
    finally:
        b.stop()


def test_a_cpu_default_of_continuous_batching_that_cannot_start_serves_static_batches(monkeypatch):
    """bakeoff's own choice of continuous batching falls back to its other default, static batches
    (not one request at a time), saying why; a user's ``batching=continuous`` keeps its own fallback.
    The engine object is a bare instance (named so) with a faked step measurement and manager start."""
    import backends.transformers.batching as batching_mod
    from backends.transformers.engine import TransformersEngine

    monkeypatch.setattr(batching_mod, "start_batcher", lambda engine, options: (None, "no manager here"))

    def bare(device: str = "cpu") -> TransformersEngine:
        eng = TransformersEngine.__new__(TransformersEngine)
        eng.device, eng._info = device, {}
        eng.cpu_batching_default = lambda: ("continuous", "continuous on CPU: a decode step of one sequence took 49 ms")
        return eng

    eng = bare()
    eng.setup({})
    assert eng.static and eng._info["batching"] == "static"
    assert eng._info["batching_fallback"] == "static: continuous batching did not start (no manager here)"
    eng = bare()
    eng.setup({"batching": "continuous"})
    assert not eng.static and eng._info["batching_fallback"] == "no manager here"
