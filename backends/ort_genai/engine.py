"""The ORT GenAI engine process: ``og.Model`` and its scheduler, on its own interpreter.

Started by :mod:`backends.ort_genai.worker` (the HTTP side) as ``python -m
backends.ort_genai.engine --model EXPORT_DIR --options JSON --cmd-fd N --out-fd M
--bell-fd B``; the
two talk in :mod:`backends._hosting.worker_pipe` frames, so the decode loop shares no GIL with the
HTTP server. Three schedulers:

- ``generator``: one ``og.Generator`` per request, one at a time, on the main thread.
- ``static`` (the default for an export without PagedAttention: CPU): the greedy requests
  waiting together as one right-padded ``og.Generator`` batch
  (:mod:`backends.ort_genai.generator_batch`), sampled ones alone. On SmolLM2-135M int4, 2-core
  host, 8 sessions: 192 tok/s and TTFT p50 0.78 s against og.Engine's 178 tok/s and 1.64 s.
- ``engine``: ``og.Engine`` + ``og.Request`` on the main thread
  (:class:`backends.ort_genai.og_engine.EngineScheduler`): continuous batching for a
  ``PagedAttention`` export (``genai_config.json`` ``engine.dynamic_batching``; the default
  there), static batches of up to 4 otherwise.

Requests that ask for logprobs run on og.Generator reading logits, greedy ones waiting together
as one batch (:mod:`backends.ort_genai.generator_batch`), or for a paged export, which og.Generator
cannot feed, alone through the export's graph in an ONNX Runtime session
(:mod:`backends.ort_genai.paged_logits`).

Frames of a dense stream are not sent one per token (see
:class:`backends.ort_genai.frames.Out`); their text is None when the worker process
detokenizes (see :func:`backends.ort_genai.tokenizing.worker_detokenizer`).
Commands and frames between worker and engine: :mod:`backends.ort_genai.frames`.

Options: ``batching``, ``execution_provider``, ``source_model``, ``intra_op_num_threads``,
``stream_interval_ms``, ``max_batch_size``.
"""

from __future__ import annotations

import array
import contextlib
import json
import os
import sys
import time
from typing import Any

from backends.ort_genai.frames import TOKENIZE, Decoder, Out, answer_tokenize
from backends.ort_genai.generator_batch import MAX_BATCH, RESTART_TOKENS, WAVE_WAIT_S, Inbox, batch_key, run_batch, take_batch
from backends.ort_genai.og_engine import EngineScheduler
from backends.ort_genai.tokenizing import tokenizer_disagreement, worker_detokenizer
from backends._hosting.worker_pipe import start_child
from backends.ort_genai.paged_logits import run_paged_with_logprobs


# ``og.Generator.generate_next_token`` holds the GIL for its whole step, so the command thread (new
# requests, cancels) got the GIL only when Python's switch interval (5 ms) forced a switch: requests
# reached the inbox in 5 ms bursts while a batch ran, too late for a young batch to take them in (the
# fixture at 8 sessions: 7 requests queued through a 64-token batch of one). Measured in the ORT GenAI
# environment on the 2-core host (og.Generator steps of ~77 us, a thread woken from a pipe every 3 ms):
# command latency p50 5.2 ms at 5 ms, 1.1 ms at 1 ms, 0.66 ms at 0.5 ms, 0.39 ms at 0.2 ms; step time
# within noise at each (76-82 us). Only a thread that waits for the GIL asks for a switch, so an idle
# command thread costs the loop nothing.
GIL_SWITCH_S = 0.0005


def prefer_commands() -> None:
    """Let the command thread in between og.Generator steps (:data:`GIL_SWITCH_S`); set at start for
    the ``generator`` and ``static`` schedulers (stated in the notes as ``gil_switch_interval_ms``)."""
    sys.setswitchinterval(GIL_SWITCH_S)


