"""Token accounting: how many tokens a request produced, counted independently of the server.

A server's ``usage.completion_tokens`` is a claim. Every figure bakeoff publishes (tokens/s,
TPOT, ITL) divides by a token count, so the count is checked against what the client itself
received, in this order of strength:

1. ``token-ids``: the stream carried token ids (vLLM's ``return_token_ids``, bakeoff's own
   workers). Exact: usage must equal the number of ids received.
2. ``client-tokenizer`` (only without token ids): the model's tokenizer in the client process
   (the tokenizer of ``--model``, or ``--backend-opt tokenizer=DIR``) counts each content event's text; an event
   counts at least one token (a step whose text is empty: an EOS under ``ignore_eos``, a
   partial UTF-8 character held back by the server's detokenizer). U+FFFD is not
   re-tokenized: it is the server's rendering of a token's bytes that are not UTF-8 on their
   own (it would re-tokenize to 3 byte-level tokens), so it stands for its event's token.
   Where every event carries logprobs (one entry per sampled token, as the OpenAI form streams
   them) and their number equals usage, usage agrees (``client-logprobs``) whatever the text
   re-tokenizes to: a busy vLLM frontend merges several steps into one event, and an EOS step's
   empty text inside a merged event is invisible to a tokenizer (64 tokens counted 51 once),
   not to its logprob entry. A hop that drops events drops their entries too.
3. ``client-events``: without either, the number of content events (one step each), a lower
   bound that is exact for servers streaming one token per event.

Tolerance (:data:`ABS_TOLERANCE_TOKENS`, :data:`REL_TOLERANCE`): a text count agrees with
usage when ``|usage - count| <= 2 + ceil(10% of the tokens counted in events whose text
re-tokenized to more than one token)``. The 2 tokens cover a final EOS or stop token some
servers count without streaming a chunk for it; the 10% covers detokenization boundaries (the
text of a multi-token event, or of a non-canonical token, can re-tokenize to more or fewer
tokens than were generated). A stream of one token per event is held to 2 tokens, so a hop
dropping every tenth event is caught. Token ids need no tolerance. An event count can only confirm usage or refute a
usage below it: usage above it is ``unverified`` (events may carry several tokens).

A final event carrying only a ``finish_reason`` (no text, no token ids, no logprobs) is not a
generation step: the OpenAI form sends that chunk after the last token (``delta: {}`` in chat,
``text: ""`` in completions), and counting it made 32-token streams 33 on the tokenizer and
event paths. vLLM puts ``finish_reason`` on the last token's own chunk instead; when that
token's text is empty (an EOS) it is left out too, one token within the tolerance below, and
usage (agreeing) is what the figures use.

The tokenizer is checked before its count is believed (completions prompts, where the client
sends the very text the server tokenizes): it must count the prompt as the server's
``usage.prompt_tokens`` does (with or without the special tokens its post-processor adds). A
tokenizer that counts the prompt otherwise is not the server's: its output count cannot refute
usage nor usage confirm it, so the request's accounting is ``disputed`` (figures use server
usage, the source says ``disputed``, and the point counts ``accounting_disputed``), never a
mismatch blamed on the server (usage.prompt_tokens 7 against the client's own 9 once made the
client's count win).

When the client's tokenizer disagrees with usage but usage equals the number of content events
(each carrying at most one logprob entry), the stream itself corroborates usage: one token an
event. Usage is what the figures use (``agree``, the source naming the events and the tokenizer's
count), and the tokenizer is named as not the server's; before, its count won (2.7x too high).

The request's figures use the count the check trusts: token ids when streamed, server usage
when it agrees with the client's count, else the client's count (``output_tokens_source``
says which, and why); ``token_times_ns`` come from the per-event counts, never from spreading
an unverified usage over events (that invented 0 ms ITLs), except when usage is all there is.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable

from bakeoff.api.errors import EngineFailure
from bakeoff.api.specs import RequestRecord

ABS_TOLERANCE_TOKENS = 2
REL_TOLERANCE = 0.10


class TokenCounter:
    """``text -> token count`` with a ``tokenizers`` tokenizer (no special tokens added).

    Args:
        path: ``tokenizer.json`` or the folder that holds it.

    Raises:
        EngineFailure: ``config-rejected`` when the file is missing or unreadable.
    """

    def __init__(self, path: str | Path):
        p = Path(path)
        if p.is_dir():
            p = p / "tokenizer.json"
        try:
            from tokenizers import Tokenizer

            self._tok = Tokenizer.from_file(str(p))
        except Exception as exc:
            raise EngineFailure("config-rejected", f"cannot load tokenizer {p}: {type(exc).__name__}: {exc}") from None
        self.path = str(p)

    def __call__(self, text: str) -> int:
        return len(self._tok.encode(text, add_special_tokens=False).ids) if text else 0

    def prompt_counts(self, text: str) -> set[int]:
        """The counts a server with this tokenizer can report for a prompt: without and with the
        special tokens the tokenizer's post-processor adds (a BOS, for models that have one)."""
        return {len(self._tok.encode(text, add_special_tokens=flag).ids) for flag in (False, True)}

    def each(self, texts: list[str]) -> list[int]:
        """Counts of many texts in one call (the Rust side batches them)."""
        if not texts:
            return []
        return [len(e.ids) for e in self._tok.encode_batch(texts, add_special_tokens=False)]


