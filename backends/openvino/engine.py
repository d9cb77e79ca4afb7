"""The OpenVINO GenAI engine process: the pipeline and its driver loop, on their own interpreter.

Started by :mod:`backends.openvino.worker` (the HTTP side,
:class:`backends._hosting.engine_proxy.PipeEngineProxy`) as ``python -m backends.openvino.engine
--model IR_DIR --options JSON --cmd-fd N --out-fd M --bell-fd B``; the two talk in
:mod:`backends._hosting.engine_frames` frames. Why a process of its own: ``ContinuousBatchingPipeline.step()``
holds the GIL for the whole step (openvino.genai's Python binding of ``step`` releases none), so
an HTTP loop in the same interpreter ran only when Python's 5 ms switch interval forced a switch:
whole 64-token streams reached the client in one burst (issue 28). For the same reason this
process has one thread: the loop reads its commands between steps (:meth:`ChildPipe.poll`), as a
bare ``add_request`` / ``step`` loop would, instead of a command thread that would wait for the GIL.

Two modes (``batching``):

- ``continuous`` (default): ``openvino_genai.ContinuousBatchingPipeline`` with a
  ``SchedulerConfig`` (paged KV cache of ``kv_cache_gib``); the loop adds requests and calls
  ``step()`` while any is unfinished; each request's ``GenerationHandle.read()`` gives its new
  token ids (and their log-probabilities) after every step. Concurrent sessions share each step.
- ``pipeline``: ``openvino_genai.LLMPipeline``, one ``generate`` at a time, tokens through a
  ``StreamerBase`` (which also reads commands: a cancel stops the running generation).

Prompts are tokenized here with the pipeline's own tokenizer (what ``add_request(prompt)`` does
with ``apply_chat_template=False``) and given to ``add_request`` as ids, so the prompt's token
count costs no second encoding (``LLMPipeline.generate`` takes the text). Options: ``batching``, ``device``,
``kv_cache_gib``, ``max_num_seqs``, ``enable_prefix_caching``, ``inference_precision``,
``inference_num_threads``, ``stream_interval_ms``.
"""

from __future__ import annotations

import array
import collections
import os
import time
import traceback
from typing import Any

from backends._hosting.engine_frames import Out, answer_tokenize
from backends._hosting.worker_pipe import start_child


def kv_cache_precision(ov, device: str, props: dict[str, Any]) -> str | None:
    """The element type the device plugin stores the KV cache in (``KV_CACHE_PRECISION``: the CPU
    plugin's default is ``u8`` with per-token scales on x86), or None when the plugin does not say."""
    value = props.get("KV_CACHE_PRECISION")
    try:
        value = value if value is not None else ov.Core().get_property(device, "KV_CACHE_PRECISION")
    except Exception:  # noqa: BLE001 - a plugin without the property
        return None
    # an openvino.Type prints as "<Type: 'uint8_t'>"; its type name is the element type ("u8")
    return str(value.get_type_name() if hasattr(value, "get_type_name") else value)


