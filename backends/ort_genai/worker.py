"""Worker process: ONNX Runtime GenAI behind the OpenAI completions API.

Runs in the ``ort-genai`` environment (``adapters.ort_genai_export.env``). Two schedulers:

- ``generator``: one ``og.Generator`` per request, serialised by a lock (static batch of 1).
- ``engine``: ``og.Engine`` + ``og.Request`` (0.18.0: ``create_request``, ``begin_turn``
  with ``og.TurnOptions``, ``run(event_buffer)`` returning ``EngineEvent``s). It schedules
  several requests per step, also on CPU (checked on 0.18.0).

Run as ``python -m backends.ort_genai.worker --model EXPORT_DIR --port P --ready-file F
--options JSON`` (options: ``batching``, ``execution_provider``, ``source_model``,
``intra_op_num_threads``, ``stream_interval_ms``, ``max_batch_events``).
"""

from __future__ import annotations

import asyncio
import os
import queue
import threading
import time
from typing import Any


class _Decoder:
    """Incremental detokenizer: ``og.TokenizerStream`` or a cumulative ``tokenizers`` decode."""

    def __init__(self, owner: "OrtGenaiEngine"):
        self.owner = owner
        self.stream = owner.tokenizer.create_stream() if owner.og_tokenizer else None
        self.ids: list[int] = []
        self.text = ""

    def push(self, token: int) -> str:
        if token in self.owner.eos_ids:
            return ""
        if self.stream is not None:
            return self.stream.decode(token)
        self.ids.append(token)
        text = self.owner.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # incomplete multi-byte character: wait for more
            return ""
        delta, self.text = text[len(self.text):], text
        return delta