def model_token_counter(path: str | None) -> TokenCounter | None:
    """The tokenizer of a local model folder, or None when it has no ``tokenizer.json``."""
    if not path or not (Path(path) / "tokenizer.json").is_file():
        return None
    try:
        return TokenCounter(path)
    except EngineFailure:
        return None


def tolerance(ks: list[int]) -> int:
    """Tokens by which a count of per-event token counts ``ks`` and server usage may differ
    and still agree (the module docstring's rule)."""
    return ABS_TOLERANCE_TOKENS + math.ceil(REL_TOLERANCE * sum(k for k in ks if k > 1))


def _spread(n_tokens: int, n_events: int) -> list[int]:
    """Split ``n_tokens`` evenly over ``n_events`` events; the remainder goes to the first."""
    base, rest = divmod(n_tokens, n_events)
    return [base + (1 if i < rest else 0) for i in range(n_events)]


def finish_only(ev) -> bool:
    """An event that ends a stream and carries nothing of a token (module docstring)."""
    return bool(ev.finish_reason) and not ev.text and not ev.token_ids and not ev.logprobs


def prompt_dispute(prompt: str | None, usage_p: int | None, count_tokens) -> tuple[int | None, str | None]:
    """``(the client's prompt count, why the tokenizer is not the server's or None)``: the
    tokenizer counted against the server's ``usage.prompt_tokens`` (module docstring)."""
    if prompt is None or count_tokens is None:
        return None, None
    counts = count_tokens.prompt_counts(prompt) if hasattr(count_tokens, "prompt_counts") else {count_tokens(prompt)}
    own = min(counts)
    if usage_p is None or usage_p in counts:
        return own, None
    return own, (f"the client's tokenizer counts the prompt as {'/'.join(map(str, sorted(counts)))} tokens, "
                 f"the server's usage.prompt_tokens {usage_p}: not the server's tokenizer")


# A prompt cannot hold more tokens than its UTF-8 bytes (every token of a byte-level tokenizer covers at
# least one byte) plus the special tokens a template or post-processor adds around it.
PROMPT_SPECIAL_TOKENS = 64


def impossible_count(n: Any, most: int | None = None, what: str = "the request's max_tokens") -> str | None:
    """Why a server's token count cannot be true, or None: not an integer, negative, or above
    ``most`` (a request's ``max_tokens``: no server generates past it; a prompt's bytes)."""
    if n is None:
        return None
    if isinstance(n, bool) or not isinstance(n, int):
        return f"not an integer ({str(n)[:40]!r})"
    if n < 0:
        return f"negative ({n})"
    if most is not None and n > most:
        return f"{n:,} is more than {what} {most:,}"
    return None


