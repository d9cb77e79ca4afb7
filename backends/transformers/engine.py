"""The transformers engine process: the model and its ``generate`` loop, on their own interpreter.

Started by :mod:`backends.transformers.worker` (the HTTP side,
:class:`backends._hosting.engine_proxy.PipeEngineProxy`) as ``python -m backends.transformers.engine
--model M --options JSON --cmd-fd N --out-fd M --bell-fd B`` (optimum-ort's engine process,
:mod:`backends.optimum_ort.engine`, runs the same loop around ``ORTModelForCausalLM``); the two
talk in :mod:`backends._hosting.engine_frames` frames. Why its own process: ``generate`` is a
Python loop (a tiny model spends most of each step in transformers' Python), and the HTTP loop
beside it in one interpreter took the GIL at every token: on this project's 2-core host the
worker's generate ran at 0.55-0.7 of a bare ``generate``'s tokens/s, its process using 1.5-1.7x
the bare loop's CPU per token (issue 28's fidelity runs, 2026-12-03).

Three modes (``batching``):

- ``none`` (the reference): one ``generate`` at a time on the main thread, in arrival order,
  tokens through a streamer that also reads commands between tokens (a cancel stops the running
  generation through a stopping criterion; other commands wait their turn).
- ``static`` (the default on CPU for a model whose decode step is shorter than
  :data:`CONTINUOUS_MIN_STEP_MS`, and optimum-ort's): the same loop, the greedy requests waiting
  when one begins sharing its ``generate`` as one left-padded batch (:mod:`backends.transformers.static`).
- ``continuous`` (the default on an accelerator, and on CPU for a slower model): transformers'
  ``ContinuousBatchingManager`` (:mod:`backends.transformers.batching`); greedy requests with
  logprobs (the probes) run in static batches with the manager paused;
  its own thread steps the model, and this process's main thread runs an asyncio loop that reads
  commands and gets each request's tokens through ``register_result_handler``.

Text is made in the worker process from the ids (the same cumulative ``tokenizer.decode`` the
reference always used: :class:`backends.transformers.worker.CumulativeText`); a request with
``logprobs`` gets its top-k per token here, from the scores greedy search picks from. Teacher-forced
scoring (``/v1/score``, the judge) runs here too, between generations.
"""

from __future__ import annotations

import array
import collections
import os
import threading
import time
import traceback
from typing import Any

from backends.transformers.logprobs import top_logprobs
from backends._hosting.engine_frames import Out, answer_tokenize
from backends.transformers.static import GREEDY_KWARGS, batch_key, cancelled_in, serve_static
from backends._hosting.worker_pipe import start_child

# With ``batching`` unset on CPU: a model whose decode step (one sequence) takes at least this many
# milliseconds is served by continuous batching, a faster one by static batches. Measured on the
# 2-core host, 8 sessions x 4 requests of 64 tokens (benchmarks/bench_fidelity.py, bare loops): the
# 2 ms fixture: a batched generate per wave 2,630 tok/s, the ContinuousBatchingManager 1,890 (the
# manager's own work per step dominates a tiny model's); SmolLM2-135M (49 ms): the manager 108,
# a batched generate 96.5, and bakeoff's worker 95 static against 104 continuous (2026-12-05). The
# threshold lies between the two measured models, far from both.
CONTINUOUS_MIN_STEP_MS = 10.0


