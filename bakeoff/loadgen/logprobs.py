"""Log-probabilities in the OpenAI response shapes (split from :mod:`bakeoff.loadgen.client`)."""

from __future__ import annotations

from typing import Any


def _token_key(token: Any) -> int | str:
    """A logprob entry's token: the int id of ``"token_id:N"`` (vLLM's
    ``return_tokens_as_token_ids``, bakeoff's workers), else the token text as given."""
    if isinstance(token, str) and token.startswith("token_id:"):
        try:
            return int(token[9:])
        except ValueError:
            return token
    return token


def _entry_key(entry: dict) -> int | str:
    """A ``content`` entry's token: its integer ``id`` where the server gives one (llama.cpp's
    server does, in completions and chat), else :func:`_token_key` of its text."""
    tid = entry.get("id")
    return tid if isinstance(tid, int) and not isinstance(tid, bool) else _token_key(entry["token"])


def ids_from_logprobs(lps: list | None) -> list[int] | None:
    """The sampled token ids of an event whose logprob entries are keyed by id (one entry per
    token), else None: a server that streams no token ids still names them there (issue 37)."""
    if not lps or not all(isinstance(e[0], int) and not isinstance(e[0], bool) for e in lps):
        return None
    return [e[0] for e in lps]


def parse_logprobs(obj: Any) -> list:
    """Per-token ``(token, logprob, {token: logprob})`` from a choice's ``logprobs``.

    Both OpenAI shapes: completions (``tokens`` / ``token_logprobs`` / ``top_logprobs`` as
    ``{token: logprob}`` maps) and chat (``content: [{token, logprob, top_logprobs: [{token,
    logprob}]}]``, entries keyed by their ``id`` where given). Anything else gives an empty list (logprobs are evidence, not a reason to
    fail a stream).
    """
    out: list = []
    try:
        if isinstance(obj.get("content"), list):
            for e in obj["content"]:
                top = {_entry_key(t): float(t["logprob"]) for t in e.get("top_logprobs") or []}
                out.append((_entry_key(e), float(e["logprob"]), top))
            return out
        tokens, lps = obj.get("tokens") or [], obj.get("token_logprobs") or []
        tops = obj.get("top_logprobs") or [None] * len(tokens)
        for tok, lp, top in zip(tokens, lps, tops):
            out.append((_token_key(tok), float(lp) if lp is not None else float("-inf"),
                        {_token_key(k): float(v) for k, v in (top or {}).items()}))
    except (AttributeError, KeyError, TypeError, ValueError):
        return []
    return out
