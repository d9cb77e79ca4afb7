"""Requests that ask for logprobs, on the ORT GenAI engine process (split from engine.py).

``og.Engine`` gives no logits, so such a request runs alone on ``og.Generator``, reading
``get_logits()`` before each ``generate_next_token``; its frames carry the logprobs (see
:mod:`backends.ort_genai.engine` for the frame kinds). Probes use it, never the timed path.
"""

from __future__ import annotations

import time
from typing import Any

from backends.ort_genai.frames import Decoder


def run_with_logprobs(engine,  # an OrtGenaiEngine
                       rid: Any, body: dict[str, Any], out) -> None:
    """One request on ``og.Generator`` that also reports the top-k log-probabilities of
    each generated token, from ``get_logits()`` read before each ``generate_next_token``
    (the distribution the token is chosen from). Not the timed path: probes only."""
    og, np = engine.og, engine.np
    k = int(body["logprobs"])
    ids = engine.encode(body.get("prompt", ""))
    out.start(len(ids))
    max_new = int(body.get("max_tokens") or 16)
    params = og.GeneratorParams(engine.model)
    params.set_search_options(**engine.search_options(body, len(ids)))
    out.decoder = None if engine.tokenizer_json else Decoder(engine)
    gen = og.Generator(engine.model, params)
    gen.append_tokens(ids)
    n = 0
    while not gen.is_done() and n < max_new and rid not in engine.cancelled:
        logits = np.asarray(gen.get_logits(), dtype=np.float64)
        row = logits.reshape(-1, logits.shape[-1])[-1]
        m = row.max()
        logp = row - (m + np.log(np.exp(row - m).sum()))
        gen.generate_next_token()
        token = int(gen.get_next_tokens()[0])
        top = np.argsort(-logp)[:k]
        out.send_ids(np.asarray([token], dtype=np.int32).tobytes(), time.perf_counter(), True,
                     [(float(logp[token]), [(int(i), float(logp[i])) for i in top])])
        n += 1
    del gen
    engine.decode_steps += n
    if rid in engine.cancelled:
        out.finish("abort", engine.stats())
        return
    eos = n < max_new or (not body.get("ignore_eos") and out.last_id in engine.eos_ids)
    out.finish("stop" if eos else "length", engine.stats())