class OrtGenaiEngine:
    """``og.Model`` with a generator-per-request or an ``og.Engine`` scheduler.

    Args:
        model_dir: export folder (``genai_config.json``).
        options: ``batching`` (engine|generator), ``execution_provider`` (cpu|cuda|...),
            ``source_model`` (checkpoint folder, for the tokenizer fallback),
            ``intra_op_num_threads`` (decoder session threads; None: ORT's default),
            ``stream_interval_ms`` (least time between two SSE events of one stream; 0: none).
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
            import json as _json

            config.overlay(_json.dumps({"model": {"decoder": {"session_options": {
                "intra_op_num_threads": int(options["intra_op_num_threads"])}}}}))
        self.model = og.Model(config)
        self.notes: dict[str, str] = {}
        src = options.get("source_model") or model_dir
        reason = None
        try:
            self.tokenizer = og.Tokenizer(self.model)
            reason = self._tokenizer_disagreement(os.path.join(src, "tokenizer.json"))
        except Exception as exc:  # noqa: BLE001 - e.g. "Unsupported tokenizer class: Qwen3_5Tokenizer"
            reason = f"og.Tokenizer refused the export's tokenizer: {exc}"
        self.og_tokenizer = reason is None
        self.tokenizer_source = "og.Tokenizer (export folder)"
        if reason is not None:
            from tokenizers import Tokenizer

            self.tokenizer = Tokenizer.from_file(os.path.join(src, "tokenizer.json"))
            self.tokenizer_source = f"tokenizers ({src}/tokenizer.json)"
            self.notes["tokenizer_fallback"] = reason
        import json

        with open(os.path.join(model_dir, "genai_config.json")) as fh:
            gcfg = json.load(fh)["model"]
        eos = gcfg.get("eos_token_id")
        self.eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        self.context_length = int(gcfg.get("context_length") or 0) or None
        self.batching = options.get("batching") or "engine"
        auto_batching = not options.get("batching")
        self.stream_interval_s = float(options.get("stream_interval_ms") or 0) / 1000
        self.lock = threading.Lock()
        self.n_generated = 0
        self.n_requests = 0
        self.max_running = 0
        self.engine = None
        self.engine_error: BaseException | None = None
        self.engine_seeds = True
        if self.batching == "engine":
            # og.Engine operations must run on the thread that created it (0.18.0 raises
            # "Engine operations must be called from the Engine owner thread").
            self.inbox: queue.SimpleQueue = queue.SimpleQueue()
            self.wake = threading.Event()
            created = threading.Event()
            threading.Thread(target=self._engine_thread, args=(created,), daemon=True, name="og-engine").start()
            created.wait()
            if self.engine_error is not None:
                raise self.engine_error
            if auto_batching:
                self._warm_up_engine()
        self._info = {
            "engine": "onnxruntime-genai", "engine_version": og.__version__, "device": ep,
            "max_model_len": self.context_length, "batching": self.batching,
            "tokenizer": self.tokenizer_source, "notes": self.notes,
            "intra_op_num_threads": options.get("intra_op_num_threads") or "ORT default",
            "stream_interval_ms": self.stream_interval_s * 1000,
        }
        if self.engine is not None:
            self._info["engine_max_batch_size"] = self._caps

    PROBE_TEXTS = ("count: 15 16 17 18", "copy: hgd hcd =>", "Hello, world! 123", "a=1; b=2\nc")

    def _tokenizer_disagreement(self, hf_path: str) -> str | None:
        """Why og.Tokenizer cannot be trusted, or None: it must encode like the checkpoint's tokenizer.json.

        Seen on 0.18.0: a character-level BPE ``tokenizer.json`` without pre-tokenizer encodes
        " " to id -1 in og.Tokenizer while ``tokenizers`` gives its vocabulary id.
        """
        if not os.path.isfile(hf_path):
            return None
        from tokenizers import Tokenizer

        hf = Tokenizer.from_file(hf_path)
        for text in self.PROBE_TEXTS:
            a = [int(t) for t in self.tokenizer.encode(text)]
            b = list(hf.encode(text).ids)
            if a != b:
                return f"og.Tokenizer encodes {text!r} as {a[:16]} but tokenizer.json as {b[:16]}"
        return None

    # -- WorkerEngine protocol -----------------------------------------------------------
    def info(self) -> dict[str, Any]:
        return self._info

    def metrics(self) -> dict[str, float]:
        return {"generated_tokens": self.n_generated, "requests": self.n_requests,
                "max_running_requests": self.max_running, "engine_seeds_honoured": int(self.engine_seeds)}

    def encode(self, prompt: str) -> list[int]:
        if self.og_tokenizer:
            return [int(t) for t in self.tokenizer.encode(prompt)]
        return list(self.tokenizer.encode(prompt).ids)

    def prompt_tokens(self, prompt: str) -> int:
        return len(self.encode(prompt))

    async def generate(self, body: dict[str, Any]):
        from bakeoff.worker_server import TokenChannel

        chan = TokenChannel(asyncio.get_running_loop())
        put = chan.put
        self.n_requests += 1
        if self.engine is not None:
            if self.engine_error is not None:
                raise RuntimeError(f"og.Engine thread died: {self.engine_error!r}")
            self.inbox.put((body, put))
            self.wake.set()
        else:
            threading.Thread(target=self._run_generator, args=(body, put), daemon=True).start()
        last_write = None
        while True:
            # Tokens that arrived while the previous event was being written go out as one
            # SSE event, token_ids listing each token (the engine outruns HTTP on tiny models;
            # counts stay exact, timestamps are delivery times). With stream_interval_ms, events
            # of one stream are at least that far apart: the engine thread shares the GIL with
            # this loop, and every wake of the loop takes it from the engine.
            if self.stream_interval_s and last_write is not None:
                wait = self.stream_interval_s - (time.monotonic() - last_write)
                if wait > 0:
                    await asyncio.sleep(wait)
            ids: list[int] = []
            text = ""
            for item in await chan.get_batch():
                if isinstance(item, BaseException):
                    if ids:  # what was generated before the failure still goes out
                        yield (ids, text, None)
                    raise item
                if item is None:
                    if ids:
                        yield (ids, text, None)
                    return
                if item[2] is not None:  # the finish marker: flush tokens first
                    if ids:
                        yield (ids, text, None)
                        ids, text = [], ""
                    yield item
                    continue
                ids += item[0]
                text += item[1]
            if ids:
                yield (ids, text, None)
                last_write = time.monotonic()

    def _warm_up_engine(self, timeout_s: float = 300) -> None:
        """One 1-token request through og.Engine; when it fails, serve with og.Generator.

        og 0.18.0's Engine (static batching on CPU) feeds 2-D ``position_ids`` to graphs
        that declare MRoPE's 3-D ones (Qwen3.5-MoE exports) and fails every request, while
        og.Generator runs the same export. Only when the user left ``batching`` unset.
        """
        got: queue.SimpleQueue = queue.SimpleQueue()
        self.inbox.put(({"prompt": "hello", "max_tokens": 1}, got.put))
        self.wake.set()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                item = got.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if item is None:
                return
            if isinstance(item, BaseException):
                self.notes["batching_fallback"] = (
                    f"og.Engine failed a 1-token warm-up ({item}; the engine's own words are in the worker log); "
                    "serving with og.Generator, one request at a time")
                self.engine_error = item  # the engine thread is unhealthy: nothing more goes to it
                self.engine = None
                self.batching = "generator"
                return
        self.notes["engine_warmup"] = f"og.Engine warm-up gave no answer in {timeout_s:.0f} s"

    # -- generator scheduler -------------------------------------------------------------
    def _run_generator(self, body: dict[str, Any], put) -> None:
        og = self.og
        try:
            ids = self.encode(body.get("prompt", ""))
            max_new = int(body.get("max_tokens") or 16)
            params = og.GeneratorParams(self.model)
            opts: dict[str, Any] = {"max_length": len(ids) + max_new}
            temperature = float(body.get("temperature") or 0.0)
            if temperature > 0:
                opts.update(do_sample=True, temperature=temperature, top_p=float(body.get("top_p") or 1.0), top_k=0)
                if body.get("seed") is not None:
                    opts["random_seed"] = int(body["seed"])
            else:
                opts.update(do_sample=False)
            if body.get("ignore_eos"):
                opts["min_length"] = len(ids) + max_new
            params.set_search_options(**opts)
            dec = _Decoder(self)
            n = 0
            with self.lock:
                gen = og.Generator(self.model, params)
                gen.append_tokens(ids)
                while not gen.is_done() and n < max_new:
                    gen.generate_next_token()
                    tok = int(gen.get_next_tokens()[0])
                    n += 1
                    put(([tok], dec.push(tok), None))
                eos = n < max_new or (not body.get("ignore_eos") and tok in self.eos_ids)
                del gen
            self.n_generated += n
            put(([], "", "stop" if eos else "length"))
            put(None)
        except BaseException as exc:  # surfaced to the client as an error event
            put(exc)

    # -- engine scheduler ----------------------------------------------------------------
    def _begin(self, body: dict[str, Any], put, live: dict) -> None:
        og = self.og
        ids = self.encode(body.get("prompt", ""))
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
            req.begin_turn(self.np.asarray(ids, dtype=self.np.int32), to)
        except RuntimeError as exc:
            if "seed" not in str(exc) or not self.engine_seeds:
                raise
            # 0.18.0: "A per-turn seed requires an Engine configured for dynamic batching"
            # (paged attention, CUDA only): sample unseeded and say so.
            self.engine_seeds = False
            self.notes["engine_seed"] = f"per-request seeds ignored: {exc}"
            to.clear_seed()
            req.begin_turn(self.np.asarray(ids, dtype=self.np.int32), to)
        live[id(req)] = (req, put, _Decoder(self), [0])

    def _engine_thread(self, created: threading.Event) -> None:
        try:
            self.engine = self.og.Engine(self.model)
            self._caps = self.engine.get_capabilities().configured_max_batch_size
            buf = self.engine.create_event_buffer(256)
        except BaseException as exc:  # noqa: BLE001 - reported by __init__
            self.engine_error = exc
            created.set()
            return
        created.set()
        live: dict[int, tuple] = {}
        try:
            self._engine_loop(buf, live)
        except BaseException as exc:  # noqa: BLE001 - fail what runs, refuse what comes
            self.engine_error = exc
            for _req, put, _d, _n in live.values():
                put(RuntimeError(f"og.Engine thread died: {exc!r}"))

    def _engine_loop(self, buf, live: dict) -> None:
        og = self.og
        token_flag = int(og.EngineEventFlags.TOKEN.value)
        failed_flag = int(og.EngineEventFlags.FAILED.value)
        finish_map = {og.FinishReason.EOS: "stop", og.FinishReason.STOP_STRING: "stop",
                      og.FinishReason.MAX_GENERATED_TOKENS: "length", og.FinishReason.MAX_SESSION_TOKENS: "length",
                      og.FinishReason.CANCELLED: "abort"}
        while True:
            if not live:
                self.wake.wait()
                self.wake.clear()
            while True:
                try:
                    body, put = self.inbox.get_nowait()
                except queue.Empty:
                    break
                try:
                    self._begin(body, put, live)
                except BaseException as exc:  # noqa: BLE001 - one bad request, not the engine
                    put(exc)
            if not live:
                continue
            self.max_running = max(self.max_running, len(live))
            try:
                events = self.engine.run(buf)
            except BaseException as exc:  # noqa: BLE001 - fail every running request
                for req, put, _d, _n in live.values():
                    put(RuntimeError(f"og.Engine.run failed: {exc}"))
                live.clear()
                continue
            for ev in events or ():
                entry = live.get(id(ev.request))
                if entry is None:
                    continue
                req, put, dec, count = entry
                flags = int(ev.flags.value)
                if flags & token_flag:
                    tok = int(ev.token)
                    count[0] += 1
                    self.n_generated += 1
                    put(([tok], dec.push(tok), None))
                if flags & failed_flag:
                    put(RuntimeError(f"og.Engine request failed: error_code={ev.error_code}"))
                    live.pop(id(ev.request), None)
                elif ev.finish_reason != og.FinishReason.NONE:
                    put(([], "", finish_map.get(ev.finish_reason, str(ev.finish_reason.name).lower())))
                    put(None)
                    live.pop(id(ev.request), None)
                    req.close()


def main() -> None:
    from bakeoff.worker_server import serve

    serve(lambda args: OrtGenaiEngine(args.model, args.options))


if __name__ == "__main__":
    main()
