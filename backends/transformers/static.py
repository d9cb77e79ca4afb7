"""Static batching for the transformers engine loop (``batching=static``, optimum-ort's default, and
the probes of ``batching=continuous``: greedy requests with logprobs, with the manager paused).

``ORTModelForCausalLM`` (optimum-onnx) has no continuous batching; its way to serve several
prompts at once is one ``generate`` over a left-padded batch. When the loop takes a greedy request,
the greedy requests already waiting (same ``ignore_eos``) join it, up to ``max_batch_size``; the
batch runs to its longest request's end (a request that arrives later waits, as in any static
batching server), each row's tokens streamed to its own client and each row stopped at its own
end (its ``max_tokens``, its EOS, a cancel). Requests that sample run alone; greedy requests that
ask for the same number of top logprobs share a batch, each row's top-k read from the step's scores
greedy search picks from (as the one-at-a-time path reads them), so the reference's 300 probes need
not run one by one.

A wave of concurrent sessions reaches the engine spread over a few milliseconds (each request
goes through the HTTP side), so the first arrival would start a batch of its own and the rest of
its wave would wait for the whole of it: one extra batch per burst, 5 waves where 4 would do at
8 sessions x 4 requests (measured: 4-7 batches for 32 requests). So a batch whose rows have each
generated at most :data:`RESTART_TOKENS` tokens when compatible requests arrive stops and starts
again with them, its rows continuing from their prompt plus what they generated (greedy: the same
next tokens); one session never restarts anything.
"""

from __future__ import annotations

import array
import collections
import time
from dataclasses import dataclass, field
from typing import Any

from backends._hosting.engine_frames import Out

# generate()'s arguments for a greedy request, over the checkpoint's generation_config.json: its sampling
# fields off, and the fields that change a greedy choice neutral (a repetition penalty or an n-gram ban
# stored with a checkpoint would otherwise apply at temperature 0, in the reference too)
GREEDY_KWARGS = {"do_sample": False, "temperature": None, "top_p": None, "top_k": None,
                 "repetition_penalty": 1.0, "no_repeat_ngram_size": 0}
from backends.transformers.logprobs import top_logprobs

RESTART_TOKENS = 4  # a batch whose rows are this young restarts to take in newcomers


def batch_key(body: dict[str, Any]) -> tuple | None:
    """Requests with the same key can share a batch (``(ignore_eos, top-k logprobs)``); None: this
    one runs alone."""
    if float(body.get("temperature") or 0.0) > 0:
        return None
    lp = body.get("logprobs")
    return (bool(body.get("ignore_eos")), 0 if isinstance(lp, bool) else int(lp or 0))


@dataclass
class Row:
    """One request of a static batch: its prompt ids, what it generated, its frames."""

    rid: Any
    max_new: int
    ids: list[int]
    out: Out
    gen: list[int] = field(default_factory=list)
    done: bool = False


def new_row(engine, msg: tuple, send) -> Row:
    """A gen command as a row (its ``start`` frame sent)."""
    body = msg[2]
    out = Out(send, msg[1], engine.interval_s)
    ids = engine.encode(body.get("prompt", ""))
    out.start(len(ids))
    return Row(msg[1], int(body.get("max_tokens") or 16), ids, out)


def cancelled_in(waiting: collections.deque, rid) -> bool:
    """Whether a cancel of request ``rid`` waits in ``waiting`` (removed if so): a cancel that came in the
    same read as its request, or before it ran, drops the request (as a cancel of a waiting request does)."""
    for msg in waiting:
        if msg[0] == "cancel" and msg[1] == rid:
            waiting.remove(msg)
            return True
    return False


def take_compatible(key: tuple, waiting: collections.deque, room: int) -> list[tuple]:
    """Up to ``room`` waiting gen commands with batch key ``key``, removed from ``waiting`` (those
    cancelled meanwhile dropped with their cancel)."""
    got = []
    for msg in list(waiting):
        if len(got) >= room:
            break
        if msg[0] == "gen" and batch_key(msg[2]) == key:
            waiting.remove(msg)
            if not cancelled_in(waiting, msg[1]):
                got.append(msg)
    return got


def serve_static(engine, first: tuple, chan, waiting: collections.deque) -> None:
    """``first`` (a greedy gen command) and the compatible requests waiting, batch after restarted batch."""
    key = batch_key(first[2])
    waiting.extend(chan.poll())
    lead = [] if cancelled_in(waiting, first[1]) else [first]
    msgs = lead + take_compatible(key, waiting, engine.max_batch - len(lead))
    rows = [new_row(engine, m, chan.send) for m in msgs]
    engine.batched_requests += len(rows)  # each request once, however many restarts it rides through
    while rows:
        rows = generate_batch(engine, rows, key, chan, waiting)
        if rows:  # restarted: the newcomers join
            engine.restarts += 1
            joined = [new_row(engine, m, chan.send) for m in take_compatible(key, waiting, engine.max_batch - len(rows))]
            engine.batched_requests += len(joined)
            rows += joined


def _pad_and_eos(tok) -> tuple[Any, list[int]]:
    """The pad id (the EOS id where the tokenizer has none) and the EOS ids, sorted."""
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    eos = tok.eos_token_id
    return pad, sorted(set(eos if isinstance(eos, list) else [eos] if eos is not None else []))