def account(rec: RequestRecord, evs: list, usage_p: int | None, usage_c: int | None,
            count_tokens: Callable[[str], int] | None, prompt: str | None = None,
            max_tokens: int | None = None) -> None:
    """Fill token counts, their agreement and per-token times of ``rec`` from its content events.

    Args:
        prompt: the completions prompt the server tokenized, to check the tokenizer against
            ``usage_p`` (None: chat and messages, whose template the client cannot reproduce).
        max_tokens: the request's; a usage above it (or negative, or not an integer: see
            :func:`impossible_count`) is evidence of a broken server, never a figure: the request's
            accounting is ``disagree`` (``client-accounting``) and its figures use the client's count.
    """
    if evs and finish_only(evs[-1]):
        evs = evs[:-1]
    claimed = usage_c
    usage_c, usage_p, impossible = _believable_usage(usage_c, usage_p, prompt, max_tokens)
    rec.usage_output_tokens, rec.input_tokens, rec.content_events = usage_c, usage_p, len(evs)
    have_ids = bool(evs) and all(ev.token_ids is not None for ev in evs)
    rec.client_input_tokens, disputed = prompt_dispute(prompt, usage_p, count_tokens) if not have_ids else (None, None)
    ks_text = None
    # with token ids the count is exact: no re-tokenization, which ran on the event loop at each request's end
    # (~20 us per token: 10 ms for a 512-token request, while other streams' bytes waited to be stamped)
    if count_tokens is not None and evs and not have_ids:
        ks_text = _tokenizer_counts(evs, count_tokens)
        rec.text_output_tokens = sum(ks_text)
    if have_ids:
        ks = _count_token_ids(rec, evs, usage_c)
    else:
        ks = _count_client_side(rec, evs, usage_c, ks_text, disputed)
    if impossible:  # the claim is kept as evidence (a string when it was not a number)
        basis = "token-ids" if have_ids else ("client-tokenizer" if ks_text else "client-events")
        _usage_impossible(rec, claimed, impossible, basis)
    rec.accounting_mismatch = rec.status == "ok" and rec.accounting == "disagree"
    _token_times(rec, evs, ks)


def _believable_usage(usage_c, usage_p, prompt: str | None, max_tokens: int | None):
    """``(usage_c, usage_p, why usage_c is impossible or None)``: a server count that cannot be true
    (:func:`impossible_count`) made None, never a figure."""
    impossible = impossible_count(usage_c, max_tokens)
    if impossible:
        usage_c = None
    most_p = len(prompt.encode("utf-8")) + PROMPT_SPECIAL_TOKENS if prompt is not None else None
    if impossible_count(usage_p, most_p, "the prompt's UTF-8 bytes plus special tokens"):
        usage_p = None  # never a figure (census: 10**18 prompt tokens printed as the needles' lengths)
    return usage_c, usage_p, impossible


def _tokenizer_counts(evs: list, count_tokens) -> list[int]:
    """The client tokenizer's count of each event's text, at least 1 an event, U+FFFD not re-tokenized."""
    each = getattr(count_tokens, "each", None)
    texts = [ev.text.replace("\ufffd", "") for ev in evs]
    counts = each(texts) if each else [count_tokens(t) for t in texts]
    return [max(1, k) for k in counts]


def _count_token_ids(rec: RequestRecord, evs: list, usage_c: int | None) -> list[int]:
    """The exact count from streamed token ids against usage; the per-event counts."""
    ks = [len(ev.token_ids) for ev in evs]
    rec.client_output_tokens = sum(ks)
    rec.output_token_ids = [i for ev in evs for i in ev.token_ids]
    agree = usage_c is None or usage_c == rec.client_output_tokens
    rec.accounting = "agree" if usage_c is not None and agree else ("no-usage" if usage_c is None else "disagree")
    rec.output_tokens, rec.output_tokens_source = rec.client_output_tokens, "token-ids"
    return ks


def _count_client_side(rec: RequestRecord, evs: list, usage_c: int | None, ks_text: list[int] | None,
                       disputed: str | None) -> list[int]:
    """Without token ids: the client's count (logprob entries, tokenizer or events) against usage, in
    the module docstring's order; the per-event counts the token times use."""
    # one logprob entry per token the server sampled, where every event carries them (issue 37's
    # servers, vLLM asked for logprobs): an exact count of a merged event's tokens, EOS steps included
    lp_ks = [len(ev.logprobs) for ev in evs] if evs and all(ev.logprobs for ev in evs) else None
    ks = ks_text or [1] * len(evs)
    rec.client_output_tokens = sum(ks)
    basis = "client-tokenizer" if ks_text else "client-events"
    if lp_ks is not None and usage_c is not None and usage_c == sum(lp_ks):
        rec.accounting = "agree"
        rec.output_tokens, rec.output_tokens_source = usage_c, "server-usage (agrees with client-logprobs)"
        return lp_ks
    if disputed is not None and basis == "client-tokenizer":
        rec.accounting = "disputed"
        rec.output_tokens, rec.output_tokens_source = ((usage_c, f"server-usage (disputed: {disputed})")
                                                       if usage_c is not None else
                                                       (rec.client_output_tokens, f"{basis} (disputed: {disputed})"))
    elif usage_c is None:
        rec.accounting = "no-usage"
        rec.output_tokens, rec.output_tokens_source = rec.client_output_tokens, basis
    else:
        ks = _usage_against_count(rec, evs, usage_c, ks, basis)
    return ks


