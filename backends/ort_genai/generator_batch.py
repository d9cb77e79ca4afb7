"""Static batches on ``og.Generator`` in the ORT GenAI engine process (split from engine.py).

Greedy requests waiting together run as one ``og.Generator`` batch (:func:`take_batch`, at most
``max_batch_size`` rows, same ``ignore_eos`` and top-k logprobs): right-padded with the export's
``pad_token_id``, the layout og's own ``Tokenizer.encode_batch`` gives and og reads back
(``src/models/position_inputs.cpp``: only a row's trailing pads are masked and left out of its
positions; ``src/models/logits.cpp``: each row's logits come from its last non-pad token). Each
row streams as its own request and stops at its own end (``max_tokens``, EOS, a cancel).

Two users:

- requests that ask for logprobs (``og.Engine`` gives no logits): their top-k log-probabilities
  come from ``get_logits()`` read before the ``generate_next_token`` that picks each token. 300
  probes of SmolLM2-135M took 140 s one at a time on the fp32 export (2-core host); batched, the
  same tokens and logprobs (``tests/test_ort_genai.py``);
- ``batching=static``: every greedy request (og's batched ``og.Generator``, the static batch an
  offline user runs, as ``benchmarks/ort_genai_bare.py``'s ``generator`` kind).

A wave of concurrent sessions reaches the engine spread over a few milliseconds: right after a
batch ends, the first request of the next batch waits up to :data:`WAVE_WAIT_S` for the rest of
the wave (:func:`take_batch`): the batch's rows whose clients come back, and the compatible
requests that waited through the batch (counted when its first row ended, before any client
could be back; without them, a session left out of one batch stayed out of every next one: on
the fixture at 8 sessions, batches of 7 and the 8th session alone, 6.4 rows per step where the
bare loop runs 8, and a wave-wait at the sweep's end for a wave that never came); and a batch of
greedy requests without logprobs whose rows have each generated at most :data:`RESTART_TOKENS`
tokens, when at least as many compatible requests wait as it has rows, stops and starts again
with them (as ``backends/transformers/static.py`` does), its rows continuing from their prompt
plus what they generated. That prefill is not bit-equal to the steps it replaces (int4 export:
up to 0.16 nats apart, enough to flip a greedy token), so a batch of logprobs requests (probes:
the tie rule's evidence) never restarts: its rows get exactly what each gets alone, whenever
they arrive. A request that samples runs alone; one whose prompt is empty or ends with the pad id,
or that would push the batch's ``max_length`` past the context, runs alone after the batch.
``/v1/tokenize`` requests are answered between a batch's steps, not after it.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from typing import Any, Callable

from backends.ort_genai.frames import TOKENIZE, Decoder, Out, answer_tokenize

MAX_BATCH = 16  # default rows of one og.Generator batch; the probes' concurrency (evaluations/probing.py)
RESTART_TOKENS = 4  # a batch whose rows are this young restarts to take in newcomers
# After a batch whose n rows ended (and m compatible requests waited through it), the first request of
# the next batch waits up to this long (from its last step) for n + m - 1 more: closed-loop clients send
# their next requests as their streams
# end, and the wave reaches the engine over a few milliseconds. Without the wait its first arrival
# started a batch of its own that the rest restarted (4-5 restarts per 32 requests at 8 sessions of
# SmolLM2-135M int4, each a second prefill; TTFT 790 vs the bare batch-per-turn loop's 711 ms).
# 20 ms held the wave on the 2-core AMD host; on a 2-core Intel Xeon host (2026-12-05) a wave came
# over longer and 20 ms split it: 6.4 tokens per step at 8 sessions, 0.925 [0.91, 0.94] of the bare
# loop's tok/s; 60 ms: 7.97 of 8 and 0.985 [0.94, 1.03], TTFT equal (774 / 774 ms). The wait ends as
# soon as the wave is in, so the cap costs only a wave that does not come (once, at a sweep's end).
WAVE_WAIT_S = 0.06
# A wave that stops coming is not waited for to the end of WAVE_WAIT_S: once a wave came whole, the
# next wait ends after a silence of WAVE_QUIET_FACTOR times its longest gap between arrivals (at least
# WAVE_QUIET_MIN_S; from the wave's first arrival on). A closed loop's last wave can be smaller than the one before it (a session out of
# step), and on the fixture (a wave in 4-7 ms, gaps of ~1 ms) the full wait cost 60 ms of a 100 ms
# timed run; a host whose waves come slowly (the Intel host above) keeps a longer silence.
WAVE_QUIET_FACTOR = 4
WAVE_QUIET_MIN_S = 0.003


class Inbox:
    """The engine process's queue of ``(rid, body)`` requests (the command thread puts, the
    decode thread gets): a ``queue.SimpleQueue``'s ``put``/``get``/``empty``/``qsize``, plus
    :meth:`take` of the items a predicate picks, the others keeping their order and place."""

    def __init__(self) -> None:
        self._q: collections.deque = collections.deque()
        self._ready = threading.Condition(threading.Lock())

    def put(self, item: tuple) -> None:
        with self._ready:
            self._q.append(item)
            self._ready.notify()

    def get(self) -> tuple:
        with self._ready:
            while not self._q:
                self._ready.wait()
            return self._q.popleft()

    def empty(self) -> bool:
        return not self._q

    def qsize(self) -> int:
        return len(self._q)

    def take(self, pick: Callable[[tuple], bool], most: int) -> list[tuple]:
        """Up to ``most`` items that ``pick`` accepts, in their order, removed; the rest stay."""
        if not self._q or most <= 0:
            return []
        with self._ready:
            got, keep = [], collections.deque()
            for item in self._q:
                (got if len(got) < most and pick(item) else keep).append(item)
            self._q = keep
            return got

    def wait_wave(self, pick: Callable[[tuple], bool], n: int, since: float | None, deadline: float,
                  quiet_s: float) -> tuple[bool, float]:
        """Wait until at least ``n`` items that ``pick`` accepts are queued, the ``deadline``
        (``time.perf_counter()``) passes, or none arrived for ``quiet_s`` (from ``since``, then from
        the last arrival; ``since`` None: no silence counts before the first arrival). Returns
        whether they are queued, and the longest gap between arrivals."""
        clock = time.perf_counter
        with self._ready:
            have, last, gap = sum(1 for item in self._q if pick(item)), since, 0.0
            while have < n:
                left = (deadline if last is None else min(deadline, last + quiet_s)) - clock()
                if left <= 0:
                    return False, gap
                self._ready.wait(left)
                now, got = clock(), sum(1 for item in self._q if pick(item))
                if got > have:
                    have, gap, last = got, gap if last is None else max(gap, now - last), now
            return True, gap

    def count(self, pick: Callable[[tuple], bool]) -> int:
        if not self._q:
            return 0
        with self._ready:
            return sum(1 for item in self._q if pick(item))


def batch_key(body: dict[str, Any]) -> tuple | None:
    """Requests with the same key can share a batch (greedy, same EOS rule, same top-k); None: alone."""
    if float(body.get("temperature") or 0.0) > 0:
        return None
    return bool(body.get("ignore_eos")), int(body.get("logprobs") or 0)


def _take(engine, key: tuple, room: int) -> list[tuple]:
    """Up to ``room`` requests with batch key ``key`` from ``engine.inbox``; the others stay, in place."""
    return engine.inbox.take(_joins(key), room)


def _joins(key: tuple) -> Callable[[tuple], bool]:
    """Whether an inbox item is a request with batch key ``key`` (not a tokenize request)."""
    return lambda item: TOKENIZE not in item[1] and batch_key(item[1]) == key


def take_batch(engine, first: tuple) -> list[tuple]:
    """``first`` with the compatible requests waiting in ``engine.inbox``; right after a batch, the
    rest of the wave (its rows' clients' next requests, with the requests that waited through it) is
    waited for (:data:`WAVE_WAIT_S`)."""
    key = batch_key(first[1])
    if key is None or engine.paged:
        return [first]
    wave, engine.wave = engine.wave, None  # a wave is waited for once, by the batch right after it
    if wave is not None and wave[2] == key and wave[0] > 1:
        want, now = min(engine.max_batch, wave[0]) - 1, time.perf_counter()
        if now < wave[1] + WAVE_WAIT_S and engine.inbox.count(_joins(key)) < want:
            engine.wave_waits += 1
            gap = engine.wave_gap_s
            quiet = WAVE_WAIT_S if gap is None else min(WAVE_WAIT_S, max(WAVE_QUIET_MIN_S, WAVE_QUIET_FACTOR * gap))
            # the silence counts from the wave's first returning request, not from the batch's end: a
            # stream's end reaching its client and the next request coming back takes longer than the
            # gaps between a wave's requests (~3.5 ms against ~1 ms on the fixture). ``first`` is that
            # request (now), unless requests waited through the batch: then ``first`` is one of them
            # and no client is back yet (a breaker's find: the wave cut at 3 ms, a batch of one)
            since = None if wave[3] else now
            whole, gap = engine.inbox.wait_wave(_joins(key), want, since, wave[1] + WAVE_WAIT_S, quiet)
            if whole:
                engine.wave_gap_s = gap
    return [first] + _take(engine, key, engine.max_batch - 1)


class Row:
    """One request of a batch: its prompt ids, what it generated, its frames."""

    __slots__ = ("rid", "body", "out", "ids", "gen", "max_new", "ended")

    def __init__(self, engine, rid: Any, body: dict[str, Any], send):
        self.rid, self.body, self.gen, self.ended = rid, body, [], False
        self.out = Out(send, rid, engine.stream_interval_s)
        self.ids = engine.encode(body.get("prompt", ""))
        self.out.start(len(self.ids))
        self.out.decoder = None if engine.tokenizer_json else Decoder(engine)
        self.max_new = int(body.get("max_tokens") or 16)

    def end(self, engine, reason: str) -> None:
        self.out.finish(reason, engine.stats())
        self.ended = True


def run_batch(engine, items: list[tuple], send, batch) -> None:
    """``items`` (``(rid, body)`` from :func:`take_batch`) as one og.Generator batch, restarted to
    take in newcomers while young (greedy without logprobs only); the rows :func:`_split` sets
    aside run alone after it, each failing on its own. A failure of the batch fails its rows
    not yet ended."""
    rows: list[Row] = []
    lone: list[Row] = []
    try:
        rows = [Row(engine, rid, body, send) for rid, body in items]
        key = batch_key(items[0][1])
        restart_key = key if key is not None and not key[1] else None  # logprobs batches never restart
        live = _split(engine, rows, lone)
        while live:
            live = _generate(engine, live, batch, send, restart_key)
            if live:
                engine.restarts += 1
                joined = [Row(engine, rid, body, send) for rid, body in _take(engine, key, engine.max_batch - len(live))]
                rows += joined
                live = _split(engine, live + joined, lone)
    except Exception as exc:  # noqa: BLE001 - their clients learn why
        for r in rows:
            if not r.ended and r not in lone:
                r.out.fail(exc)
    for r in lone:
        try:
            _generate(engine, [r], batch, send)
        except Exception as exc:  # noqa: BLE001 - its client learns why
            if not r.ended:
                r.out.fail(exc)
    for rid in {rid for rid, _ in items} | {r.rid for r in rows}:
        engine.cancelled.discard(rid)


def _split(engine, rows: list[Row], lone: list[Row]) -> list[Row]:
    """The rows, in order, that can share one right-padded batch; the others are appended to
    ``lone``: a prompt that is empty or ends with the pad id (og would take it for padding), and
    a row that would push the batch's ``max_length`` (widest prompt + most tokens left) past the
    context. A single row needs no padding and is never set aside."""
    if len(rows) == 1:
        return rows
    pad, ctx = engine.pad_id, engine.context_length
    ok: list[Row] = []
    width = left = 0
    for r in rows:
        n, more = len(r.ids) + len(r.gen), r.max_new - len(r.gen)
        if r.ids and pad is not None and (r.ids + r.gen)[-1] != pad and (
                not ctx or max(width, n) + max(left, more) <= ctx or not ok):
            ok.append(r)
            width, left = max(width, n), max(left, more)
        else:
            lone.append(r)
    return ok


def _start(engine, rows: list[Row]):
    """An og.Generator over ``rows``, each fed its prompt plus what it generated (right-padded)."""
    og, np = engine.og, engine.np
    n_rows = len(rows)
    prompts = [r.ids + r.gen for r in rows]
    width = max(len(p) for p in prompts)
    body0 = rows[0].body
    params = og.GeneratorParams(engine.model)
    opts = engine.search_options({**body0, "max_tokens": max(r.max_new - len(r.gen) for r in rows)}, width)
    params.set_search_options(**opts, **({"batch_size": n_rows} if n_rows > 1 else {}))
    gen = og.Generator(engine.model, params)
    padded = [p + [engine.pad_id] * (width - len(p)) for p in prompts] if n_rows > 1 else prompts[0]
    gen.append_tokens(np.asarray(padded, dtype=np.int32))
    if body0.get("logprobs"):
        engine.logprobs_rows_max = max(engine.logprobs_rows_max, n_rows)
    engine.max_running = max(engine.max_running, n_rows)
    return gen


def _step_rows(engine, rows: list[Row], nxt, now: float, logp, k: int, ignore_eos: bool) -> tuple[int, int]:
    """One step's tokens ``nxt`` into each live row's frames (inside the step's ``batch()``); rows
    that reached their end are ended. Returns ``(rows ended, of them those whose clients come back)``."""
    np, cancelled, eos_ids = engine.np, engine.cancelled, engine.eos_ids
    ended = back = 0
    for i, r in enumerate(rows):
        if r.ended:
            continue
        token = int(nxt[i])
        r.gen.append(token)
        if k:
            r.out.send_ids(np.asarray([token], dtype=np.int32).tobytes(), now, True, [_top(np, logp[i], token, k)])
        else:
            r.out.pending.append(token)
            r.out.due(now)
        eos = not ignore_eos and token in eos_ids
        if eos or len(r.gen) >= r.max_new or (cancelled and r.rid in cancelled):
            aborted = bool(cancelled) and r.rid in cancelled
            r.end(engine, "abort" if aborted else "stop" if eos else "length")
            ended, back = ended + 1, back + (not aborted)
    return ended, back


def _generate(engine, rows: list[Row], batch, send, key: tuple | None = None) -> list[Row]:
    """One og.Generator over ``rows`` (each continuing from its prompt plus what it generated);
    ``/v1/tokenize`` requests waiting are answered between its steps. When every row has ended,
    ``engine.wave`` says how many requests the next batch may wait for (:func:`take_batch`).

    Returns:
        The rows to continue when the batch stopped early for newcomers (``key``: the batch key
        of those it may restart for), else []."""
    n_rows, body0 = len(rows), rows[0].body
    k, ignore_eos = int(body0.get("logprobs") or 0), bool(body0.get("ignore_eos"))
    gen = _start(engine, rows)
    live = [r for r in rows if not r.ended]
    clock, np, inbox = time.perf_counter, engine.np, engine.inbox if send is not None else None
    # restart only while every row is young: after that no look into the inbox per step
    young_steps = RESTART_TOKENS - max(len(r.gen) for r in rows) if key is not None and n_rows < engine.max_batch else -1
    step, t_out = 0, clock()
    back_all, stragglers = 0, None  # rows whose clients come back; requests that waited through the batch
    while live and not gen.is_done():  # the hot loop: a token's own cost is the bare loop's plus a frame
        t_in = clock()
        engine.own_s += t_in - t_out
        logp = _log_softmax(np, gen.get_logits(), n_rows) if k else None
        gen.generate_next_token()
        nxt = gen.get_next_tokens()
        t_out = clock()
        engine.og_s += t_out - t_in
        engine.decode_steps += 1
        step += 1
        with batch():
            ended, back = _step_rows(engine, rows, nxt, t_out, logp, k, ignore_eos)
        if ended:
            live = [r for r in rows if not r.ended]
            back_all += back
            if key is not None:
                stragglers = _wave_after(engine, key, live, back_all, stragglers, t_out)
        if inbox is not None and not inbox.empty() and _between_steps(engine, send, key, live, step <= young_steps):
            return live
    del gen
    for r in live:  # og ended the row (its EOS, or max_length): "stop" before max_tokens, as the lone loop
        r.end(engine, "stop" if len(r.gen) < r.max_new else "length")
    return []


def _wave_after(engine, key: tuple, live: list[Row], back_all: int, stragglers: int | None, now: float) -> int:
    """After a step in which rows of a restartable batch ended: the requests that waited through the
    batch (counted at its first end, before any of its rows' clients can be back), and, once no row
    is live, ``engine.wave`` (``(requests of the next wave, now, key)``, :func:`take_batch`)."""
    if stragglers is None:
        stragglers = engine.inbox.count(_joins(key))
    if not live:  # these rows' clients come back together, with the requests that waited
        engine.wave = (back_all + stragglers, now, key, stragglers)
    return stragglers


def _between_steps(engine, send, key: tuple | None, live: list[Row], young: bool) -> bool:
    """With requests in the inbox between two steps: whether the batch stops to restart with
    newcomers (while ``young``, :func:`_waiting`); else the ``/v1/tokenize`` requests are answered."""
    if young and live and _waiting(engine, key, len(live)):
        return True
    for rid, body in engine.inbox.take(_is_tokenize, 64):
        answer_tokenize(engine, send, rid, body[TOKENIZE])
    return False


def _waiting(engine, key: tuple, n_live: int) -> bool:
    """At least as many compatible requests wait as the batch has live rows: a restart (which
    prefills the live rows again) at least doubles the batch. A wave of sessions arriving over a
    batch's first steps restarts it; a few probes arriving at a full batch do not (SmolLM2-135M
    int4, 300 probes, 16 in flight: 78.5 s restarting at any arrival, 52.2 s never, 68.7 s one
    at a time), nor do requests that could not join (sampled, another key, tokenize)."""
    return engine.inbox.count(_joins(key)) >= n_live


def _is_tokenize(item: tuple) -> bool:
    return TOKENIZE in item[1]


def _log_softmax(np, logits, n_rows: int):
    x = np.asarray(logits, dtype=np.float64)
    x = x.reshape(n_rows, -1, x.shape[-1])[:, -1]
    m = x.max(axis=1, keepdims=True)
    return x - (m + np.log(np.exp(x - m).sum(axis=1, keepdims=True)))


def _top(np, row, token: int, k: int) -> tuple:
    top = np.argpartition(-row, k)[:k] if k < row.size else np.arange(row.size)
    top = top[np.argsort(-row[top], kind="stable")]
    return float(row[token]), [(int(t), float(row[t])) for t in top]


def run_with_logprobs(engine, rid: Any, body: dict[str, Any], out) -> None:
    """One logprobs request alone on og.Generator into ``out`` (a test's sink)."""
    row = Row.__new__(Row)
    row.rid, row.body, row.out, row.gen, row.ended = rid, body, out, [], False
    row.ids = engine.encode(body.get("prompt", ""))
    row.max_new = int(body.get("max_tokens") or 16)
    out.start(len(row.ids))
    _generate(engine, [row], contextlib.nullcontext, None)
