"""Worker process: transformers ``generate`` behind the OpenAI completions API.

Runs in bakeoff's own environment (torch + transformers). By default one generation at a
time: the reference is for correctness; its throughput is measured and reported as what it
is. With ``batching=continuous`` concurrent requests share transformers' continuous batching
manager (:mod:`backends.transformers.batching`), the serving-style mode.
Run as ``python -m backends.transformers.worker --model M --port P --ready-file F``.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any


class TransformersEngine:
    """``generate`` with a token streamer, serialised by a lock.

    Args:
        model_path: checkpoint folder or hub id.
        options: ``device`` (auto|cpu|cuda), ``dtype`` (auto|float32|bfloat16|float16),
            ``trust_remote_code`` (bool, default False).
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
        self.lock = threading.Lock()
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
        }
        self.n_generated = 0
        self.batcher = None
        if options.get("batching") == "continuous":
            from backends.transformers.batching import start_batcher

            self.batcher, reason = start_batcher(self, options)
            if self.batcher is not None:
                self._info.update(self.batcher.info())
            else:
                self._info["batching_fallback"] = reason

    def info(self) -> dict[str, Any]:
        return self._info

    def metrics(self) -> dict[str, float]:
        return {"generated_tokens": self.n_generated}

    def prompt_tokens(self, prompt: str) -> int:
        return len(self.tokenize(prompt))

    def tokenize(self, prompt: str) -> list[int]:
        """The ids ``generate`` gets for ``prompt`` (both batching modes): this worker's
        tokenizer with the special tokens it adds by default (a BOS where the checkpoint's
        tokenizer adds one)."""
        return self.tokenizer(prompt)["input_ids"]

    def score(self, body: dict[str, Any]) -> dict[str, Any]:
        """Teacher-forced log-probabilities of a continuation after a prompt (the judge's scorer).

        Args:
            body: ``prompt`` (text), ``continuation_ids`` (token ids) or ``continuation``
                (text, tokenized here without special tokens), ``top_k`` (default 0).

        Returns:
            ``{"token_ids", "logprobs": [logprob of each token], "top_logprobs": [[[id,
            logprob], ...] per token]}``, in this model's float32 log-softmax.
        """
        torch, tok = self.torch, self.tokenizer
        k = int(body.get("top_k") or 0)
        with self.lock:
            p = tok(body.get("prompt") or "")["input_ids"]
            c = body.get("continuation_ids")
            c = [int(t) for t in c] if c is not None else tok(body.get("continuation") or "", add_special_tokens=False)["input_ids"]
            if not p or not c:
                return {"token_ids": c, "logprobs": [], "top_logprobs": []}
            x = torch.tensor([p + c], device=self.device)
            with torch.inference_mode():
                logits = self.model(input_ids=x).logits[0, len(p) - 1:len(p) + len(c) - 1].float()
            logp = torch.log_softmax(logits, dim=-1)
            chosen = logp[torch.arange(len(c), device=logp.device), torch.tensor(c, device=logp.device)].tolist()
            top: list = []
            if k:
                vals, idx = logp.topk(k, dim=-1)
                top = [list(zip(i, v)) for i, v in zip(idx.tolist(), vals.tolist())]
        return {"token_ids": c, "logprobs": chosen, "top_logprobs": top}

    async def generate(self, body: dict[str, Any]):
        if self.batcher is not None:
            async for item in self.batcher.generate(body):
                yield item
            return
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        thread = threading.Thread(target=self._run, args=(body, loop, queue), daemon=True)
        thread.start()
        while True:
            item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            if item is None:
                break
            yield item

    def _run(self, body: dict[str, Any], loop, queue) -> None:
        from transformers.generation.streamers import BaseStreamer

        torch = self.torch
        tok = self.tokenizer
        max_new = int(body.get("max_tokens") or 16)
        temperature = float(body.get("temperature") or 0.0)
        top_k = int(body.get("logprobs") or 0) if not isinstance(body.get("logprobs"), bool) else 0
        put = lambda item: loop.call_soon_threadsafe(queue.put_nowait, item)  # noqa: E731
        steps: list = []  # log-softmax of each step's logits, when logprobs are asked for

        class Streamer(BaseStreamer):
            def __init__(self):
                self.first = True
                self.ids: list[int] = []
                self.text = ""

            def put(self, value):
                if self.first:  # generate() first passes the prompt
                    self.first = False
                    return
                new = [int(x) for x in value.reshape(-1).tolist()]
                self.ids.extend(new)
                text = tok.decode(self.ids, skip_special_tokens=True)
                if text.endswith("\ufffd"):  # incomplete multi-byte character: wait for more
                    delta = ""
                else:
                    delta, self.text = text[len(self.text):], text
                if top_k and steps:
                    lps = [top_logprobs(steps.pop(0), t, top_k) for t in new]
                    put((new, delta, None, lps))
                else:
                    put((new, delta, None))

            def end(self):
                pass

        try:
            with self.lock:
                enc = tok(body.get("prompt", ""), return_tensors="pt").to(self.device)
                kwargs: dict[str, Any] = {"max_new_tokens": max_new, "pad_token_id": tok.pad_token_id or tok.eos_token_id}
                if temperature > 0:
                    kwargs.update(do_sample=True, temperature=temperature, top_p=float(body.get("top_p") or 1.0))
                    if body.get("seed") is not None:
                        torch.manual_seed(int(body["seed"]))
                else:
                    kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
                if body.get("ignore_eos"):
                    kwargs["min_new_tokens"] = max_new
                if top_k:
                    from transformers import LogitsProcessor, LogitsProcessorList

                    class Record(LogitsProcessor):  # sees the scores greedy search picks from
                        def __call__(self, input_ids, scores):
                            steps.append(torch.log_softmax(scores[0].float(), dim=-1))
                            return scores

                    kwargs["logits_processor"] = LogitsProcessorList([Record()])
                streamer = Streamer()
                with torch.inference_mode():
                    self.model.generate(**enc, streamer=streamer, **kwargs)
                self.n_generated += len(streamer.ids)
                finish = "length" if len(streamer.ids) >= max_new else "stop"
            put(([], "", finish))
            put(None)
        except BaseException as exc:  # surfaced to the client as an error event
            put(exc)


def top_logprobs(logp, token: int, k: int) -> tuple[float, list[tuple[int, float]]]:
    """``(logprob of token, [(id, logprob)] of the k most likely)`` from one step's log-softmax."""
    vals, idx = logp.topk(k)
    return float(logp[token]), list(zip(idx.tolist(), vals.tolist()))


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


def main() -> None:
    from backends._hosting.worker_server import serve

    serve(lambda args: TransformersEngine(args.model, args.options))


if __name__ == "__main__":
    main()