class OrtGenaiEngine:
    """``og.Model`` with a generator-per-request or an ``og.Engine`` scheduler.

    Args:
        model_dir: export folder (``genai_config.json``).
        options: ``batching`` (engine|generator|static; unset: engine for a paged export, else
            static), ``max_batch_size`` (static batches' rows), ``execution_provider`` (cpu|cuda|...),
            ``source_model`` (checkpoint folder, for the tokenizer fallback),
            ``intra_op_num_threads`` (decoder session threads; None: ORT's default),
            ``stream_interval_ms`` (frame period of a dense stream; 0: a frame per token).
    """

    def __init__(self, model_dir: str, options: dict[str, Any]):
        import numpy as np
        import onnxruntime_genai as og

        self.og, self.np = og, np
        ep = options.get("execution_provider") or "cpu"
        self.model_dir, self.ep, self.options = model_dir, ep, options
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
        self._load_tokenizer(src)
        with open(os.path.join(model_dir, "genai_config.json")) as fh:
            json_config = json.load(fh)
        self._read_ids(json_config["model"])
        self.batch = contextlib.nullcontext  # the pipe's batch(): set by serve()
        self.tokenizer_json = worker_detokenizer(self, model_dir, src)
        self.stream_interval_s = float(options.get("stream_interval_ms") or 0) / 1000
        self.inbox = Inbox()
        self.cancelled: set = set()
        self.max_running = 0
        self.own_s = self.og_s = 0.0
        self.decode_steps = 0
        self.logprobs_rows_max = 0  # the most logprobs requests one og.Generator batch ran
        self.restarts = 0  # og.Generator batches stopped young to take in newcomers (generator_batch.py)
        self.wave: tuple | None = None  # (requests of the last batch's wave, when it ended, batch key, of them those that waited)
        self.wave_waits = 0  # batches whose first request waited for the rest of a wave
        self.wave_gap_s: float | None = None  # the last whole wave's longest gap between arrivals
        self.max_batch = int(options.get("max_batch_size") or MAX_BATCH)
        self._t_out: float | None = None
        self.sched: EngineScheduler | None = None
        self.engine_seeds = True
        self.paged_logits = None  # made at the first logprobs request of a paged export
        self._choose_scheduler((json_config.get("engine") or {}).get("dynamic_batching"))
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
        if self.sched is not None:
            self.info["engine_max_batch_size"] = self.sched.caps
            self.info["continuous_batching"] = self.paged

    def _load_tokenizer(self, src: str) -> None:
        """og's tokenizer of the export, or (when og refuses it or it disagrees with the checkpoint's
        ``tokenizer.json``) that file through ``tokenizers``, the reason in the notes."""
        reason = None
        try:
            self.tokenizer = self.og.Tokenizer(self.model)
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

    def _read_ids(self, gcfg: dict[str, Any]) -> None:
        """EOS ids, the pad id (right-pads og.Generator batches) and the context from ``genai_config.json``'s model."""
        eos = gcfg.get("eos_token_id")
        self.eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        pad = gcfg.get("pad_token_id")
        pad = pad[0] if isinstance(pad, list) and pad else pad
        self.pad_id = pad if isinstance(pad, int) else None
        self.context_length = int(gcfg.get("context_length") or 0) or None

    def _choose_scheduler(self, dynamic: Any) -> None:
        """The scheduler the ``batching`` option names; unset: og.Engine for a paged export (it
        batches continuously), else og.Generator static batches (og.Engine's static scheduler runs at
        most 4 per batch; benchmarks/bench_fidelity.py).

        Raises:
            RuntimeError: og.Generator asked for on a PagedAttention export (it cannot feed it).
        """
        self.paged = isinstance(dynamic, dict)
        self.batching = self.options.get("batching") or ("engine" if self.paged else "static")
        if self.paged:
            self.notes["logprobs_path"] = ("requests with logprobs run alone through the export's own graph in an "
                                           "onnxruntime.InferenceSession (og.Engine gives no logits; og.Generator "
                                           "cannot feed a PagedAttention decoder): backends/ort_genai/paged_logits.py")
        if self.paged and self.batching in ("generator", "static"):
            raise RuntimeError(f"batching={self.batching} cannot serve this export: it is a PagedAttention one "
                               "(genai_config.json engine.dynamic_batching) whose decoder takes 1-D input_ids, "
                               "og.Generator feeds 2-D; serve it with batching=engine or export paged_attention=false")
        if self.batching == "engine":
            self.sched = EngineScheduler(self, self.paged, dynamic)
        else:  # og.Generator loops hold the GIL for a whole step: let the command thread in between steps
            prefer_commands()
            self.notes["gil_switch_interval_ms"] = (f"{sys.getswitchinterval() * 1000:g} (og.Generator steps hold the "
                                                     "GIL: backends/ort_genai/engine.py GIL_SWITCH_S)")
        if self.batching == "static":
            self.notes["static_batching"] = (
                f"og.Generator static batches: the greedy requests waiting together share one right-padded "
                f"og.Generator batch (up to {self.max_batch}; a batch restarts while its rows are at most "
                f"{RESTART_TOKENS} tokens old to take in a wave's late arrivals; after a batch the next one waits up to "
                f"{WAVE_WAIT_S * 1000:g} ms for the rest of the wave: its rows' clients' next requests and those that "
                "waited through it), sampled requests run alone: backends/ort_genai/generator_batch.py")

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
        ``decode_steps_total`` the steps (generated tokens / steps: how full the batches were),
        ``logprobs_batch_rows_max`` the most logprobs requests one og.Generator batch ran,
        ``static_batch_restarts_total`` the og.Generator batches restarted young to take in
        newcomers, ``static_batch_wave_waits_total`` the batches whose first request waited for
        the rest of a wave (:mod:`backends.ort_genai.generator_batch`). own /
        (own + og) is the share of the decode
        thread the worker takes, measured within the same requests, so it does not carry the
        run-to-run drift that a tokens/s comparison with a separate bare loop does.
        """
        return {"max_running_requests": self.max_running, "engine_seeds_honoured": int(self.engine_seeds),
                "decode_own_seconds_total": round(self.own_s, 6), "decode_og_seconds_total": round(self.og_s, 6),
                "decode_steps_total": self.decode_steps, "logprobs_batch_rows_max": self.logprobs_rows_max,
                "static_batch_restarts_total": self.restarts, "static_batch_wave_waits_total": self.wave_waits}

    # -- the main thread -----------------------------------------------------------------
    def serve(self, send, batch=contextlib.nullcontext) -> None:
        """Run requests from :attr:`inbox` forever (the process ends when the worker goes); ``send``
        writes a frame; frames sent inside ``batch()`` may leave as one write (an og.Engine step's)."""
        self.batch = batch
        if self.sched is not None:  # og.Engine.run releases the GIL: commands get in as they come
            self.sched.loop(send, batch)
            return
        while True:
            rid, body = item = self.inbox.get()
            if TOKENIZE in body:
                answer_tokenize(self, send, rid, body[TOKENIZE])
                continue
            if body.get("logprobs"):
                self.run_with_logprobs(item, send)
                continue
            if self.batching == "static" and batch_key(body) is not None:
                run_batch(self, take_batch(self, item), send, batch)
                continue
            out = Out(send, rid, self.stream_interval_s)
            try:
                self.run_generator(rid, body, out)
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
    def run_generator(self, rid: Any, body: dict[str, Any], out) -> None:
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
        ended_on_eos = self._send_rest(gen, out, base, sent, n)
        self.own_s += own
        self.og_s += og_s
        self.decode_steps += n
        del gen
        if cancelled and rid in cancelled:
            out.finish("abort", self.stats())
            return
        self.max_running = max(self.max_running, 1)
        out.finish("stop" if n < max_new or (ended_on_eos and not body.get("ignore_eos")) else "length", self.stats())

    def _send_rest(self, gen, out, base: int, sent: int, n: int) -> bool:
        """Send the ids of the ``n`` steps not sent yet (``sent`` were); whether the last was an EOS.

        og leaves the EOS it ends on out of ``get_sequence`` (onnxruntime-genai 0.18.0: 5 steps, the
        fifth an EOS, a sequence 4 longer than the prompt, greedy or sampled), so a frame cut from the
        sequence lost it: the stream then had one token fewer than the static batches' (which read
        ``get_next_tokens``) and its finish reason hung on whichever id came last. It is read from
        ``get_next_tokens`` and sent last, as the batches send it."""
        if not n:
            return False
        seq = gen.get_sequence(0)
        raw = seq[base + sent:base + n].tobytes()
        last = int(seq[base + n - 1]) if len(seq) >= base + n else None
        if last is None:  # the last step's token is not in the sequence: og ended on it
            last = int(gen.get_next_tokens()[0])
            raw += array.array("i", [last]).tobytes()
        if raw:
            out.send_ids(raw, time.perf_counter(), False)
        return last in self.eos_ids

    def search_options(self, body: dict[str, Any], n_prompt: int) -> dict[str, Any]:
        max_new = int(body.get("max_tokens") or 16)
        opts: dict[str, Any] = {"max_length": n_prompt + max_new}
        temperature = float(body.get("temperature") or 0.0)
        if temperature > 0:
            opts.update(do_sample=True, temperature=temperature, top_p=float(body.get("top_p") or 1.0), top_k=0)
            if body.get("seed") is not None:
                opts["random_seed"] = int(body["seed"])
        else:  # the export's genai_config.json carries the checkpoint's repetition_penalty: neutral for greedy
            opts.update(do_sample=False, repetition_penalty=1.0)
        if body.get("ignore_eos"):
            opts["min_length"] = n_prompt + max_new
        return opts

    def run_with_logprobs(self, item: tuple, send) -> None:
        """A request that asks for logprobs, with the compatible ones waiting behind it: one
        og.Generator batch reading ``get_logits()`` (:mod:`backends.ort_genai.generator_batch`), or
        for a paged export (og.Generator cannot feed it) alone through the export's own graph in
        an ONNX Runtime session (:mod:`backends.ort_genai.paged_logits`)."""
        if not self.paged:
            run_batch(self, take_batch(self, item), send, self.batch)
            return
        out = Out(send, item[0], self.stream_interval_s)
        try:
            run_paged_with_logprobs(self, item[0], item[1], out)
        except Exception as exc:
            out.fail(exc)
        self.cancelled.discard(item[0])


def main(argv: list[str] | None = None) -> None:
    pipe, engine = start_child(argv, OrtGenaiEngine)
    # The worker gone (EOF on commands) ends this process even in the middle of a request.
    pipe.listen(engine.on_command, on_eof=lambda: os._exit(0))
    pipe.send(("ready", engine.info))
    try:
        engine.serve(pipe.send, pipe.batch)
    except BrokenPipeError:
        os._exit(0)


if __name__ == "__main__":
    main()