class TransformersEngine:
    """The model, its tokenizer and what the worker asks of them.

    Args:
        model_path: checkpoint folder or hub id.
        options: ``device`` (auto|cpu|cuda), ``dtype`` (auto|float32|bfloat16|float16),
            ``trust_remote_code`` (bool, default False), ``num_threads`` (torch's intra-op
            threads on CPU), ``gpu_headroom_gib``, ``batching``, ``stream_interval_ms``.
    """

    def __init__(self, model_path: str, options: dict[str, Any]):
        import torch
        import transformers
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch = torch
        device = options.get("device") or "auto"
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        dtype = options.get("dtype") or "auto"
        trust = bool(options.get("trust_remote_code", False))
        self.tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust)
        self.model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=dtype if dtype == "auto" else getattr(torch, dtype), trust_remote_code=trust,
            use_safetensors=True)
        self.model.to(device).eval()
        self.device = device
        if device == "cpu" and options.get("num_threads"):
            torch.set_num_threads(int(options["num_threads"]))
        self.held: list = []  # gpu_headroom_gib: memory held to emulate a co-tenant
        headroom = options.get("gpu_headroom_gib")
        held_gib = hold_gpu_memory(torch, float(headroom), self.held) if headroom is not None and device == "cuda" else None
        self._info = {
            "engine": "transformers", "engine_version": transformers.__version__,
            "torch_version": torch.__version__, "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
            "dtype": str(next(self.model.parameters()).dtype).replace("torch.", ""),
            "max_model_len": getattr(self.model.config, "max_position_embeddings", None),
            "trust_remote_code": trust, "batching": "none", "gpu_headroom_held_gib": held_gib,
            "attn_implementation": getattr(self.model.config, "_attn_implementation", None),
            "num_threads": threads_in_new_thread(torch), "tokenizer_path": model_path,
        }
        self.setup(options)

    def setup(self, options: dict[str, Any]) -> None:
        """What follows loading: counters, the stream interval, continuous batching when asked."""
        self.n_generated = 0
        self.interval_s = float(options.get("stream_interval_ms") or 0) / 1000
        self._info["stream_interval_ms"] = self.interval_s * 1000
        self._info["engine_process"] = os.getpid()
        self.batcher = None
        batching = options.get("batching")
        if not batching:
            batching, self._info["batching_default"] = (
                self.cpu_batching_default() if self.device == "cpu"
                else ("continuous", "continuous on an accelerator (transformers' documented serving mode)"))
        self.static = batching == "static"  # backends/transformers/static.py
        self.max_batch = int(options.get("max_batch_size") or 16)
        self.batches = self.batched_requests = self.restarts = 0
        self._info["batching"] = batching
        if batching == "continuous":
            # lazy: tests patch batching.start_batcher (read at call time); batching imports this module
            from backends.transformers.batching import start_batcher

            self.batcher, reason = start_batcher(self, {**options, "batching": batching})
            if self.batcher is not None:
                self._info.update(self.batcher.info())
            elif not options.get("batching"):  # bakeoff's choice, not the user's: its other default
                self.static, self._info["batching"] = True, "static"
                self._info["batching_fallback"] = f"static: continuous batching did not start ({reason})"
            else:
                self._info["batching_fallback"] = reason

    def cpu_batching_default(self) -> tuple[str, str]:
        """``continuous`` when one decode step of this model on this host takes at least
        :data:`CONTINUOUS_MIN_STEP_MS`, else ``static``; and the sentence that says so (the run's
        notes). A model the measurement fails on gets ``static``, the reason said."""
        try:
            step_ms = self.decode_step_ms()
        except Exception as exc:  # noqa: BLE001 - a default, never a reason not to start
            return "static", f"static on CPU: the decode step could not be measured ({type(exc).__name__}: {exc})"[:300]
        if step_ms >= CONTINUOUS_MIN_STEP_MS:
            return "continuous", (f"continuous on CPU: a decode step of one sequence took {step_ms:.1f} ms here "
                                  f"(>= {CONTINUOUS_MIN_STEP_MS:g} ms; SmolLM2-135M, 49 ms: the manager served 108 "
                                  "tok/s at 8 sessions against 96.5 for a batched generate per wave)")
        return "static", (f"static on CPU: a decode step of one sequence took {step_ms:.2f} ms here "
                          f"(< {CONTINUOUS_MIN_STEP_MS:g} ms; the 2 ms fixture: a batched generate per wave 2,630 tok/s "
                          "at 8 sessions against 1,890 for transformers' ContinuousBatchingManager)")

    def decode_step_ms(self) -> float:
        """Milliseconds of one greedy decode step of one sequence: ``generate`` of 9 new tokens less
        ``generate`` of 1 (the prefill), over 8, after one untimed call; one try where it is past 5x
        the threshold (a large model: 12 forward passes in all), else also the fastest of three of
        each ``generate`` (contention only adds time: the fixture's 2 ms step once read over 10 ms
        with one try of each beside three test processes on 2 cores, and got continuous batching)."""
        torch = self.torch
        ids = self.encode("The quick brown fox jumps over")  # input ids only, as both batching modes feed
        input_ids = torch.tensor([ids], device=self.device)
        mask = torch.ones_like(input_ids)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id

        def generate_s(n: int) -> float:
            t0 = time.perf_counter()
            with torch.inference_mode():
                self.model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                    do_sample=False, temperature=None, top_p=None, top_k=None, pad_token_id=pad)
            return time.perf_counter() - t0

        def step_ms() -> float:
            return (generate_s(9) - generate_s(1)) / 8 * 1000

        generate_s(2)  # untimed: the first call's one-time costs
        first = step_ms()
        if first >= 5 * CONTINUOUS_MIN_STEP_MS:
            return first
        fastest_9, fastest_1 = min(generate_s(9) for _ in range(3)), min(generate_s(1) for _ in range(3))
        return min(first, (fastest_9 - fastest_1) / 8 * 1000)

    def info(self) -> dict[str, Any]:
        return self._info

    def stats(self) -> dict[str, float]:
        out = {"generated_tokens_engine": self.n_generated}
        if self.static or self.batched_requests:  # continuous batching runs greedy logprobs requests in static batches
            out.update(static_batches=self.batches, requests_in_static_batches=self.batched_requests,
                       static_batch_restarts=self.restarts)
        if self.batcher is not None:
            out["requests_outside_the_batch"] = self.batcher.outside
            out["lone_requests"] = self.batcher.lone
            out["requests_in_the_batch"] = self.batcher.batched
        return out

    def encode(self, prompt: str) -> list[int]:
        """The ids ``generate`` gets for ``prompt`` (both batching modes): the tokenizer with the
        special tokens it adds by default (a BOS where the checkpoint's tokenizer adds one)."""
        return self.tokenizer(prompt)["input_ids"]

    def score(self, body: dict[str, Any]) -> dict[str, Any]:
        """Teacher-forced log-probabilities of a continuation after a prompt (the judge's scorer).

        Args:
            body: ``prompt`` (text), ``continuation_ids`` (token ids) or ``continuation``
                (text, tokenized here without special tokens), ``top_k`` (default 0),
                ``drop_trailing_eos`` (default false): leave the continuation's trailing
                end-of-sequence ids unscored, so that outputs streamed with their EOS id and
                outputs without it (text, or an engine that does not stream it) are scored alike.

        Returns:
            ``{"token_ids", "logprobs": [logprob of each token], "top_logprobs": [[[id,
            logprob], ...] per token], "eos_dropped"}``, in this model's float32 log-softmax.
        """
        torch, tok = self.torch, self.tokenizer
        k = int(body.get("top_k") or 0)
        p = tok(body.get("prompt") or "")["input_ids"]
        c = body.get("continuation_ids")
        c = [int(t) for t in c] if c is not None else tok(body.get("continuation") or "", add_special_tokens=False)["input_ids"]
        n_ids = len(c)
        if body.get("drop_trailing_eos"):
            while c and c[-1] in self.eos_ids():
                c = c[:-1]
        dropped = n_ids - len(c)
        if not p or not c:
            return {"token_ids": c, "logprobs": [], "top_logprobs": [], "eos_dropped": dropped}
        x = torch.tensor([p + c], device=self.device)
        with torch.inference_mode():
            logits = self.model(input_ids=x).logits[0, len(p) - 1:len(p) + len(c) - 1].float()
        logp = torch.log_softmax(logits, dim=-1)
        chosen = logp[torch.arange(len(c), device=logp.device), torch.tensor(c, device=logp.device)].tolist()
        top: list = []
        if k:
            vals, idx = logp.topk(k, dim=-1)
            top = [list(zip(i, v)) for i, v in zip(idx.tolist(), vals.tolist())]
        return {"token_ids": c, "logprobs": chosen, "top_logprobs": top, "eos_dropped": dropped}

    def eos_ids(self) -> set[int]:
        """The model's end-of-sequence ids: its generation config's (an int or a list) and its tokenizer's."""
        ids = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        out = set(ids if isinstance(ids, (list, tuple)) else [ids] if ids is not None else [])
        if self.tokenizer.eos_token_id is not None:
            out.add(int(self.tokenizer.eos_token_id))
        return out

    # -- one generate at a time ------------------------------------------------------------------
    def generate(self, rid: Any, body: dict[str, Any], chan, waiting: collections.deque) -> None:
        """One request's ``generate``, its tokens as frames; commands that come meanwhile are
        read between tokens (a cancel of this request stops it; the rest join ``waiting``)."""
        from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList
        from transformers.generation.streamers import BaseStreamer

        torch, tok = self.torch, self.tokenizer
        out = Out(chan.send, rid, self.interval_s)
        max_new = int(body.get("max_tokens") or 16)
        temperature = float(body.get("temperature") or 0.0)
        top_k = int(body.get("logprobs") or 0) if not isinstance(body.get("logprobs"), bool) else 0
        steps: list = []  # log-softmax of each step's logits, when logprobs are asked for
        state = {"n": 0, "cancel": False, "first": True}
        clock = time.perf_counter

        class Streamer(BaseStreamer):
            def put(self, value):
                if state["first"]:  # generate() first passes the prompt
                    state["first"] = False
                    return
                new = [int(x) for x in value.reshape(-1).tolist()]
                state["n"] += len(new)
                if top_k and steps:
                    lps = [top_logprobs(steps.pop(0), t, top_k) for t in new]
                    out.send_ids(array.array("i", new).tobytes(), clock(), True, lps)
                else:
                    out.pending += new
                    out.due(clock())
                for msg in chan.poll():
                    if msg[0] == "cancel" and msg[1] == rid:
                        state["cancel"] = True
                    elif msg[0] == "cancel":
                        for m in [m for m in waiting if m[1] == msg[1]]:
                            waiting.remove(m)
                    else:
                        waiting.append(msg)

            def end(self):
                pass

        class Cancelled(StoppingCriteria):
            def __call__(self, input_ids, scores, **kwargs):
                return torch.full((input_ids.shape[0],), state["cancel"], dtype=torch.bool, device=input_ids.device)

        try:
            enc = tok(body.get("prompt", ""), return_tensors="pt").to(self.device)
            out.start(int(enc["input_ids"].shape[-1]))
            kwargs: dict[str, Any] = {"max_new_tokens": max_new, "pad_token_id": tok.pad_token_id or tok.eos_token_id,
                                      "stopping_criteria": StoppingCriteriaList([Cancelled()])}
            if temperature > 0:
                kwargs.update(do_sample=True, temperature=temperature, top_p=float(body.get("top_p") or 1.0))
                if body.get("seed") is not None:
                    torch.manual_seed(int(body["seed"]))
            else:
                kwargs.update(GREEDY_KWARGS)
            if body.get("ignore_eos"):
                kwargs["min_new_tokens"] = max_new
            if top_k:
                class Record(LogitsProcessor):  # sees the scores greedy search picks from
                    def __call__(self, input_ids, scores):
                        steps.append(torch.log_softmax(scores[0].float(), dim=-1))
                        return scores

                kwargs["logits_processor"] = LogitsProcessorList([Record()])
            with torch.inference_mode():
                self.model.generate(**enc, streamer=Streamer(), **kwargs)
        except Exception as exc:  # noqa: BLE001 - surfaced to the client as an error event
            traceback.print_exc()
            out.fail(exc)
            return
        self.n_generated += state["n"]
        out.finish("abort" if state["cancel"] else "length" if state["n"] >= max_new else "stop", self.stats())

    def serve(self, chan) -> None:
        """Commands in arrival order until the worker goes (continuous batching: its own loop)."""
        if self.batcher is not None:
            self.batcher.serve(chan)
            return
        waiting: collections.deque = collections.deque()
        while True:
            if not waiting:
                waiting.extend(chan.wait())
            msg = waiting.popleft()
            kind, rid = msg[0], msg[1]
            if kind == "gen" and cancelled_in(waiting, rid):
                continue  # its cancel came with it: dropped, as a waiting request's cancel drops it
            if kind == "gen":
                if self.static and batch_key(msg[2]) is not None:
                    serve_static(self, msg, chan, waiting)
                else:
                    self.generate(rid, msg[2], chan, waiting)
            elif kind == "tokenize":
                answer_tokenize(self, chan.send, rid, msg[2])
            elif kind == "score":
                answer_call(chan.send, rid, self.score, msg[2])
            # a cancel for a request not running: it was dropped from `waiting` when it came