class CumulativeDecoder:
    """Text deltas from the pipeline's own tokenizer (no ``tokenizer.json`` for the worker to use)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.ids, self.text = tokenizer, [], ""

    def push(self, token: int) -> str:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # incomplete multi-byte character: wait for more
            return ""
        delta, self.text = text[len(self.text):], text
        return delta


class OpenVinoEngine:
    """The pipeline and its loop (module docstring).

    Args:
        model_dir: the IR folder (``adapters.openvino_export``).
        options: see the module docstring; ``inference_num_threads`` becomes the plugin's
            ``INFERENCE_NUM_THREADS`` (None: the plugin's default).
    """

    def __init__(self, model_dir: str, options: dict[str, Any]):
        import openvino as ov
        import openvino_genai as og

        self.og, self.ov = og, ov
        self.mode = options.get("batching") or "continuous"
        device = options.get("device") or "CPU"
        props: dict[str, Any] = {}
        if options.get("inference_precision"):
            props["INFERENCE_PRECISION_HINT"] = options["inference_precision"]
        if options.get("inference_num_threads"):
            props["INFERENCE_NUM_THREADS"] = int(options["inference_num_threads"])
        self.info: dict[str, Any] = {"engine": "openvino-genai", "engine_version": og.__version__,
                                     "openvino_version": ov.get_version(), "device": device.lower(),
                                     "batching": self.mode, "properties": props, "engine_process": os.getpid()}
        if self.mode == "continuous":
            sc = og.SchedulerConfig()
            sc.cache_size = int(options.get("kv_cache_gib") or 1)
            sc.max_num_seqs = int(options.get("max_num_seqs") or 64)
            sc.enable_prefix_caching = bool(options.get("enable_prefix_caching", True))
            self.pipe = og.ContinuousBatchingPipeline(model_dir, sc, device, props)
            self.info.update(scheduler=sc.to_string().strip(), kv_cache_gib=sc.cache_size,
                             max_num_seqs=sc.max_num_seqs, prefix_caching=sc.enable_prefix_caching,
                             kv_cache_precision=kv_cache_precision(ov, device, props))
        else:
            self.pipe = og.LLMPipeline(model_dir, device, **props)
        self.tokenizer = self.pipe.get_tokenizer()
        tj = os.path.join(model_dir, "tokenizer.json")
        self.info["tokenizer_json"] = tj if os.path.isfile(tj) else None
        self.info["detokenizer"] = ("tokenizers.DecodeStream (tokenizer.json) in the worker process"
                                    if self.info["tokenizer_json"] else "openvino_genai.Tokenizer in the engine process")
        self.info["logprobs"] = "chosen token only (GenerationConfig.logprobs supports 1)" \
            if self.mode == "continuous" else "none"
        self.interval_s = float(options.get("stream_interval_ms") or 0) / 1000
        self.info["stream_interval_ms"] = self.interval_s * 1000
        self.active: dict[Any, list] = {}  # rid -> [handle, out, want_lp, max_new, count]
        self.waiting: collections.deque = collections.deque()  # pipeline mode: gen commands not begun
        self.max_running = 0
        self.steps = 0

    # -- requests -------------------------------------------------------------------------------
    def encode(self, prompt: str) -> list[int]:
        """The ids the pipeline feeds the model for ``prompt`` (its tokenizer, special tokens as generate adds)."""
        return [int(t) for t in self.tokenizer.encode(prompt).input_ids.data.reshape(-1)]

    def config(self, body: dict[str, Any], want_logprobs: bool):
        cfg = self.og.GenerationConfig()
        cfg.max_new_tokens = int(body.get("max_tokens") or 16)
        cfg.apply_chat_template = False
        temperature = float(body.get("temperature") or 0.0)
        if temperature > 0:
            cfg.do_sample = True
            cfg.temperature = temperature
            cfg.top_p = float(body.get("top_p") or 1.0)
            if body.get("seed") is not None:
                cfg.rng_seed = int(body["seed"])
        else:
            cfg.do_sample = False
        if body.get("ignore_eos"):
            cfg.ignore_eos = True
        if want_logprobs:
            cfg.logprobs = 1
        return cfg

    def stats(self) -> dict[str, float]:
        """Counters for the worker's ``/metrics`` (sent with every request's end)."""
        out: dict[str, float] = {"max_running_requests": self.max_running, "decode_steps_total": self.steps}
        if self.mode == "continuous":
            m = self.pipe.get_metrics()
            out.update(kv_cache_usage_perc=float(m.cache_usage), kv_cache_max_usage_perc=float(m.max_cache_usage),
                       kv_cache_size_bytes=float(m.cache_size_in_bytes))
        return out

    def _out(self, send, rid: Any) -> Out:
        decoder = None if self.info["tokenizer_json"] else CumulativeDecoder(self.tokenizer)
        return Out(send, rid, self.interval_s, decoder)

    def _prepare(self, send, rid: Any, body: dict[str, Any]):
        """``(out, ids tensor, config, wants logprobs)`` of a gen command; the ``start`` frame sent."""
        k = body.get("logprobs")
        want_lp = bool(k) and not isinstance(k, bool) and self.mode == "continuous"
        out = self._out(send, rid)
        ids = self.tokenizer.encode(body.get("prompt", "")).input_ids
        out.start(int(ids.data.shape[-1]))
        return out, ids, self.config(body, want_lp), want_lp

    # -- continuous batching --------------------------------------------------------------------
    def command(self, msg: tuple, send) -> None:
        """One command from the worker (continuous mode)."""
        kind, rid = msg[0], msg[1]
        if kind == "tokenize":
            answer_tokenize(self, send, rid, msg[2])
        elif kind == "cancel":
            entry = self.active.pop(rid, None)
            if entry is not None:
                entry[0].cancel()
                entry[1].finish("abort", self.stats())
        elif kind == "gen":
            try:
                out, ids, cfg, want_lp = self._prepare(send, rid, msg[2])
                handle = self.pipe.add_request(rid, ids, cfg)
            except Exception as exc:  # noqa: BLE001 - a refused request: its client learns why
                self._out(send, rid).fail(exc)
                return
            self.active[rid] = [handle, out, want_lp, cfg.max_new_tokens, 0]

    def loop_continuous(self, chan) -> None:
        """Add what came, step, hand each request its new tokens; block only when idle."""
        og, active, clock = self.og, self.active, time.perf_counter
        finished, running = og.GenerationStatus.FINISHED, og.GenerationStatus.RUNNING
        while True:
            for msg in (chan.poll() if active else chan.wait()):
                self.command(msg, chan.send)
            if not active:
                continue
            self.max_running = max(self.max_running, len(active))
            try:
                self.pipe.step()
            except Exception as exc:  # noqa: BLE001 - the engine failed: every open request learns why
                traceback.print_exc()
                for entry in active.values():
                    entry[1].fail(RuntimeError(f"ContinuousBatchingPipeline.step failed: {type(exc).__name__}: {exc}"))
                active.clear()
                continue
            self.steps += 1
            with chan.batch():  # this step's frames for all its streams: one write, one doorbell
                self._hand_out(active, clock(), finished, running)

    def _hand_out(self, active: dict, now: float, finished, running) -> None:
        """Each active request's new tokens after a step; finished requests end."""
        og = self.og
        for rid, entry in list(active.items()):
            handle, out, want_lp = entry[0], entry[1], entry[2]
            ids: list[int] = []
            lps: list[float] = []
            while handle.can_read():
                for o in handle.read().values():
                    ids += o.generated_ids
                    if want_lp:
                        lps += o.generated_log_probs
            if ids:
                entry[4] += len(ids)
                if want_lp:
                    out.send_ids(array.array("i", ids).tobytes(), now, True,
                                 [(float(lp), [(int(t), float(lp))]) for t, lp in zip(ids, lps)])
                else:
                    out.pending += ids
                    out.due(now)
            status = handle.get_status()
            if status == running:
                continue
            del active[rid]
            if status == finished:
                out.finish("length" if entry[4] >= entry[3] else "stop", self.stats())
            else:
                out.fail(RuntimeError(f"openvino_genai ended the request with status {status.name}"
                                      + (" (out of KV cache blocks)" if status == og.GenerationStatus.IGNORED
                                         else "")))

    # -- LLMPipeline ----------------------------------------------------------------------------
    def loop_pipeline(self, chan) -> None:
        """One ``generate`` at a time, in arrival order; commands are read between tokens."""
        waiting, send = self.waiting, chan.send
        while True:
            if not waiting:
                waiting.extend(chan.wait())
            msg = waiting.popleft()
            if msg[0] == "tokenize":
                answer_tokenize(self, send, msg[1], msg[2])
            elif msg[0] == "gen":
                self._generate(msg[1], msg[2], chan)
            # a cancel for a request that is not running: nothing to stop

    def _generate(self, rid: Any, body: dict[str, Any], chan) -> None:
        og, clock, waiting = self.og, time.perf_counter, self.waiting
        try:
            out, ids, cfg, _ = self._prepare(chan.send, rid, body)
        except Exception as exc:  # noqa: BLE001
            self._out(chan.send, rid).fail(exc)
            return
        state = {"n": 0, "cancel": False}

        class Streamer(og.StreamerBase):
            def write(self, token):
                new = [int(token)] if isinstance(token, int) else [int(t) for t in token]
                state["n"] += len(new)
                out.pending += new
                out.due(clock())
                for msg in chan.poll():
                    if msg[0] == "cancel" and msg[1] == rid:
                        state["cancel"] = True
                    elif msg[0] == "cancel":
                        waiting_ids = [m for m in waiting if m[1] == msg[1] and m[0] == "gen"]
                        for m in waiting_ids:
                            waiting.remove(m)
                    else:
                        waiting.append(msg)
                return og.StreamingStatus.CANCEL if state["cancel"] else og.StreamingStatus.RUNNING

            def end(self):
                pass

        self.max_running = 1
        try:
            self.pipe.generate(body.get("prompt", ""), cfg, Streamer())
        except Exception as exc:  # noqa: BLE001 - surfaced to the client as an error event
            out.fail(exc)
            return
        self.steps += state["n"]
        out.finish("abort" if state["cancel"] else "length" if state["n"] >= cfg.max_new_tokens else "stop",
                   self.stats())

    def serve(self, chan) -> None:
        (self.loop_continuous if self.mode == "continuous" else self.loop_pipeline)(chan)


def main(argv: list[str] | None = None) -> None:
    chan, engine = start_child(argv, OpenVinoEngine)
    chan.send(("ready", engine.info))
    try:
        engine.serve(chan)
    except (EOFError, BrokenPipeError):  # the worker is gone: so is this process
        os._exit(0)


if __name__ == "__main__":
    main()