def _left_padded(torch, rows: list[Row], pad, device) -> tuple[Any, Any]:
    """Each row's prompt and generated ids, left-padded to the longest, and their attention mask."""
    seqs = [r.ids + r.gen for r in rows]
    width = max(len(s) for s in seqs)
    input_ids = torch.tensor([[pad] * (width - len(s)) + s for s in seqs], device=device)
    mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in seqs], device=device)
    return input_ids, mask


def _fail_rows(rows: list[Row], exc: BaseException) -> None:
    """Every row not yet ended fails with the engine's exception (each row's client learns why)."""
    for r in rows:
        if not r.done:
            r.done = True
            r.out.fail(exc)


def _after_batch(rows: list[Row], restart: bool, end_row) -> list[Row]:
    """The open rows when the batch stopped for newcomers; else each open row ends as ``stop``
    (generate ended it at its EOS without the streamer seeing its end) and none continues."""
    live = [r for r in rows if not r.done]
    if restart and live:
        return live
    for r in live:
        end_row(r, "stop")
    return []


def generate_batch(engine, rows: list[Row], key: tuple, chan, waiting: collections.deque) -> list[Row]:
    """One left-padded ``generate`` over ``rows`` (their :func:`batch_key` ``key``), each streamed as
    its own request.

    Returns:
        The rows to continue when the batch stopped early for newcomers (module docstring), else [].
    """
    from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList
    from transformers.generation.streamers import BaseStreamer

    torch, tok = engine.torch, engine.tokenizer
    rids = [r.rid for r in rows]
    pad, eos_ids = _pad_and_eos(tok)
    state = {"first": True, "restart": False}
    clock = time.perf_counter
    batch = chan.batch  # ChildPipe.batch
    ignore_eos, top_k = key
    steps: list = []  # log-softmax of each step's scores (the whole batch), when logprobs are asked for

    def end_row(r: Row, reason: str) -> None:
        r.done = True
        engine.n_generated += len(r.gen)
        r.out.finish(reason, engine.stats())

    class Streamer(BaseStreamer):
        def put(self, value):
            if state["first"]:  # generate() first passes the prompts
                state["first"] = False
                return
            now = clock()
            logp = steps.pop(0) if top_k and steps else None
            with batch():  # the step's frames for every row: one write, one doorbell
                for i, (r, t) in enumerate(zip(rows, value.reshape(-1).tolist())):
                    if r.done:
                        continue
                    r.gen.append(int(t))
                    if logp is not None:
                        r.out.send_ids(array.array("i", [int(t)]).tobytes(), now, True,
                                       [top_logprobs(logp[i], int(t), top_k)])
                    else:
                        r.out.pending.append(int(t))
                        r.out.due(now)
                    if len(r.gen) >= r.max_new:
                        end_row(r, "length")
                    elif not ignore_eos and t in eos_ids:
                        end_row(r, "stop")
            for msg in chan.poll():
                if msg[0] == "cancel" and msg[1] in rids:
                    r = rows[rids.index(msg[1])]
                    if not r.done:
                        end_row(r, "abort")
                elif msg[0] == "cancel":
                    for m in [m for m in waiting if m[1] == msg[1]]:
                        waiting.remove(m)
                else:
                    waiting.append(msg)
            live = [r for r in rows if not r.done]
            if (live and len(live) < engine.max_batch and all(len(r.gen) <= RESTART_TOKENS for r in live)
                    and any(m[0] == "gen" and batch_key(m[2]) == key for m in waiting)):
                state["restart"] = True

        def end(self):
            pass

    class RowsDone(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            if state["restart"]:
                return torch.ones(len(rows), dtype=torch.bool, device=input_ids.device)
            return torch.tensor([r.done for r in rows], dtype=torch.bool, device=input_ids.device)

    class NoEosYet(LogitsProcessor):  # ignore_eos: a row's EOS is suppressed until its own max_tokens
        def __call__(self, input_ids, scores):
            scores[:, eos_ids] = -float("inf")
            return scores

    class Record(LogitsProcessor):
        def __call__(self, input_ids, scores):
            steps.append(torch.log_softmax(scores.float(), dim=-1))
            return scores

    try:
        input_ids, mask = _left_padded(torch, rows, pad, engine.device)
        kwargs: dict[str, Any] = {"max_new_tokens": max(r.max_new - len(r.gen) for r in rows), **GREEDY_KWARGS,
                                  "pad_token_id": pad, "stopping_criteria": StoppingCriteriaList([RowsDone()])}
        processors = [NoEosYet()] if ignore_eos and eos_ids else []
        if top_k:
            processors.append(Record())  # after the EOS suppression: the scores greedy search picks from
        if processors:
            kwargs["logits_processor"] = LogitsProcessorList(processors)
        with torch.inference_mode():
            engine.model.generate(input_ids=input_ids, attention_mask=mask, streamer=Streamer(), **kwargs)
    except Exception as exc:  # noqa: BLE001 - every row's client learns why
        _fail_rows(rows, exc)
        return []
    finally:
        engine.batches += 1
    return _after_batch(rows, state["restart"], end_row)
