"""Requests that ask for logprobs, on the ORT GenAI engine process (split from engine.py).

``og.Engine`` gives no logits, so such requests run on ``og.Generator``, reading
``get_logits()`` before each ``generate_next_token``; their frames carry the logprobs (see
:mod:`backends.ort_genai.engine` for the frame kinds). Probes use them, never the timed path.

Greedy requests waiting together run as one ``og.Generator`` batch (:func:`take_batch`, at most
:data:`LOGPROBS_BATCH`): right-padded with the export's ``pad_token_id``, the layout og's own
``Tokenizer.encode_batch`` gives and og reads back (``src/models/position_inputs.cpp``: only a
row's trailing pads are masked and left out of its positions; ``src/models/logits.cpp``: each
row's logits come from its last non-pad token). 300 probes of SmolLM2-135M took 140 s one at a
time on the fp32 export (2-core host); a request whose prompt ends with the pad id, or that
samples, runs alone.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from backends.ort_genai.frames import TOKENIZE, Decoder, Out

LOGPROBS_BATCH = 16  # rows of one og.Generator batch; the probes' concurrency (evaluations/probing.py)


def _key(body: dict[str, Any]) -> tuple | None:
    """Requests with the same key can share a batch (greedy, same EOS rule); None: alone."""
    if float(body.get("temperature") or 0.0) > 0 or not body.get("logprobs"):
        return None
    return bool(body.get("ignore_eos")), int(body["logprobs"])


def take_batch(engine, first: tuple) -> list[tuple]:
    """``first`` (a logprobs request) with the compatible ones waiting in ``engine.inbox``;
    the others go back to the inbox, in their order (behind any that came meanwhile)."""
    items = [first]
    key = _key(first[1])
    if key is None or engine.paged:
        return items
    others = []
    while len(items) < LOGPROBS_BATCH and not engine.inbox.empty():
        item = engine.inbox.get()
        (items if TOKENIZE not in item[1] and _key(item[1]) == key else others).append(item)
    for item in others:
        engine.inbox.put(item)
    return items


def run_logprobs_batch(engine, items: list[tuple], send, batch) -> None:
    """``items`` (``(rid, body)`` logprobs requests from :func:`take_batch`) on og.Generator:
    one batch when there are several and no prompt ends with the pad id, else one at a time.
    Each generated token's frame carries its top-k log-probabilities, from ``get_logits()`` read
    before the ``generate_next_token`` that picks it. A failure fails the batch's unfinished requests."""
    reqs, ended = [], set()
    try:
        for rid, body in items:
            out = Out(send, rid, engine.stream_interval_s)
            reqs.append((rid, body, out, engine.encode(body.get("prompt", ""))))
            out.start(len(reqs[-1][3]))
            out.decoder = None if engine.tokenizer_json else Decoder(engine)
        alone = engine.pad_id is None or any(not r[3] or r[3][-1] == engine.pad_id for r in reqs)
        for group in ([[r] for r in reqs] if alone else [reqs]):
            _run(engine, group, batch, ended)
    except Exception as exc:  # noqa: BLE001 - their clients learn why
        for r in reqs:
            if id(r[2]) not in ended:
                r[2].fail(exc)
    for rid, _ in items:
        engine.cancelled.discard(rid)


def _run(engine, reqs: list[tuple], batch, ended: set) -> None:
    """One og.Generator over ``reqs`` (``(rid, body, out, prompt ids)``, greedy, one EOS rule)."""
    og, np = engine.og, engine.np
    body0, rows = reqs[0][1], len(reqs)
    width = max(len(r[3]) for r in reqs)
    max_new = [int(r[1].get("max_tokens") or 16) for r in reqs]
    k, ignore_eos = int(body0["logprobs"]), bool(body0.get("ignore_eos"))
    params = og.GeneratorParams(engine.model)
    opts = engine.search_options({**body0, "max_tokens": max(max_new)}, width)
    params.set_search_options(**opts, **({"batch_size": rows} if rows > 1 else {}))
    gen = og.Generator(engine.model, params)
    padded = [r[3] + [engine.pad_id] * (width - len(r[3])) for r in reqs] if rows > 1 else reqs[0][3]
    gen.append_tokens(np.asarray(padded, dtype=np.int32))
    n = [0] * rows
    live = list(range(rows))
    engine.logprobs_rows_max = max(getattr(engine, "logprobs_rows_max", 0), rows)

    def end(i: int, reason: str) -> None:
        reqs[i][2].finish(reason, engine.stats())
        ended.add(id(reqs[i][2]))

    while live and not gen.is_done():
        logits = np.asarray(gen.get_logits(), dtype=np.float64)
        logits = logits.reshape(rows, -1, logits.shape[-1])[:, -1]
        m = logits.max(axis=1, keepdims=True)
        logp = logits - (m + np.log(np.exp(logits - m).sum(axis=1, keepdims=True)))
        gen.generate_next_token()
        nxt, now = gen.get_next_tokens(), time.perf_counter()
        with batch():
            for i in list(live):
                if reqs[i][0] in engine.cancelled:
                    live.remove(i)
                    end(i, "abort")
                    continue
                token, row = int(nxt[i]), logp[i]
                top = np.argpartition(-row, k)[:k] if k < row.size else np.arange(row.size)
                top = top[np.argsort(-row[top], kind="stable")]
                reqs[i][2].send_ids(np.asarray([token], dtype=np.int32).tobytes(), now, True,
                                    [(float(row[token]), [(int(t), float(row[t])) for t in top])])
                n[i] += 1
                engine.decode_steps += 1
                eos = not ignore_eos and token in engine.eos_ids
                if eos or n[i] >= max_new[i]:
                    live.remove(i)
                    end(i, "stop" if eos else "length")
    del gen
    for i in live:  # og ended the row (its EOS, or max_length): as the lone loop did, "stop" before max_tokens
        end(i, "stop" if n[i] < max_new[i] else "length")


def run_with_logprobs(engine, rid: Any, body: dict[str, Any], out) -> None:
    """One request alone on og.Generator into ``out`` (the lone path of :func:`run_logprobs_batch`)."""
    ids = engine.encode(body.get("prompt", ""))
    out.start(len(ids))
    _run(engine, [(rid, body, out, ids)], contextlib.nullcontext, set())
