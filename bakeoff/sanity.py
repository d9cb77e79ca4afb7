"""Is the output text or garbage? (DESIGN.md "Sanity"): known answers, reference agreement,
model-free degeneration detectors.
"""

from __future__ import annotations

import unicodedata
from collections import Counter
from typing import Any

# Generic probes for real models (LLMPerf correctness-test spirit): checkable continuations.
GENERIC_PROBES = [
    {"id": "g-count", "task": "count", "prompt": "1, 2, 3, 4, 5, 6, 7,", "expected": " 8, 9"},
    {"id": "g-alpha", "task": "copy", "prompt": "A B C D E F G H I", "expected": " J K"},
    {"id": "g-words", "task": "number-to-words", "prompt": "one two three four five six", "expected": " seven eight"},
    {"id": "g-arith", "task": "arithmetic", "prompt": "2 + 2 = 4\n3 + 3 = 6\n4 + 4 =", "expected": " 8"},
    {"id": "g-copy", "task": "copy", "prompt": "Repeat: apple banana cherry. Repeat: apple banana cherry. Repeat:", "expected": " apple banana cherry"},
]

# Thresholds of the degeneration detectors. A repeated run of one token over 60% of a
# 32+-token output, or distinct-2 below 0.2, is the usual signature of a broken decode
# (see HELM / "neural text degeneration", Holtzman et al. 2020, on repetition).
MAX_REPEAT_FRACTION = 0.6
MIN_DISTINCT2 = 0.2
MIN_TOKENS_FOR_REPEAT = 32


def probe_correct(output: str, expected: str) -> bool:
    """A probe passes when the output starts with the expected continuation.

    Whitespace at the ends is normalised (engines differ in a leading space after
    detokenization), inner text must match exactly.
    """
    return output.strip().startswith(expected.strip())


def longest_run(tokens: list[Any]) -> int:
    best = cur = 0
    prev = object()
    for t in tokens:
        cur = cur + 1 if t == prev else 1
        best = max(best, cur)
        prev = t
    return best


def distinct_n(tokens: list[Any], n: int = 2) -> float:
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 1.0


def scripts(text: str) -> Counter:
    """Count letters by Unicode script (the first word of the character name: LATIN, CJK...)."""
    c: Counter = Counter()
    for ch in text:
        if ch.isalpha():
            name = unicodedata.name(ch, "UNKNOWN")
            c[name.split()[0]] += 1
    return c


def detectors(text: str, token_ids: list[int] | None, max_tokens: int, finish_reason: str | None) -> dict[str, Any]:
    """Model-free degeneration scores of one output.

    Args:
        text: the output text.
        token_ids: output token ids when known (else whitespace tokens are used).
        max_tokens: the request's limit.
        finish_reason: ``stop`` / ``length`` / None.

    Returns:
        Scores plus ``flags``: the names of the detectors that fired.
    """
    toks = token_ids if token_ids else text.split()
    run = longest_run(toks)
    d2 = distinct_n(toks, 2)
    fffd = text.count("\ufffd")
    ctrl = sum(1 for ch in text if unicodedata.category(ch) == "Cc" and ch not in "\n\t\r")
    sc = scripts(text)
    major = sum(sc.values())
    mixing = 1 - (sc.most_common(1)[0][1] / major) if major else 0.0
    flags = []
    if len(toks) >= MIN_TOKENS_FOR_REPEAT and run / len(toks) > MAX_REPEAT_FRACTION:
        flags.append("repetition")
    if len(toks) >= MIN_TOKENS_FOR_REPEAT and d2 < MIN_DISTINCT2:
        flags.append("low-distinct-2")
    if fffd:
        flags.append("replacement-char")
    if ctrl:
        flags.append("control-char")
    if major >= 20 and mixing > 0.3:
        flags.append("script-mixing")
    return {"tokens": len(toks), "longest_repeat_run": run, "distinct_2": round(d2, 3), "u_fffd": fffd,
            "control_chars": ctrl, "script_mixing": round(mixing, 3),
            "eos_before_max": finish_reason == "stop" or (len(toks) < max_tokens and finish_reason != "length"),
            "flags": flags}


def agreement(outputs: list[dict[str, Any]], reference: list[dict[str, Any]]) -> dict[str, Any]:
    """Greedy agreement with the reference on the same prompts.

    Compares token ids when both sides have them, else characters of the text.

    Args:
        outputs / reference: ``[{"id", "text", "token_ids"}]`` in the same order.

    Returns:
        ``exact_match_rate``, ``mean_first_divergence`` (tokens or chars), per-prompt rows.
    """
    rows = []
    for out, ref in zip(outputs, reference):
        a, b = out.get("token_ids"), ref.get("token_ids")
        unit = "token"
        if not a or not b:
            a, b, unit = out.get("text", ""), ref.get("text", ""), "char"
        n = min(len(a), len(b))
        first = next((i for i in range(n) if a[i] != b[i]), None)
        exact = first is None and len(a) == len(b)
        if not exact and first is None and unit == "token" and abs(len(a) - len(b)) == 1 \
                and out.get("text") == ref.get("text"):
            # Engines differ in whether the final EOS id is streamed (vLLM and transformers send
            # it, ORT GenAI does not): one trailing id with identical text is the same output.
            exact = True
        rows.append({"id": out.get("id"), "exact": exact, "first_divergence": first if first is not None else (None if exact else n),
                     "unit": unit, "output": out.get("text"), "reference": ref.get("text")})
    divs = [r["first_divergence"] for r in rows if r["first_divergence"] is not None]
    return {"prompts": len(rows), "exact_match_rate": sum(r["exact"] for r in rows) / len(rows) if rows else None,
            "mean_first_divergence": sum(divs) / len(divs) if divs else None, "rows": rows}
