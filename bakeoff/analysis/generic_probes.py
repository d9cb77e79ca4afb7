"""Generic known-answer probes for models that ship none (any base or chat LM).

Six families with one checkable answer each, generated deterministically (seeded): counting,
the alphabet, number words, small arithmetic (few-shot), copying, key-value recall. Completion
form always; chat form too when the checkpoint has a chat template (rendered into the prompt
text with jinja2, as an OpenAI-compatible server renders it, so every backend sees the same
text through the completions API).

Completion probes are judged by prefix (the continuation starts with the answer, see
:func:`bakeoff.analysis.sanity.probe_correct`); chat probes by containment (the answer appears as a
word in the reply), since an instruction-tuned model wraps answers in prose.

Only the probes the reference answers correctly count when another backend is compared
with it (the evaluations decide that); a reference that fails most of them makes the
known-answer check a skip, not a disqualification of everyone.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

FAMILIES = ("count", "alphabet", "number-words", "arithmetic", "copy", "kv-recall")
PER_FAMILY = 40  # completion probes per family: 240 in all
CHAT_PER_FAMILY = 10
WORDS = ("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
         "seventeen eighteen nineteen twenty").split()
NOUNS = ("apple banana cherry river mountain window candle garden pencil silver orange rabbit violin "
         "castle forest engine planet rocket harbor bottle").split()
KEYS = ("cat dog sun car box hat pen cup key map bus egg fox owl tea").split()
LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


def _count(rng: random.Random) -> tuple[str, str, str]:
    start, shown = rng.randint(1, 80), rng.randint(5, 8)
    nums = [str(start + i) for i in range(shown)]
    return (", ".join(nums) + ",", f" {start + shown},",
            f"Continue the sequence with the next number only: {', '.join(nums)},")


def _alphabet(rng: random.Random) -> tuple[str, str, str]:
    start, shown = rng.randint(0, 17), rng.randint(5, 7)
    seq = LETTERS[start:start + shown]
    nxt = LETTERS[start + shown:start + shown + 2]
    return " ".join(seq), " " + " ".join(nxt), f"Which letter comes after {seq[-1]} in the alphabet? Answer with the letter."


def _number_words(rng: random.Random) -> tuple[str, str, str]:
    start, shown = rng.randint(0, 14), rng.randint(3, 6)
    seq = WORDS[start:start + shown]
    return " ".join(seq), f" {WORDS[start + shown]}", f"Continue counting in words: {' '.join(seq)}"


def _arithmetic(rng: random.Random) -> tuple[str, str, str]:
    shots = [(rng.randint(2, 20), rng.randint(2, 20)) for _ in range(3)]
    a, b = rng.randint(5, 49), rng.randint(5, 49)
    head = "".join(f"{x} + {y} = {x + y}\n" for x, y in shots)
    return f"{head}{a} + {b} =", f" {a + b}\n", f"What is {a} + {b}? Answer with the number."


def _copy(rng: random.Random) -> tuple[str, str, str]:
    words = " ".join(rng.sample(NOUNS, 3))
    return (f"Repeat: {words}. Repeat: {words}. Repeat:", f" {words}.",
            f"Repeat these three words exactly: {words}")


def _kv(rng: random.Random) -> tuple[str, str, str]:
    keys = rng.sample(KEYS, 4)
    vals = [rng.randint(0, 9) for _ in keys]
    q = rng.randrange(len(keys))
    pairs = ", ".join(f"{k}={v}" for k, v in zip(keys, vals))
    return (f"Remember: {pairs}. Question: what is {keys[q]}? Answer: {keys[q]}=", f"{vals[q]}",
            f"Remember: {pairs}. What is the value of {keys[q]}? Answer with the digit.")


_MAKERS = {"count": _count, "alphabet": _alphabet, "number-words": _number_words, "arithmetic": _arithmetic,
           "copy": _copy, "kv-recall": _kv}


def _chat_answer(family: str, expected: str) -> str:
    """The word a chat reply must contain (the completion answer without its punctuation)."""
    if family == "alphabet":
        return expected.split()[0]
    return expected.strip().rstrip(",.").strip()


def generic_probes(seed: int = 0, per_family: int = PER_FAMILY, chat_template: str | None = None,
                   special: dict[str, str] | None = None, chat_per_family: int = CHAT_PER_FAMILY) -> list[dict[str, Any]]:
    """The generic probe set.

    Args:
        seed: random seed.
        per_family: completion probes per family.
        chat_template: the checkpoint's jinja chat template; chat probes are added when given
            and it renders.
        special: ``bos_token`` / ``eos_token`` strings the template may use.
        chat_per_family: chat probes per family.

    Returns:
        ``[{"id", "task", "prompt", "expected", "match"}]``; ``match`` is ``prefix`` or ``contains``.
    """
    rng = random.Random(f"generic-{seed}")
    out: list[dict[str, Any]] = []
    chat: list[dict[str, Any]] = []
    for fam in FAMILIES:
        seen: set[str] = set()
        i = tries = 0
        while i < per_family and tries < 100 * per_family:  # a family smaller than asked stops short
            tries += 1
            prompt, expected, question = _MAKERS[fam](rng)
            if prompt in seen:
                continue
            seen.add(prompt)
            out.append({"id": f"g-{fam}-{i:02d}", "task": fam, "prompt": prompt, "expected": expected, "match": "prefix"})
            # a one-letter answer that is also a word ("I", "A") would be found in any reply
            if chat_template and len(chat) < chat_per_family * (FAMILIES.index(fam) + 1) \
                    and _chat_answer(fam, expected) not in ("I", "A"):
                chat.append({"id": f"g-chat-{fam}-{i:02d}", "task": f"chat-{fam}", "question": question,
                             "expected": _chat_answer(fam, expected), "match": "contains"})
            i += 1
    if chat:
        rendered = [render_chat(chat_template, [{"role": "user", "content": c.pop("question")}], special or {})
                    for c in chat]
        if all(r is not None for r in rendered):
            out += [{**c, "prompt": r} for c, r in zip(chat, rendered)]
    return out


def render_chat(template: str, messages: list[dict[str, str]], special: dict[str, str]) -> str | None:
    """The prompt text a server renders for ``messages`` with ``add_generation_prompt``; None
    when the template does not render in a sandboxed jinja2 environment."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(msg: str) -> None:
        raise jinja2.TemplateError(msg)

    try:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        return env.from_string(template).render(messages=messages, add_generation_prompt=True,
                                                bos_token=special.get("bos_token", ""),
                                                eos_token=special.get("eos_token", ""))
    except Exception:  # a template with extensions this renderer lacks: no chat probes
        return None


def chat_template_of(model_dir: str | Path) -> tuple[str | None, dict[str, str]]:
    """``(chat template, {bos_token, eos_token})`` of a local checkpoint (``tokenizer_config.json``
    or ``chat_template.jinja``), or ``(None, {})``."""
    folder = Path(model_dir)
    special: dict[str, str] = {}
    template = None
    try:
        cfg = json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        cfg = {}
    if isinstance(cfg, dict):
        t = cfg.get("chat_template")
        if isinstance(t, list):  # named templates: the default one
            t = next((x.get("template") for x in t if isinstance(x, dict) and x.get("name") == "default"), None)
        template = t if isinstance(t, str) else None
        for k in ("bos_token", "eos_token"):
            v = cfg.get(k)
            v = v.get("content") if isinstance(v, dict) else v
            if isinstance(v, str):
                special[k] = v
    jinja_file = folder / "chat_template.jinja"
    if template is None and jinja_file.is_file():
        try:
            template = jinja_file.read_text()
        except OSError:
            template = None
    return template, special