def _usage_against_count(rec: RequestRecord, evs: list, usage_c: int, ks: list[int], basis: str) -> list[int]:
    """Usage against the client's tokenizer or event count (``basis``): agree within :func:`tolerance`,
    agree one token an event, unverified above an event count, else disagree; the per-event counts."""
    if abs(usage_c - rec.client_output_tokens) <= tolerance(ks):
        rec.accounting = "agree"
        rec.output_tokens, rec.output_tokens_source = usage_c, f"server-usage (agrees with {basis})"
    elif basis == "client-tokenizer" and usage_c == len(evs) and all(len(ev.logprobs or [None]) == 1 for ev in evs):
        # one token an event, as many as usage says: the stream settles it, and the client's
        # tokenizer, far off on the output it counts, is not the server's (issue 38: its 86
        # against usage 32 on a 32-event stream once made the figures 2.7x too high)
        rec.accounting = "agree"
        rec.output_tokens, rec.output_tokens_source = usage_c, (
            f"server-usage (agrees with client-events; the client's tokenizer counts {rec.client_output_tokens}: "
            "not the server's tokenizer)")
        ks = [1] * len(evs)
    elif basis == "client-events" and usage_c > rec.client_output_tokens:
        rec.accounting = "unverified"  # events may carry several tokens: only a tokenizer can tell
        rec.output_tokens, rec.output_tokens_source = usage_c, "server-usage (unverified)"
        if rec.status == "ok" and evs:
            ks = _spread(usage_c, len(evs))
    else:
        rec.accounting = "disagree"
        rec.output_tokens, rec.output_tokens_source = rec.client_output_tokens, f"{basis} (server usage disagrees)"
    return ks


def _usage_impossible(rec: RequestRecord, claimed: Any, impossible: str, basis: str) -> None:
    """An impossible usage: kept as evidence (a string when it was not a number), the accounting
    ``disagree``, the figures the client's count."""
    rec.usage_output_tokens = claimed if isinstance(claimed, int) and not isinstance(claimed, bool) else str(claimed)[:40]
    rec.accounting = "disagree"
    rec.output_tokens, rec.output_tokens_source = rec.client_output_tokens, f"{basis} (server usage impossible: {impossible})"


def _token_times(rec: RequestRecord, evs: list, ks: list[int]) -> None:
    """Per-token times (an event's time for each of its ``ks`` tokens), reasoning tokens, event times,
    the output text and one logprob entry a token."""
    times: list[int] = []
    for ev, k in zip(evs, ks):
        times.extend([ev.t_ns] * k)
        if ev.kind == "reasoning":
            rec.reasoning_tokens += k
    rec.token_times_ns = times
    rec.event_times_ns = [ev.t_ns for ev in evs]
    rec.first_token_ns = evs[0].t_ns if evs else None
    rec.output_text = "".join(ev.text for ev in evs if ev.kind == "text")
    if any(ev.logprobs for ev in evs):  # one entry per token: None where an event's logprobs are missing or short
        rec.output_logprobs = []
        for ev in evs:
            n = len(ev.token_ids) if ev.token_ids else len(ev.logprobs or [])
            lps = list(ev.logprobs or [])[:n]
            rec.output_logprobs += lps + [None] * (n - len(lps))


def accounting_row(rec: RequestRecord, sessions: int | None = None) -> dict:
    """The counts of one request, as the accounting check's evidence lists them."""
    return {"request_id": rec.request_id, "sessions": sessions, "status": rec.status,
            "usage_output_tokens": rec.usage_output_tokens,
            "streamed_token_ids": len(rec.output_token_ids) if rec.output_token_ids is not None else None,
            "client_tokenizer_tokens": rec.text_output_tokens, "content_events": rec.content_events,
            "usage_prompt_tokens": rec.input_tokens, "client_prompt_tokens": rec.client_input_tokens,
            "output_tokens": rec.output_tokens, "output_tokens_source": rec.output_tokens_source,
            "accounting": rec.accounting}
