"""The og.Engine loop's frames with continuous batching (a paged export: CUDA only), over a real pipe.

og.Engine on a PagedAttention export runs on CUDA only, so the loop here drives a named fake of
og 0.18.0's Engine API (``FakeOg``): each ``run`` advances every begun turn by one token and
ends a turn at its ``max_generated_tokens``, as the real one did on the H200. What is checked is
bakeoff's side: every stream's frames in order (start, its tokens, one end), a cancelled stream
ended once, and the frames made off the decode thread (:class:`backends._hosting.engine_frames.StepFramer`),
which is what took bakeoff from 0.82 to ~0.95 of the bare og.Engine loop at 32 sessions
(``benchmarks/bench_fidelity.py``, H200, docs/gpu.md).
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
from types import SimpleNamespace

import numpy as np

from backends._hosting import worker_pipe
from backends._hosting.worker_pipe import ChildPipe, FrameReader
from backends.ort_genai.og_engine import EngineScheduler


class _Reason:
    def __init__(self, name: str):
        self.name = name


class FakeOg:
    """A fake of onnxruntime-genai 0.18.0's Engine API (named so): turns of a continuous batch."""

    class EngineEventFlags:
        TOKEN, FAILED = SimpleNamespace(value=1), SimpleNamespace(value=4)

    class FinishReason:
        NONE, EOS, MAX_GENERATED_TOKENS, STOP_STRING, MAX_SESSION_TOKENS, CANCELLED = (
            _Reason(n) for n in ("NONE", "EOS", "MAX_GENERATED_TOKENS", "STOP_STRING", "MAX_SESSION_TOKENS",
                                 "CANCELLED"))

    class RequestOptions:
        def set_max_session_tokens(self, n): pass

    class TurnOptions:
        def __init__(self, req): self.req = req
        def set_do_sample(self, v): pass
        def set_max_generated_tokens(self, n): self.req.max_new = n
        def set_min_generated_tokens(self, n): pass

    class Engine:
        def __init__(self, model):
            self.turns: list = []
            self.thread = None  # the thread that calls run (the decode thread)

        def get_capabilities(self):
            return SimpleNamespace(configured_max_batch_size=64)

        def create_event_buffer(self, n): return None

        def create_request(self, options=None):
            engine = self
            req = SimpleNamespace(n=0, max_new=16, first=0)

            def begin_turn(ids, turn_options):
                req.first = int(ids[0]) * 1000
                engine.turns.append(req)
                return 1

            def cancel_turn(turn):
                engine.turns.remove(req)

            req.begin_turn, req.cancel_turn, req.close = begin_turn, cancel_turn, (lambda: None)
            return req

        def run(self, buf):
            self.thread = threading.get_ident()
            time.sleep(0.002)  # a step; the GIL released, as og's run releases it
            events = []
            for req in list(self.turns):
                req.n += 1
                done = req.n >= req.max_new
                reason = FakeOg.FinishReason.MAX_GENERATED_TOKENS if done else FakeOg.FinishReason.NONE
                events.append(SimpleNamespace(request=req, flags=SimpleNamespace(value=1), token=req.first + req.n,
                                              error_code=0, finish_reason=reason))
                if done:
                    self.turns.remove(req)
            return events


class _Owner:
    """The attributes of an OrtGenaiEngine that the scheduler reads."""

    def __init__(self):
        self.og, self.np, self.model = FakeOg, np, None
        self.options, self.notes = {}, {}
        self.inbox, self.cancelled = queue.SimpleQueue(), set()
        self.tokenizer_json, self.max_running, self.own_s, self.og_s, self.decode_steps = True, 0, 0.0, 0.0, 0
        self.stream_interval_s, self.engine_seeds = 0.002, True

    def encode(self, prompt: str) -> list[int]:
        return [int(prompt)] * 3

    def stats(self) -> dict:
        return {"decode_steps_total": self.decode_steps}


def test_paged_loop_frames_every_stream_in_order_off_the_decode_thread(monkeypatch):
    cmd_r, _cmd_w = os.pipe()
    out_r, out_w = os.pipe()
    bell_r, bell_w = os.pipe()
    worker_pipe._grow(out_w)
    pipe = ChildPipe(cmd_r, out_w, bell_w)
    writes: list[tuple[int, bytes]] = []
    real_write = ChildPipe._write
    monkeypatch.setattr(ChildPipe, "_write", lambda self, data, urgent: (writes.append((threading.get_ident(), data)),
                                                                          real_write(self, data, urgent)))
    owner = _Owner()
    sched = EngineScheduler(owner, paged=True, dynamic_batching={"block_size": 16})
    assert owner.notes["og_engine"].startswith("continuous batching")
    n = 12
    for rid in range(n):
        owner.inbox.put((rid, {"prompt": str(rid + 1), "max_tokens": 40 + rid}))
    threading.Thread(target=sched.loop, args=(pipe.send, pipe.batch), daemon=True).start()
    time.sleep(0.02)
    owner.cancelled.add(5)  # cancelled mid-stream: ended once, as "abort"

    frames: dict[int, list] = {rid: [] for rid in range(n)}
    reader, deadline = FrameReader(), time.monotonic() + 20
    os.set_blocking(out_r, False)
    while sum(1 for fs in frames.values() if fs and fs[-1][0] == "end") < n and time.monotonic() < deadline:
        try:
            data = os.read(out_r, 1 << 16)
        except BlockingIOError:
            time.sleep(0.005)
            continue
        for msg in reader.feed(data):
            frames[msg[1]].append(msg)
    for rid, fs in frames.items():
        kinds = [f[0] for f in fs]
        assert kinds[0] == "start" and kinds[-1] == "end" and set(kinds[1:-1]) <= {"tok"}, (rid, kinds)
        ids = [int(x) for f in fs if f[0] == "tok" for x in np.frombuffer(f[2], dtype=np.int32)]
        first = (rid + 1) * 1000
        if rid == 5:
            assert fs[-1][2] == "abort" and ids == list(range(first + 1, first + 1 + len(ids))) and len(ids) < 45
        else:
            assert fs[-1][2] == "length" and ids == list(range(first + 1, first + 41 + rid)), rid
    by_thread: dict[int, set] = {}
    for thread, data in writes:
        by_thread.setdefault(thread, set()).update(m[0] for m in FrameReader().feed(data))
    decode = sched.engine.thread
    assert by_thread.get(decode, set()) <= {"start"}  # admission's frame only: tokens and ends framed beside run()
    assert any({"tok", "end"} <= kinds for t, kinds in by_thread.items() if t != decode)


def test_a_step_whose_frames_fail_ends_its_streams_with_the_error():
    """A stream whose frame cannot be made on the StepFramer thread (a detokenizer that raises) ends
    with an ``err`` frame naming why, so its client sees a failed request, not a stream that stops."""
    from backends._hosting.engine_frames import Out, StepFramer

    sent: list = []
    done = threading.Event()

    def send(msg, urgent=True):
        sent.append(msg)
        if msg[0] in ("err", "end"):
            done.set()

    class Broken:
        def push(self, token):
            raise ValueError("no such token")

    out = Out(send, "r1", 0.0, decoder=Broken())
    StepFramer(contextlib.nullcontext).put(time.perf_counter(), [(out, 7)], [], None)
    assert done.wait(5)
    assert sent[-1][0] == "err" and "no such token" in sent[-1][2]
