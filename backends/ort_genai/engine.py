"""The ORT GenAI engine process: ``og.Model`` and its scheduler, on its own interpreter.

Started by :mod:`backends.ort_genai.worker` (the HTTP side) as ``python -m
backends.ort_genai.engine --model EXPORT_DIR --options JSON --cmd-fd N --out-fd M
--bell-fd B``; the
two talk in :mod:`backends._hosting.worker_pipe` frames, so the decode loop shares no GIL with the
HTTP server. Two schedulers:

- ``generator``: one ``og.Generator`` per request, one at a time, on the main thread.
- ``engine``: ``og.Engine`` + ``og.Request`` (0.18.0: ``create_request``, ``begin_turn``
  with ``og.TurnOptions``, ``run(event_buffer)`` returning ``EngineEvent``s), on the main
  thread (0.18.0 raises "Engine operations must be called from the Engine owner thread"
  elsewhere). It schedules several requests per step, also on CPU (checked on 0.18.0).

Frames of a dense stream are not sent one per token (see
:class:`backends.ort_genai.frames.Out`); their text is None when the worker process
detokenizes (see :func:`backends.ort_genai.tokenizing.worker_detokenizer`).
Commands and frames between worker and engine: :mod:`backends.ort_genai.frames`.

Options: ``batching``, ``execution_provider``, ``source_model``, ``intra_op_num_threads``,
``stream_interval_ms``.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import sys
import time
import traceback
from typing import Any

from backends.ort_genai.frames import TOKENIZE, Collect, Decoder, Out, answer_tokenize, finish_name
from backends.ort_genai.tokenizing import tokenizer_disagreement, worker_detokenizer


class OrtGenaiEngine:
    """``og.Model`` with a generator-per-request or an ``og.Engine`` scheduler.

    Args:
        model_dir: export folder (``genai_config.json``).
        options: ``batching`` (engine|generator; unset: engine, falling back to generator when
            a 1-token warm-up fails), ``execution_provider`` (cpu|cuda|...),
            ``source_model`` (checkpoint folder, for the tokenizer fallback),
            ``intra_op_num_threads`` (decoder session threads; None: ORT's default),
            ``stream_interval_ms`` (frame period of a dense stream; 0: a frame per token).
    """

    def __init__(self, model_dir: str, options: dict[str, Any]):
        import numpy as np
        import onnxruntime_genai as og

        self.og, self.np = og, np
        ep = options.get("execution_provider") or "cpu"
        config = og.Config(model_dir)
        config.clear_providers()
        if ep != "cpu":
            config.append_provider(ep)
        if options.get("intra_op_num_threads"):
            config.overlay(json.dumps({"model": {"decoder": {"session_options": {
                "intra_op_num_threads": int(options["intra_op_num_threads"])}}}}))
        self.model = og.Model(config)
        self.notes: dict[str, str] = {}
        src = options.get("source_model") or model_dir
        reason = None
        try:
            self.tokenizer = og.Tokenizer(self.model)
            reason = tokenizer_disagreement(self.tokenizer, os.path.join(src, "tokenizer.json"))
        except Exception as exc:
            reason = f"og.Tokenizer refused the export's tokenizer: {exc}"
        self.og_tokenizer = reason is None
        self.tokenizer_source = "og.Tokenizer (export folder)"
        if reason is not None:
            from tokenizers import Tokenizer

            self.tokenizer = Tokenizer.from_file(os.path.join(src, "tokenizer.json"))
            self.tokenizer_source = f"tokenizers ({src}/tokenizer.json)"
            self.notes["tokenizer_fallback"] = reason
        with open(os.path.join(model_dir, "genai_config.json")) as fh:
            gcfg = json.load(fh)["model"]
        eos = gcfg.get("eos_token_id")
        self.eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        self.tokenizer_json = worker_detokenizer(self, model_dir, src)
        self.context_length = int(gcfg.get("context_length") or 0) or None
        self.batching = options.get("batching") or "engine"
        self.stream_interval_s = float(options.get("stream_interval_ms") or 0) / 1000
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.cancelled: set = set()
        self.max_running = 0
        self.own_s = self.og_s = 0.0
        self.decode_steps = 0
        self._t_out: float | None = None
        self.engine = None
        self.engine_seeds = True
        if self.batching == "engine":
            self.engine = og.Engine(self.model)
            self._caps = self.engine.get_capabilities().configured_max_batch_size
            self.buf = self.engine.create_event_buffer(256)
            self._flags = (int(og.EngineEventFlags.TOKEN.value), int(og.EngineEventFlags.FAILED.value),
                           og.FinishReason.NONE)
            if not options.get("batching"):
                self._warm_up_engine()
                self.own_s = self.og_s = 0.0
                self.decode_steps = 0
        self.info = {
            "engine": "onnxruntime-genai", "engine_version": og.__version__, "device": ep,
            "max_model_len": self.context_length, "batching": self.batching,
            "tokenizer": self.tokenizer_source, "notes": self.notes,
            "intra_op_num_threads": options.get("intra_op_num_threads") or "ORT default",
            "stream_interval_ms": self.stream_interval_s * 1000, "engine_process": os.getpid(),
            "tokenizer_json": self.tokenizer_json,
            "detokenizer": ("tokenizers.DecodeStream in the worker process" if self.tokenizer_json
                            else f"{self.tokenizer_source} in the engine process"),
        }
        if self.engine is not None:
            self.info["engine_max_batch_size"] = self._caps

    def encode(self, prompt: str) -> list[int]:
        if self.og_tokenizer:
            return [int(t) for t in self.tokenizer.encode(prompt)]
        return list(self.tokenizer.encode(prompt).ids)

    def stats(self) -> dict[str, Any]:
        """Counters for the worker's ``/metrics``.

        ``max_running_requests`` is the most requests this process had begun at once; with
        ``og.Engine`` on CPU (static batching) those past ``engine_max_batch_size`` wait
        inside og for the running batch to finish, so it is not the batch size.

        ``decode_own_seconds_total`` is the decode thread's time outside ONNX Runtime GenAI
        calls while requests ran (frames, detokenizing where this process does it, bookkeeping), ``decode_og_seconds_total`` its time inside them
        (``is_done`` + ``generate_next_token``, or ``Engine.run``), and
        ``decode_steps_total`` the steps. own / (own + og) is the share of the decode
        thread the worker takes, measured within the same requests, so it does not carry the
        run-to-run drift that a tokens/s comparison with a separate bare loop does.
        """
        return {"max_running_requests": self.max_running, "engine_seeds_honoured": int(self.engine_seeds),
                "decode_own_seconds_total": round(self.own_s, 6), "decode_og_seconds_total": round(self.og_s, 6),
                "decode_steps_total": self.decode_steps}

    # -- the main thread -----------------------------------------------------------------
    def serve(self, send) -> None:
        """Run requests from :attr:`inbox` forever (the process ends when the worker goes); ``send`` writes a frame."""
        if self.engine is not None:
            self._engine_loop(send)
            return
        while True:
            rid, body = self.inbox.get()
            if TOKENIZE in body:
                answer_tokenize(self, send, rid, body[TOKENIZE])
                continue
            out = Out(send, rid, self.stream_interval_s)
            try:
                if body.get("logprobs"):
                    self._run_with_logprobs(rid, body, out)
                else:
                    self._run_generator(rid, body, out)
            except Exception as exc:
                out.fail(exc)
            self.cancelled.discard(rid)

    def on_command(self, msg: tuple) -> None:
        """Called on the command thread for every frame from the worker."""
        if msg[0] == "gen":
            self.inbox.put((msg[1], msg[2]))
        elif msg[0] == "cancel":
            self.cancelled.add(msg[1])
        elif msg[0] == "tokenize":
            self.inbox.put((msg[1], {TOKENIZE: msg[2]}))

    # -- generator scheduler -------------------------------------------------------------
    def _run_generator(self, rid: Any, body: dict[str, Any], out) -> None:
        og = self.og
        ids = self.encode(body.get("prompt", ""))
        out.start(len(ids))
        max_new = int(body.get("max_tokens") or 16)
        params = og.GeneratorParams(self.model)
        params.set_search_options(**self.search_options(body, len(ids)))
        out.decoder = None if self.tokenizer_json else Decoder(self)
        interval, base, sent = self.stream_interval_s, len(ids), 0
        last_token = last_flush = float("-inf")
        n = 0
        cancelled, clock = self.cancelled, time.perf_counter
        gen = og.Generator(self.model, params)
        gen.append_tokens(ids)
        t_out = clock()
        own = og_s = 0.0
        while True:  # the hot loop: keep it as bare as the bare loop it is measured against
            t_in = clock()
            own += t_in - t_out  # this loop's own work since the last og call
            if gen.is_done() or n >= max_new:
                break
            gen.generate_next_token()
            t_out = clock()
            og_s += t_out - t_in
            n += 1
            # Out.due inlined (a method call per step costs ~1 us on this loop's cold caches);
            # the ids come from one get_sequence per frame instead of get_next_tokens per step
            if t_out - last_token >= interval or t_out - last_flush >= interval:
                out.send_ids(gen.get_sequence(0)[base + sent:base + n].tobytes(), t_out, t_out - last_token >= interval)
                sent, last_flush = n, t_out
                if cancelled and rid in cancelled:
                    break
            last_token = t_out
        if sent < n:
            out.send_ids(gen.get_sequence(0)[base + sent:base + n].tobytes(), clock(), False)
        self.own_s += own
        self.og_s += og_s
        self.decode_steps += n
        del gen
        if cancelled and rid in cancelled:
            out.finish("abort", self.stats())
            return
        eos = n < max_new or (not body.get("ignore_eos") and out.last_id in self.eos_ids)
        self.max_running = max(self.max_running, 1)
        out.finish("stop" if eos else "length", self.stats())

    def search_options(self, body: dict[str, Any], n_prompt: int) -> dict[str, Any]:
        max_new = int(body.get("max_tokens") or 16)
        opts: dict[str, Any] = {"max_length": n_prompt + max_new}
        temperature = float(body.get("temperature") or 0.0)
        if temperature > 0:
            opts.update(do_sample=True, temperature=temperature, top_p=float(body.get("top_p") or 1.0), top_k=0)
            if body.get("seed") is not None:
                opts["random_seed"] = int(body["seed"])
        else:
            opts.update(do_sample=False)
        if body.get("ignore_eos"):
            opts["min_length"] = n_prompt + max_new
        return opts

    def _run_with_logprobs(self, rid: Any, body: dict[str, Any], out) -> None:
        from backends.ort_genai.logprobs import run_with_logprobs

        run_with_logprobs(self, rid, body, out)

    # -- engine scheduler ----------------------------------------------------------------
    def _begin(self, rid: Any, body: dict[str, Any], out, live: dict) -> None:
        og = self.og
        ids = self.encode(body.get("prompt", ""))
        out.start(len(ids))
        max_new = int(body.get("max_tokens") or 16)
        req = self.engine.create_request()
        to = og.TurnOptions(req)
        temperature = float(body.get("temperature") or 0.0)
        to.set_do_sample(temperature > 0)
        if temperature > 0:
            to.set_temperature(temperature)
            to.set_top_p(float(body.get("top_p") or 1.0))
            to.set_top_k(0)
            if body.get("seed") is not None and self.engine_seeds:
                to.set_seed(int(body["seed"]))
        to.set_max_generated_tokens(max_new)
        if body.get("ignore_eos"):
            to.set_min_generated_tokens(max_new)
        try:
            turn = req.begin_turn(self.np.asarray(ids, dtype=self.np.int32), to)
        except RuntimeError as exc:
            if "seed" not in str(exc) or not self.engine_seeds:
                raise
            # 0.18.0: "A per-turn seed requires an Engine configured for dynamic batching"
            # (paged attention, CUDA only): sample unseeded and say so.
            self.engine_seeds = False
            self.notes["engine_seed"] = f"per-request seeds ignored: {exc}"
            to.clear_seed()
            turn = req.begin_turn(self.np.asarray(ids, dtype=self.np.int32), to)
        if isinstance(out, Out) and not self.tokenizer_json:
            out.decoder = Decoder(self)
        live[id(req)] = (req, out, rid, turn)

    def _warm_up_engine(self, timeout_s: float = 300) -> None:
        """One 1-token request through og.Engine; when it fails, serve with og.Generator.

        og 0.18.0's Engine (static batching on CPU) feeds 2-D ``position_ids`` to graphs
        that declare MRoPE's 3-D ones (Qwen3.5-MoE exports) and fails every request, while
        og.Generator runs the same export. Only when the user left ``batching`` unset.
        """
        sink, live = Collect(), {}
        try:
            self._begin("warm-up", {"prompt": "hello", "max_tokens": 1}, sink, live)
            deadline = time.monotonic() + timeout_s
            while live and sink.result is None and time.monotonic() < deadline:
                self._engine_step(live)
        except Exception as exc:
            sink.result = exc
        if isinstance(sink.result, BaseException):
            print(f"og.Engine warm-up failed: {sink.result!r}", file=sys.stderr, flush=True)
            self.notes["batching_fallback"] = (
                f"og.Engine failed a 1-token warm-up ({sink.result}; the engine's own words are in the worker "
                "log); serving with og.Generator, one request at a time")
            self.engine = None
            self.batching = "generator"
        elif sink.result is None:
            self.notes["engine_warmup"] = f"og.Engine warm-up gave no answer in {timeout_s:.0f} s"

    def _engine_loop(self, send) -> None:
        live: dict[int, tuple] = {}
        inbox, cancelled, step = self.inbox, self.cancelled, self._engine_step
        while True:
            if not live:  # idle: block (no GIL held) until a request comes
                self._t_out = None
                self._admit(inbox.get(), live, send)
            while not inbox.empty():  # polled without raising queue.Empty every step
                self._admit(inbox.get(), live, send)
            self.max_running = max(self.max_running, len(live))
            if cancelled:
                for key, (req, out, rid, turn) in list(live.items()):
                    if rid in cancelled:
                        try:
                            req.cancel_turn(turn)  # 0.18.0: takes the id begin_turn returned
                        except Exception as exc:
                            print(f"og.Request.cancel_turn failed: {exc!r}", file=sys.stderr, flush=True)
                        req.close()
                        del live[key]
                        out.finish("abort", self.stats())
                cancelled.clear()
            if not live:
                continue
            try:
                step(live)
            except Exception as exc:
                for _req, out, _rid, _turn in live.values():
                    out.fail(RuntimeError(f"og.Engine.run failed: {exc}"))
                live.clear()

    def _admit(self, item: tuple, live: dict, send) -> None:
        rid, body = item
        if TOKENIZE in body:
            answer_tokenize(self, send, rid, body[TOKENIZE])
            return
        out = Out(send, rid, self.stream_interval_s)
        try:
            if body.get("logprobs"):  # og.Engine gives no logits: this request runs alone on og.Generator
                self._run_with_logprobs(rid, body, out)
                return
            self._begin(rid, body, out, live)
        except Exception as exc:
            out.fail(exc)

    def _engine_step(self, live: dict) -> None:
        token_flag, failed_flag, none = self._flags
        t_in = time.perf_counter()
        if self._t_out is not None:  # the loop's own work since the last Engine.run
            self.own_s += t_in - self._t_out
        events = self.engine.run(self.buf)
        self._t_out = t_out = time.perf_counter()
        self.og_s += t_out - t_in
        self.decode_steps += 1
        for ev in events or ():
            entry = live.get(id(ev.request))
            if entry is None:
                continue
            req, out = entry[0], entry[1]
            flags = int(ev.flags.value)
            if flags & token_flag:
                out.pending.append(int(ev.token))
                out.due(t_out)
            if flags & failed_flag:
                out.fail(RuntimeError(f"og.Engine request failed: error_code={ev.error_code}"))
                live.pop(id(ev.request), None)
            elif ev.finish_reason != none:
                out.finish(finish_name(self.og, ev.finish_reason), self.stats())
                live.pop(id(ev.request), None)
                req.close()


def main(argv: list[str] | None = None) -> None:
    from backends._hosting.worker_pipe import ChildPipe

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--options", default="{}")
    ap.add_argument("--cmd-fd", type=int, required=True)
    ap.add_argument("--out-fd", type=int, required=True)
    ap.add_argument("--bell-fd", type=int, required=True)
    args = ap.parse_args(argv)
    pipe = ChildPipe(args.cmd_fd, args.out_fd, args.bell_fd)
    try:
        engine = OrtGenaiEngine(args.model, json.loads(args.options))
    except BaseException as exc:
        traceback.print_exc()
        pipe.send(("failed", "".join(traceback.format_exception_only(exc)).strip()))
        sys.exit(1)
    # The worker gone (EOF on commands) ends this process even in the middle of a request.
    pipe.listen(engine.on_command, on_eof=lambda: os._exit(0))
    pipe.send(("ready", engine.info))
    try:
        engine.serve(pipe.send)
    except BrokenPipeError:
        os._exit(0)


if __name__ == "__main__":
    main()
