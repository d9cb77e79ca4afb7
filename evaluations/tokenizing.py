"""The reference's token ids for the sanity prompts, and where an engine's ids differ from them.

Helpers of ``evaluations/test_tokenizer.py`` (the ``sanity.tokenizer`` check), kept apart so the
framework's tests can use them without the plugin.

Like with like: each side gives the ids its generation starts from. The reference is the
transformers ``AutoTokenizer`` of the reference model with the reference's
``trust_remote_code`` (what :mod:`backends.transformers.worker` loads for the reference run),
called as that worker calls it, ``tok(prompt)``: the special tokens it adds by default, so a
BOS where the checkpoint's tokenizer adds one. A chat run's prompts are one user message
each, rendered with the reference tokenizer's chat template and the generation prompt,
tokenized without further special tokens (the template carries them), as vLLM's chat route does.
"""

from __future__ import annotations

from typing import Any, Callable

from bakeoff.analysis.sanity import top_map
from evaluations.probing import open_ended_prompts


def sanity_prompts(items) -> list[str]:
    """The prompts the sanity checks send (the probes', then the open-ended ones), each once."""
    return list(dict.fromkeys([p.prompt for p in items] + open_ended_prompts(items)))


def uses_chat(engine) -> bool:
    """Whether the backend sends prompts as chat messages (its client's ``chat`` or ``messages`` API)."""
    return engine.api in ("chat", "messages")


def reference_tokenizer(path: str, trust_remote_code: bool = False) -> tuple[Any | None, str]:
    """``(tokenizer, '')`` of the reference model, or ``(None, why)`` when it does not load or is empty."""
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as exc:  # noqa: BLE001 - any loader failure means: cannot compare
        return None, f"the reference tokenizer of {path} does not load: {type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
    if len(tok) == 0:  # transformers 5 builds an empty tokenizer when a checkpoint has no tokenizer files
        return None, f"the reference model {path} has no tokenizer (transformers built an empty one)"
    return tok, ""


def added_special_ids(tok) -> list[int]:
    """The special ids the reference adds around a text prompt (e.g. ``[bos]``; ``[]`` for Qwen)."""
    plain = tok("a", add_special_tokens=False)["input_ids"]
    return [t for t in tok("a")["input_ids"] if t not in plain]


def reference_ids(tok, texts: list[str], chat: bool) -> tuple[list[list[int]] | None, str]:
    """The reference's ids for each text (module docstring), or ``(None, why)``."""
    if not chat:
        return [list(tok(t)["input_ids"]) for t in texts], ""
    if not getattr(tok, "chat_template", None):
        return None, "the reference tokenizer has no chat template to render chat prompts with"
    return [list(tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                         tokenize=True, return_dict=False)) for t in texts], ""


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first position where ``a`` and ``b`` differ (the shorter one's length when one
    is a prefix of the other), None when they are equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def describer(tok) -> Callable[[int | None], dict[str, Any] | None]:
    """``id -> {"id", "piece", "text"}`` by the reference tokenizer (None past the end of a list)."""
    def describe(tid: int | None) -> dict[str, Any] | None:
        if tid is None:
            return None
        try:
            return {"id": tid, "piece": tok.convert_ids_to_tokens(tid), "text": tok.decode([tid])}
        except Exception:  # noqa: BLE001 - an id outside the reference's vocabulary
            return {"id": tid, "piece": None, "text": None}
    return describe


def mismatches(texts: list[str], want: list[list[int]], got: list[list[int]], form: str,
               describe: Callable[[int | None], dict[str, Any] | None], special_ids: set[int] = frozenset()) -> list[dict]:
    """One row per text whose ids differ: both id lists, the first differing position and the
    token each side has there (decoded with the reference tokenizer), and a note when the only
    difference is one leading special token (a BOS one side adds)."""
    rows = []
    for text, w, g in zip(texts, want, got):
        i = first_difference(w, g)
        if i is None:
            continue
        note = ""
        if g[1:] == w and g and g[0] in special_ids:
            note = f"only a leading special token differs: the engine adds id {g[0]}, the reference does not"
        elif w[1:] == g and w and w[0] in special_ids:
            note = f"only a leading special token differs: the reference adds id {w[0]}, the engine does not"
        rows.append({"form": form, "prompt": text, "reference_ids": w, "engine_ids": g, "first_difference": i,
                     "reference_token": describe(w[i] if i < len(w) else None),
                     "engine_token": describe(g[i] if i < len(g) else None), "note": note})
    return rows


def example(row: dict) -> str:
    """One line naming a mismatch: the prompt, the position, both tokens."""
    def name(t: dict | None) -> str:
        return "(end)" if t is None else f"{t['piece']!r} (id {t['id']})"
    return (f"{row['prompt'][:60]!r} ({row['form']}): token {row['first_difference']} is "
            f"{name(row['reference_token'])} in the reference, {name(row['engine_token'])} in the engine"
            + (f"; {row['note']}" if row["note"] else ""))


def text_token_ids(tok) -> dict[str, int | None]:
    """``{decoded text of one id: that id}`` over ``tok``'s vocabulary; a text several ids decode to
    maps to None (ambiguous: byte-fallback pieces, duplicates)."""
    out: dict[str, int | None] = {}
    for i in range(len(tok)):
        text = tok.decode([i])
        out[text] = None if text in out else i
    return out


def map_text_logprobs(outputs: list[dict], tok) -> dict[str, Any]:
    """Token ids for outputs an engine streamed with logprobs keyed by token text and no ids
    (llama-cpp-python's server), so that the tie rule compares ids with the reference's
    (:func:`bakeoff.analysis.sanity.compare_tie_aware`).

    A text maps to the one id of ``tok`` (the reference's tokenizer) that decodes to it. An output
    is mapped only when every chosen token maps and the ids decode to the streamed text; its top
    alternatives keep the ones that map. Otherwise it stays as streamed (its divergences
    undetermined, saying why). Outputs are changed in place (``token_ids_from`` says so).

    Returns:
        ``{"outputs": with text logprobs and no ids, "mapped": count, "unmapped": [{"id", "why"}]}``.
    """
    todo = [o for o in outputs if not o.get("token_ids") and o.get("logprobs")
            and all(not e or isinstance(e[0], str) for e in o["logprobs"])]
    if not todo:
        return {"outputs": 0, "mapped": 0, "unmapped": []}
    ids = text_token_ids(tok)
    unmapped = [{"id": o.get("id"), "why": why} for o in todo if (why := _map_one(o, ids, tok))]
    return {"outputs": len(todo), "mapped": len(todo) - len(unmapped), "unmapped": unmapped[:20]}


def _map_one(o: dict, ids: dict[str, int], tok) -> str | None:
    """One output of :func:`map_text_logprobs` mapped in place; why not, when it cannot be."""
    chosen = [ids.get(e[0]) if e and isinstance(e[0], str) and len(e) >= 2 else None for e in o["logprobs"]]
    if any(c is None for c in chosen):
        return "a token text no single id of the tokenizer decodes to"
    if tok.decode(chosen) != (o.get("text") or ""):
        return "the mapped ids do not decode to the streamed text"
    o["logprobs"] = [None if e is None else [c, e[1], [[ids[t], v] for t, v in top_map(e).items()
                                                         if isinstance(t, str) and ids.get(t) is not None]]
                     for c, e in zip(chosen, o["logprobs"])]
    o["token_ids"], o["token_ids_from"] = chosen, "text logprobs, mapped with the reference's tokenizer"
    return None
