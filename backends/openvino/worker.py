"""Worker process: OpenVINO GenAI behind the OpenAI completions API.

Runs in the ``openvino`` environment (``adapters.openvino_export.env``) as ``python -m
backends.openvino.worker --model IR_DIR --port P --ready-file F --options JSON``
(:mod:`backends._hosting.worker_server`). Two modes (``batching``):

- ``continuous`` (default): ``openvino_genai.ContinuousBatchingPipeline`` with a
  ``SchedulerConfig`` (paged KV cache of ``kv_cache_gib``); one driver thread adds requests
  and calls ``step()`` while any is unfinished; each request's ``GenerationHandle.read()``
  gives its new token ids (and their log-probabilities) after every step. Concurrent
  sessions share each step.
- ``pipeline``: ``openvino_genai.LLMPipeline``, one ``generate`` at a time under a lock,
  tokens through a ``StreamerBase``.

Prompts go in as text with ``apply_chat_template=False`` (GenAI applies the checkpoint's chat
template to plain prompts by default). Token ids are what the engine generated; text is
decoded here from them (``tokenizers.DecodeStream`` over the export's ``tokenizer.json``).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import os
import threading
import traceback
from typing import Any


def _kv_cache_precision(ov, device: str, props: dict[str, Any]) -> str | None:
    """The element type the device plugin stores the KV cache in (``KV_CACHE_PRECISION``: the CPU
    plugin's default is ``u8`` with per-token scales on x86), or None when the plugin does not say."""
    value = props.get("KV_CACHE_PRECISION")
    try:
        value = value if value is not None else ov.Core().get_property(device, "KV_CACHE_PRECISION")
    except Exception:  # noqa: BLE001 - a plugin without the property
        return None
    # an openvino.Type prints as "<Type: 'uint8_t'>"; its type name is the element type ("u8")
    return str(value.get_type_name() if hasattr(value, "get_type_name") else value)


class OpenVinoEngine:
    """The :class:`backends._hosting.worker_server.WorkerEngine` of this worker.

    Args:
        model_dir: the IR folder (``adapters.openvino_export``).
        options: ``batching`` (continuous|pipeline), ``device`` (CPU), ``kv_cache_gib``,
            ``max_num_seqs``, ``enable_prefix_caching``, ``inference_precision`` (f32|bf16|f16 or None).
    """

    def __init__(self, model_dir: str, options: dict[str, Any]):
        import openvino as ov
        import openvino_genai as og

        self.og = og
        self.mode = options.get("batching") or "continuous"
        device = options.get("device") or "CPU"
        props: dict[str, Any] = {}
        if options.get("inference_precision"):
            props["INFERENCE_PRECISION_HINT"] = options["inference_precision"]
        self._info: dict[str, Any] = {"engine": "openvino-genai", "engine_version": og.__version__,
                                      "openvino_version": ov.get_version(), "device": device.lower(),
                                      "batching": self.mode, "properties": props}
        if self.mode == "continuous":
            sc = og.SchedulerConfig()
            sc.cache_size = int(options.get("kv_cache_gib") or 1)
            sc.max_num_seqs = int(options.get("max_num_seqs") or 64)
            sc.enable_prefix_caching = bool(options.get("enable_prefix_caching", True))
            self.pipe = og.ContinuousBatchingPipeline(model_dir, sc, device, props)
            self._info.update(scheduler=sc.to_string().strip(), kv_cache_gib=sc.cache_size,
                              max_num_seqs=sc.max_num_seqs, prefix_caching=sc.enable_prefix_caching,
                              kv_cache_precision=_kv_cache_precision(ov, device, props))
            self.pending: collections.deque = collections.deque()
            self.active: dict[int, tuple] = {}
            self.wake = threading.Condition()
            threading.Thread(target=self._drive, daemon=True).start()
        else:
            self.pipe = og.LLMPipeline(model_dir, device, **props)
            self.lock = threading.Lock()
        self.tokenizer = self.pipe.get_tokenizer()
        self.hf = None
        tj = os.path.join(model_dir, "tokenizer.json")
        if os.path.isfile(tj):
            from tokenizers import Tokenizer

            self.hf = Tokenizer.from_file(tj)
        self._info["detokenizer"] = "tokenizers.DecodeStream (tokenizer.json)" if self.hf else "openvino_genai.Tokenizer"
        self._info["logprobs"] = "chosen token only (GenerationConfig.logprobs supports 1)" \
            if self.mode == "continuous" else "none"
        self.ids = itertools.count()
        self.n_generated = 0
        self.max_running = 0

    def info(self) -> dict[str, Any]:
        return self._info

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {"generated_tokens": self.n_generated, "max_running_requests": self.max_running}
        if self.mode == "continuous":
            m = self.pipe.get_metrics()
            out.update(kv_cache_usage_perc=float(m.cache_usage), kv_cache_max_usage_perc=float(m.max_cache_usage),
                       kv_cache_size_bytes=float(m.cache_size_in_bytes))
        return out

    def tokenize(self, prompt: str) -> list[int]:
        """The ids the engine feeds the model for ``prompt`` (its own tokenizer IR, special tokens as generate adds)."""
        return [int(t) for t in self.tokenizer.encode(prompt).input_ids.data.reshape(-1)]

    def prompt_tokens(self, prompt: str) -> int:
        return len(self.tokenize(prompt))

    def _config(self, body: dict[str, Any], want_logprobs: bool):
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

    def _decoder(self):
        if self.hf is not None:
            from tokenizers.decoders import DecodeStream

            stream, hf = DecodeStream(skip_special_tokens=True), self.hf
            return lambda ids: "".join(stream.step(hf, t) or "" for t in ids)
        seen: list[int] = []
        state = {"text": ""}

        def decode(ids: list[int]) -> str:
            seen.extend(ids)
            text = self.tokenizer.decode(seen, skip_special_tokens=True)
            if text.endswith("\ufffd"):
                return ""
            delta, state["text"] = text[len(state["text"]):], text
            return delta
        return decode

    async def generate(self, body: dict[str, Any]):
        k = body.get("logprobs")
        want_lp = bool(k) and not isinstance(k, bool) and self.mode == "continuous"
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        put = lambda item: loop.call_soon_threadsafe(queue.put_nowait, item)  # noqa: E731
        cfg = self._config(body, want_lp)
        cancel = threading.Event()
        if self.mode == "continuous":
            rid = next(self.ids)
            with self.wake:
                self.pending.append((rid, body.get("prompt", ""), cfg, put, want_lp, cancel))
                self.wake.notify()
        else:
            threading.Thread(target=self._run_pipeline, args=(body.get("prompt", ""), cfg, put, cancel),
                             daemon=True).start()
        decode = self._decoder()
        n = 0
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                ids, lps, finish = item
                if ids:
                    n += len(ids)
                    self.n_generated += len(ids)
                    text = decode(ids)
                    if lps:
                        yield ids, text, None, [(lp, [(t, lp)]) for t, lp in zip(ids, lps)]
                    else:
                        yield ids, text, None
                if finish:
                    yield [], "", finish
                    return
        finally:
            cancel.set()

    # -- continuous batching --------------------------------------------------------------
    def _drive(self) -> None:
        """The one thread that adds requests to the pipeline and steps it."""
        og = self.og
        while True:
            with self.wake:
                while not self.pending and not self.active:
                    self.wake.wait()
                while self.pending:
                    rid, prompt, cfg, put, want_lp, cancel = self.pending.popleft()
                    try:
                        handle = self.pipe.add_request(rid, prompt, cfg)
                        self.active[rid] = (handle, put, want_lp, cancel, cfg.max_new_tokens, [0])
                    except Exception as exc:  # noqa: BLE001 - refused request: tell its client
                        put(RuntimeError(f"{type(exc).__name__}: {exc}"))
            self.max_running = max(self.max_running, len(self.active))
            try:
                for rid, (handle, put, _lp, cancel, _mx, _n) in list(self.active.items()):
                    if cancel.is_set():
                        handle.cancel()
                        del self.active[rid]
                if self.pipe.has_non_finished_requests():
                    self.pipe.step()
            except Exception as exc:  # noqa: BLE001 - the engine failed: every open request learns why
                traceback.print_exc()
                for handle, put, *_ in self.active.values():
                    put(RuntimeError(f"{type(exc).__name__}: {exc}"))
                self.active.clear()
                continue
            for rid, (handle, put, want_lp, _c, max_new, count) in list(self.active.items()):
                ids: list[int] = []
                lps: list[float] = []
                while handle.can_read():
                    for out in handle.read().values():
                        ids += [int(t) for t in out.generated_ids]
                        if want_lp:
                            lps += [float(x) for x in out.generated_log_probs]
                count[0] += len(ids)
                status = handle.get_status()
                finish = None
                if status == og.GenerationStatus.FINISHED:
                    finish = "length" if count[0] >= max_new else "stop"
                elif status in (og.GenerationStatus.IGNORED, og.GenerationStatus.CANCEL):
                    put((ids, lps, None)) if ids else None
                    put(RuntimeError(f"openvino_genai ended the request with status {status.name}"
                                     + (" (out of KV cache blocks)" if status == og.GenerationStatus.IGNORED else "")))
                    del self.active[rid]
                    continue
                if ids or finish:
                    put((ids, lps if want_lp else None, finish))
                if finish:
                    del self.active[rid]

    # -- LLMPipeline ----------------------------------------------------------------------
    def _run_pipeline(self, prompt: str, cfg, put, cancel: threading.Event) -> None:
        og = self.og
        count = [0]

        class Streamer(og.StreamerBase):
            def write(self, token):
                ids = [int(token)] if isinstance(token, int) else [int(t) for t in token]
                count[0] += len(ids)
                put((ids, None, None))
                return og.StreamingStatus.CANCEL if cancel.is_set() else og.StreamingStatus.RUNNING

            def end(self):
                pass

        try:
            with self.lock:
                self.max_running = 1
                self.pipe.generate(prompt, cfg, Streamer())
            put(([], None, "length" if count[0] >= cfg.max_new_tokens else "stop"))
        except Exception as exc:  # noqa: BLE001 - surfaced to the client as an error event
            put(RuntimeError(f"{type(exc).__name__}: {exc}"))


def main() -> None:
    from backends._hosting.worker_server import serve

    serve(lambda args: OpenVinoEngine(args.model, args.options))


if __name__ == "__main__":
    main()
