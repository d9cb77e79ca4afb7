"""Top-k logprobs of a generated token, from one step's log-softmax (both batching paths)."""

from __future__ import annotations


def top_logprobs(logp, token: int, k: int) -> tuple[float, list[tuple[int, float]]]:
    """``(logprob of token, [(id, logprob)] of the k most likely)`` from one step's log-softmax."""
    vals, idx = logp.topk(k)
    return float(logp[token]), list(zip(idx.tolist(), vals.tolist()))
