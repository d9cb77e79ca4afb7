"""Logprobs of a ``PagedAttention`` export: its own graph in an ONNX Runtime session.

``og.Engine`` (the only og API that feeds a paged decoder) gives no logits, and
``og.Generator`` cannot feed it (2-D ``input_ids``; the paged decoder takes 1-D packed ids:
"Invalid rank for input: input_ids Got: 2 Expected: 1"). A request that asks for logprobs on
such an export therefore runs, alone, through the same ONNX file in an
``onnxruntime.InferenceSession`` on the export's execution provider: one prefill step, then one
step per token, each fed what the graph declares
(:func:`adapters.ort_genai_export._graph_io.step_feeds`: one sequence in its own blocks; the
paged caches live on the device, bound as both ``past_key_values.*`` input and ``present.*``
output, since ``PagedAttention`` updates them in place, :func:`~adapters.ort_genai_export._graph_io.run_in_place`). Probes use it,
never the timed path. The loop is layout-agnostic: on a standard export it matches
``og.Generator``'s tokens and logprobs (``tests/test_ort_genai.py``), which is how it is
checked on a host without CUDA, where no ``PagedAttention`` kernel exists.

The session is made at the first such request and kept (a second copy of the weights on the
device, beside og's).
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any

from adapters.ort_genai_export import _graph_io
from backends.ort_genai.frames import Decoder

PROVIDERS = {"cuda": "CUDAExecutionProvider", "webgpu": "WebGpuExecutionProvider", "dml": "DmlExecutionProvider",
             "NvTensorRtRtx": "NvTensorRTRTXExecutionProvider"}


class GraphSession:
    """The export's decoder graph in an ONNX Runtime session, stepped one sequence at a time.

    Args:
        model_dir: export folder (``genai_config.json`` and its ``filename``).
        execution_provider: bakeoff's name (``cpu``, ``cuda``, ...).
        threads: intra-op threads (None: ORT's default).
    """

    def __init__(self, model_dir: str, execution_provider: str = "cpu", threads: int | None = None):
        import numpy as np
        import onnxruntime as ort

        self.np = np
        with open(os.path.join(model_dir, "genai_config.json")) as fh:
            cfg = json.load(fh)
        decoder = cfg["model"]["decoder"]
        self.layout = _graph_io.layout(cfg)
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        if threads:
            opts.intra_op_num_threads = int(threads)
        providers = ["CPUExecutionProvider"]
        if execution_provider in PROVIDERS:
            providers.insert(0, PROVIDERS[execution_provider])
        self.sess = ort.InferenceSession(os.path.join(model_dir, decoder.get("filename", "model.onnx")), opts,
                                         providers=providers)
        self.inputs = self.sess.get_inputs()
        self.ort = ort
        self.kv = _graph_io.kv_pairs(cfg, {i.name for i in self.inputs}, {o.name for o in self.sess.get_outputs()})
        self.logits = (decoder.get("outputs") or {}).get("logits", "logits")
        self.head_size = decoder.get("head_size")
        self.device = "cuda" if "CUDAExecutionProvider" in self.sess.get_providers() else "cpu"

    def named(self, total_tokens: int) -> dict[str, int]:
        """Sizes of named dimensions for one sequence of ``total_tokens``."""
        if self.layout["paged"]:
            return _graph_io.paged_named(self.layout, total_tokens)
        return {"head_size": self.head_size, "kv_cache_dim": self.head_size} if self.head_size else {}

    def step(self, tokens: list[int], past: int, named: dict[str, int], caches: dict | None):
        """One step: ``(last position's logits as float64, the caches for the next step)``."""
        np = self.np
        feeds = _graph_io.step_feeds(self.inputs, np, tokens, past, named, caches)
        if self.layout["paged"]:  # caches stay on the device, updated in place by PagedAttention
            logits, caches = _graph_io.run_in_place(self.sess, self.ort, feeds, self.logits, self.kv, self.device,
                                                    caches)
        else:  # a standard graph's present is the past grown by the step
            names = [self.logits, *self.kv]
            got = self.sess.run(names, feeds)
            logits, caches = got[0], {self.kv[n]: v for n, v in zip(names[1:], got[1:])}
        row = np.asarray(logits, dtype=np.float64)
        return row.reshape(-1, row.shape[-1])[-1], caches


def choose(np, row, body: dict[str, Any], rng, forbid: set[int]) -> int:
    """The next token as og's search picks it: argmax, or a sample at ``temperature`` within
    ``top_p``; ``forbid`` (EOS under ``ignore_eos``, og's ``min_length``) never chosen."""
    scores = row.copy()
    for t in forbid:
        if 0 <= t < scores.size:
            scores[t] = -math.inf
    temperature = float(body.get("temperature") or 0.0)
    if temperature <= 0:
        return int(np.argmax(scores))
    z = scores / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p)
    keep = order[: int(np.searchsorted(np.cumsum(p[order]), float(body.get("top_p") or 1.0))) + 1]
    q = p[keep] / p[keep].sum()
    return int(keep[rng.choice(len(keep), p=q)])


def run_paged_with_logprobs(engine, rid: Any, body: dict[str, Any], out) -> None:
    """One request through :class:`GraphSession`, each token with its top-k log-probabilities
    (of the raw logits it was chosen from, as :mod:`backends.ort_genai.generator_batch` reports them).

    Args:
        engine: the engine process (``OrtGenaiEngine``); its ``paged_logits`` session is made
            here on first use.
        rid: request id.
        body: the completions request (``prompt``, ``max_tokens``, ``logprobs``, ...).
        out: the request's frame writer.
    """
    np = engine.np
    if engine.paged_logits is None:
        engine.paged_logits = GraphSession(engine.model_dir, engine.ep, engine.options.get("intra_op_num_threads"))
    g = engine.paged_logits
    k = int(body["logprobs"])
    ids = engine.encode(body.get("prompt", ""))
    out.start(len(ids))
    max_new = int(body.get("max_tokens") or 16)
    out.decoder = None if engine.tokenizer_json else Decoder(engine)
    rng = np.random.default_rng(body.get("seed"))
    named = g.named(len(ids) + max_new)
    row, caches = g.step(ids, 0, named, None)
    n, past, token = 0, len(ids), None
    while n < max_new and rid not in engine.cancelled:
        if n:
            row, caches = g.step([token], past, named, caches)
            past += 1
        m = row.max()
        logp = row - (m + np.log(np.exp(row - m).sum()))
        token = choose(np, row, body, rng, engine.eos_ids if body.get("ignore_eos") else set())
        top = np.argsort(-logp)[:k]
        out.send_ids(np.asarray([token], dtype=np.int32).tobytes(), time.perf_counter(), True,
                     [(float(logp[token]), [(int(i), float(logp[i])) for i in top])])
        n += 1
        if token in engine.eos_ids and not body.get("ignore_eos"):
            break
    engine.decode_steps += n
    if rid in engine.cancelled:
        out.finish("abort", engine.stats())
        return
    out.finish("stop" if n < max_new or (token in engine.eos_ids and not body.get("ignore_eos")) else "length",
               engine.stats())
