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


def parse_logprobs(obj: Any) -> list:
    """Per-token ``(token, logprob, {token: logprob})`` from a choice's ``logprobs``.

    Both OpenAI shapes: completions (``tokens`` / ``token_logprobs`` / ``top_logprobs`` as
    ``{token: logprob}`` maps) and chat (``content: [{token, logprob, top_logprobs: [{token,
    logprob}]}]``). Anything else gives an empty list (logprobs are evidence, not a reason to
    fail a stream).
    """
    out: list = []
    try:
        if isinstance(obj.get("content"), list):
            for e in obj["content"]:
                top = {_token_key(t["token"]): float(t["logprob"]) for t in e.get("top_logprobs") or []}
                out.append((_token_key(e["token"]), float(e["logprob"]), top))
            return out
        tokens, lps = obj.get("tokens") or [], obj.get("token_logprobs") or []
        tops = obj.get("top_logprobs") or [None] * len(tokens)
        for tok, lp, top in zip(tokens, lps, tops):
            out.append((_token_key(tok), float(lp) if lp is not None else float("-inf"),
                        {_token_key(k): float(v) for k, v in (top or {}).items()}))
    except (AttributeError, KeyError, TypeError, ValueError):
        return []
    return out