def answer_call(send, rid: Any, fn, arg) -> None:
    """``("ans", rid, fn(arg))``, or ``("err", rid, message)``."""
    try:
        send(("ans", rid, fn(arg)))
    except Exception as exc:  # noqa: BLE001 - the worker answers it as an engine error
        traceback.print_exc()
        send(("err", rid, f"{type(exc).__name__}: {exc}"))


def threads_in_new_thread(torch) -> int:
    """``torch.get_num_threads()`` as a new thread sees it (the continuous batching manager steps
    on a thread of its own, not on the one that set it)."""
    got: list[int] = []
    t = threading.Thread(target=lambda: got.append(torch.get_num_threads()))
    t.start()
    t.join()
    return got[0]


def hold_gpu_memory(torch, headroom_gib: float, held: list) -> float:
    """Allocate free GPU memory into ``held`` until only ``headroom_gib`` GiB stay free.

    Chunks of 1 GiB, then halves down to 2 MiB, so that fragmentation does not stop early.

    Returns:
        GiB held.
    """
    free, _ = torch.cuda.mem_get_info()
    target = free - int(headroom_gib * 2**30)
    chunk, got = 2**30, 0
    while target - got > 0 and chunk >= 2**21:
        n = min(chunk, target - got)
        try:
            held.append(torch.empty(n, dtype=torch.uint8, device="cuda"))
            got += n
        except torch.OutOfMemoryError:
            chunk //= 2
    print(f"gpu_headroom_gib={headroom_gib}: holding {got / 2**30:.2f} GiB of GPU memory", flush=True)
    return round(got / 2**30, 2)


def run(make_engine, argv: list[str] | None = None) -> None:
    """Entry point of an engine process: load with ``make_engine(model, options)``, then serve.

    Args:
        make_engine: the engine class (:class:`TransformersEngine` or a subclass).
        argv: ``--model M --options JSON --cmd-fd N --out-fd M --bell-fd B``.
    """
    chan, engine = start_child(argv, make_engine)
    chan.send(("ready", engine.info()))
    try:
        engine.serve(chan)
    except (EOFError, BrokenPipeError):  # the worker is gone: so is this process
        os._exit(0)


if __name__ == "__main__":
    run(TransformersEngine)
