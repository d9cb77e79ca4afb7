"""The ``og.Engine`` scheduler of the ORT GenAI engine process (split from :mod:`backends.ort_genai.engine`).

onnxruntime-genai 0.18.0: ``create_request(options=RequestOptions)``, ``begin_turn`` with
``og.TurnOptions``, ``run(event_buffer)`` returning ``EngineEvent``s, all on the thread that
made the Engine ("Engine operations must be called from the Engine owner thread").

How the Engine batches is the export's: with ``engine.dynamic_batching`` in
``genai_config.json`` (a ``PagedAttention`` export) it picks its paged cache manager and
dynamic scheduler and batches continuously, requests joining and leaving at every step; without
it, static batches: a batch runs until all its requests end and a request arriving meanwhile
waits (``src/engine/cache_manager.cpp`` ``CacheManager::Create``, ``src/engine/scheduler.cpp``,
``docs/paged_attention_engine.md`` "How the dynamic path is selected", onnxruntime-genai main).
The static scheduler takes at most 4 requests per batch: 0.18.0 reports
``engine.static_batching.max_batch_size`` from the config in ``configured_max_batch_size``,
yet ran 4.00 tokens per step with 8 requests under an overlay of 8 or 32 (seen on this
project's CPU host; main's ``StaticBatchScheduler::Schedule`` has ``constexpr size_t
static_batch_size = 4``).

Each request's session is capped at its prompt plus ``max_tokens``
(``RequestOptions.set_max_session_tokens``): the static path allocates a batch's KV cache for
its requests' longest ``max_length``, the whole context by default, which on a 131,072-token
context took 6-47 ms per admission of a tiny model here and 0.1-2 ms capped (uncapped, the
H200's Qwen3-1.7B shape, context 40,960, paid ~0.5 s per request: issue 28).
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from typing import Any

from backends._hosting.engine_frames import StepFramer, emit
from backends.ort_genai.frames import TOKENIZE, Decoder, Out, answer_tokenize, finish_name


class EngineScheduler:
    """``og.Engine`` serving the requests of an :class:`backends.ort_genai.engine.OrtGenaiEngine`.

    Args:
        owner: the engine process's state (model, tokenizer, inbox, counters, notes).
        paged: the export is a ``PagedAttention`` one (``genai_config.json``
            ``engine.dynamic_batching``): continuous batching.
        dynamic_batching: that section, for the notes.
    """

    def __init__(self, owner: Any, paged: bool, dynamic_batching: dict | None):
        og = owner.og
        self.owner, self.og, self.np = owner, og, owner.np
        self.engine = og.Engine(owner.model)
        self.caps = self.engine.get_capabilities().configured_max_batch_size
        self.buf = self.engine.create_event_buffer(256)
        self.flags = (int(og.EngineEventFlags.TOKEN.value), int(og.EngineEventFlags.FAILED.value), og.FinishReason.NONE)
        self.seeds = True
        self._t_out: float | None = None
        self.hand = emit  # a step's output to its frames: here, or StepFramer.put (loop)
        self.paged = paged
        self.lone_generator = not paged and owner.options.get("lone_request", "generator") == "generator"
        if paged:
            owner.notes["og_engine"] = (
                f"continuous batching: genai_config.json engine.dynamic_batching {json.dumps(dynamic_batching)} makes "
                f"og.Engine use its paged KV cache and dynamic scheduler (configured_max_batch_size {self.caps})")
        else:
            owner.notes["og_engine"] = (
                "static batching: no engine.dynamic_batching in genai_config.json (export without PagedAttention); "
                "og.Engine runs batches of up to 4 requests to their end, a request arriving meanwhile waits"
                + ("; a request that finds the engine idle and none waiting runs on og.Generator (lone_request="
                   "generator: one sequence decodes faster there, and later arrivals wait for it as for a static "
                   "batch)" if self.lone_generator else ""))

    # -- one request -----------------------------------------------------------------------
    def begin(self, rid: Any, body: dict[str, Any], out, live: dict) -> None:
        og, np, owner = self.og, self.np, self.owner
        ids = owner.encode(body.get("prompt", ""))
        out.start(len(ids))
        max_new = int(body.get("max_tokens") or 16)
        ropts = og.RequestOptions()
        ropts.set_max_session_tokens(len(ids) + max_new)  # no whole-context KV allocation on the static path
        req = self.engine.create_request(options=ropts)
        to = og.TurnOptions(req)
        temperature = float(body.get("temperature") or 0.0)
        to.set_do_sample(temperature > 0)
        if temperature > 0:
            to.set_temperature(temperature)
            to.set_top_p(float(body.get("top_p") or 1.0))
            to.set_top_k(0)
            if body.get("seed") is not None and self.seeds:
                to.set_seed(int(body["seed"]))
        to.set_max_generated_tokens(max_new)
        if body.get("ignore_eos"):
            to.set_min_generated_tokens(max_new)
        try:
            turn = req.begin_turn(np.asarray(ids, dtype=np.int32), to)
        except RuntimeError as exc:
            if "seed" not in str(exc) or not self.seeds:
                raise
            # 0.18.0: "A per-turn seed requires an Engine configured for dynamic batching"
            # (paged attention, CUDA only): sample unseeded and say so.
            self.seeds = False
            owner.engine_seeds = False
            owner.notes["engine_seed"] = f"per-request seeds ignored: {exc}"
            to.clear_seed()
            turn = req.begin_turn(np.asarray(ids, dtype=np.int32), to)
        if isinstance(out, Out) and not owner.tokenizer_json:
            out.decoder = Decoder(owner)
        live[id(req)] = (req, out, rid, turn)

    # -- the loop ----------------------------------------------------------------------------
    def loop(self, send, batch=contextlib.nullcontext) -> None:
        """Serve the inbox forever; each step's frames for all its streams are sent inside one
        ``batch()`` (:meth:`backends._hosting.worker_pipe.ChildPipe.batch`: one frame, one write, one
        doorbell). With continuous batching (a paged export, CUDA) a :class:`StepFramer` thread makes
        them while ``Engine.run`` computes the next step; a static export's steps (CPU, where the
        engine's threads want the cores) frame on this thread."""
        owner = self.owner
        framer = StepFramer(batch) if self.paged else None
        if framer is not None:
            self.hand = framer.put
        live: dict[int, tuple] = {}
        inbox, cancelled, step = owner.inbox, owner.cancelled, self.step
        while True:
            if not live:  # idle: block (no GIL held) until a request comes
                self._t_out = None
                item = inbox.get()
                if self.lone_generator and inbox.empty() and TOKENIZE not in item[1] and not item[1].get("logprobs"):
                    self.run_lone(item, send)
                    continue
                self.admit(item, live, send)
            while not inbox.empty():  # polled without raising queue.Empty every step
                self.admit(inbox.get(), live, send)
            owner.max_running = max(owner.max_running, len(live))
            if cancelled:
                ends = []
                for key, (req, out, rid, turn) in list(live.items()):
                    if rid in cancelled:
                        try:
                            req.cancel_turn(turn)  # 0.18.0: takes the id begin_turn returned
                        except Exception as exc:
                            print(f"og.Request.cancel_turn failed: {exc!r}", file=sys.stderr, flush=True)
                        req.close()
                        del live[key]
                        ends.append((out, "abort", None))
                cancelled.clear()
                if ends:
                    self.hand(time.perf_counter(), [], ends, owner.stats())
            if not live:
                continue
            try:
                if framer is None:
                    with batch():
                        step(live)
                else:
                    step(live)
            except Exception as exc:
                failed = RuntimeError(f"og.Engine.run failed: {exc}")
                self.hand(time.perf_counter(), [], [(e[1], None, failed) for e in live.values()], None)
                live.clear()

    def run_lone(self, item: tuple, send) -> None:
        """A request that found the engine idle and none waiting, on ``og.Generator`` (a static
        export only): the static scheduler would run it as a batch of one that later arrivals wait
        for all the same, and og.Generator decodes one sequence faster (0.086 against og.Engine's
        0.097-0.107 ms per token of the fixture here, 1 thread)."""
        rid, body = item
        out = Out(send, rid, self.owner.stream_interval_s)
        try:
            self.owner.run_generator(rid, body, out)
        except Exception as exc:  # noqa: BLE001 - its client learns why
            out.fail(exc)
        self.owner.cancelled.discard(rid)

    def admit(self, item: tuple, live: dict, send) -> None:
        rid, body = item
        owner = self.owner
        if TOKENIZE in body:
            answer_tokenize(owner, send, rid, body[TOKENIZE])
            return
        if body.get("logprobs"):  # og.Engine gives no logits: og.Generator (batched with its like) or the graph
            owner.run_with_logprobs(item, send)
            return
        out = Out(send, rid, owner.stream_interval_s)
        try:
            self.begin(rid, body, out, live)
        except Exception as exc:
            out.fail(exc)

    def step(self, live: dict) -> None:
        owner = self.owner
        token_flag, failed_flag, none = self.flags
        t_in = time.perf_counter()
        if self._t_out is not None:  # the loop's own work since the last Engine.run
            owner.own_s += t_in - self._t_out
        events = self.engine.run(self.buf)
        self._t_out = t_out = time.perf_counter()
        owner.og_s += t_out - t_in
        owner.decode_steps += 1
        tokens: list = []
        ends: list = []
        for ev in events or ():  # read into plain pairs: the next run() reuses the event buffer
            key = id(ev.request)
            entry = live.get(key)
            if entry is None:
                continue
            flags = int(ev.flags.value)
            if flags & token_flag:
                tokens.append((entry[1], int(ev.token)))
            if flags & failed_flag:
                ends.append((entry[1], None, RuntimeError(f"og.Engine request failed: error_code={ev.error_code}")))
                del live[key]
            elif ev.finish_reason != none:
                ends.append((entry[1], finish_name(self.og, ev.finish_reason), None))
                del live[key]
                entry[0].close()
        if tokens or ends:
            self.hand(t_out, tokens, ends, owner.stats() if ends else None)
