"""Generic known-answer probes for models that ship none (any base or chat LM).

Eight families, each item with exactly one checkable answer, generated deterministically
(seeded, one random stream per family) from :mod:`bakeoff.analysis.probe_tables`:

- ``count``: ``12, 13, 14, 15, 16,`` -> `` 17,`` (start 1-80, five to eight numbers shown);
- ``copy``: ``Repeat: X. Repeat: X. Repeat:`` -> `` X.`` (three distinct nouns);
- ``kv-recall``: four ``key=digit`` pairs (distinct digits), two of them recalled on their own
  lines, then a third key's value;
- ``months``: a numbered list of three to five months (``3. March``) -> the next one;
- ``capital``, ``language``, ``plural``, ``opposite``: three solved sentences, then the fourth
  to finish (``The capital of Peru is`` -> `` Lima.``), from tables of unambiguous answers.

Completion form: 30 probes a family (240; a family whose table is smaller stops short). Chat
form, when the checkpoint has a chat template: 12 probes for each of copy, capital, language,
plural and opposite (60), rendered into the prompt text with jinja2 as an OpenAI-compatible
server renders it (so every backend sees the same text through the completions API). Each asks
its question after one answered turn (``Repeat exactly: a b c`` / ``a b c``; ``What is the
plural of "mouse"?`` / ``The plural of "mouse" is "mice".``), which fixes the reply's shape
(with none, 45/60; with one or three, 55/60).
count, kv-recall and months have no chat form: asked in chat, SmolLM2-135M-Instruct answered
them 50-83% of the time in every form tried, and where it answered most (count, the sequence in
one user turn) the reply's first token was a near-tie in 23 of 25 answers and bfloat16 lost
three of them; a kv-recall reply that echoes the pairs would contain any answer.

Completion probes are judged by prefix (the continuation starts with the answer, see
:func:`bakeoff.analysis.sanity.probe_correct`); chat probes by containment (the answer appears as a
word in the reply), since an instruction-tuned model wraps answers in prose.

What a known-answer verdict on generic probes rests on (``sanity.known_answers``): only the
probes the transformers reference answers count against the backend; the backend's per-probe
correctness is paired with the reference's and a drop disqualifies only when the exact McNemar
test finds it significant and larger than the tolerance (:mod:`bakeoff.analysis.paired`). A
reference that answers fewer than ``MIN_BASELINE_ACCURACY`` (evaluations/reference.py, 50%) of
the set cannot judge: the check skips instead of disqualifying everyone.

Measured (``benchmarks/probe_families.py``, transformers greedy on CPU, SmolLM2-135M-Instruct;
the previous families, alphabet / number words / two-digit sums / a one-question chat form,
gave 49% in all and every engine's check skipped):

=========== ================ ================ =====================================
form         float32          bfloat16         near-ties (< 0.5 nats) among the right
=========== ================ ================ =====================================
completion   229/240 (95.4%)  230/240 (95.8%)  8 (fp32), 6 (bf16), at the answer's token
chat          53/60 (88.3%)    54/60 (90.0%)   0 and 1 at the answer; 5 and 7 in the prose
                                                before it (chat-language)
all          282/300 (94.0%)  284/300 (94.7%)
=========== ================ ================ =====================================

(2026-12-05, AMD EPYC with avx512_bf16, ``--batch 1``, one answered chat turn; per family
75-100%, the weakest ``chat-plural`` 9/12 and ``opposite`` 25/30. Three answered turns gave chat
55/60 in both dtypes at 1.8x the chat prompts' tokens.) Both are far above the 50% bar, so a host's numerics
cannot move the model across it; the few near-ties are the tie rule's to judge.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from bakeoff.analysis.probe_tables import CAPITALS, KEYS, LANGUAGES, MONTHS, NOUNS, OPPOSITES, PLURALS

FAMILIES = ("count", "copy", "kv-recall", "months", "capital", "language", "plural", "opposite")
PER_FAMILY = 30  # completion probes per family: 240 in all
CHAT_PER_FAMILY = 12  # per family with a chat form: 60 in all
SHOTS = 3  # solved sentences before the asked one (completion form)
# answered turns before the asked question (chat form). One turn fixes the reply's shape as well as
# three did on SmolLM2-135M-Instruct (55/60 either way) at 55% of the prompt tokens: the chat probes'
# 6,942 tokens were 53% of the whole set's prefill, and the probes' prefill is most of their time.
CHAT_SHOTS = 1


@dataclass(frozen=True)
class Family:
    """How one family makes its probes.

    Attributes:
        draw: one item from the family's random stream (hashable; an item is used once).
        completion: ``(item, rng) -> (prompt, expected)``, the completion form.
        answer: the word(s) a chat reply must contain.
        chat: whether the family has a chat form: its question after :data:`CHAT_SHOTS` answered turns.
        question: the chat question of an item.
        solved: an item's question answered.
    """

    draw: Callable[[random.Random], Any]
    completion: Callable[[Any, random.Random], tuple[str, str]]
    answer: Callable[[Any], str]
    chat: bool = False
    question: Callable[[Any], str] | None = None
    solved: Callable[[Any], str] | None = None


def _count(rng: random.Random) -> tuple[int, int]:
    return rng.randint(1, 80), rng.randint(5, 8)


def _count_prompt(item: tuple[int, int], rng: random.Random) -> tuple[str, str]:
    start, shown = item
    return ", ".join(str(start + i) for i in range(shown)) + ",", f" {start + shown},"


def _copy_prompt(item: tuple[str, ...], rng: random.Random) -> tuple[str, str]:
    words = " ".join(item)
    return f"Repeat: {words}. Repeat: {words}. Repeat:", f" {words}."


def _kv(rng: random.Random) -> tuple[tuple[str, ...], tuple[int, ...], tuple[int, ...]]:
    keys = tuple(rng.sample(KEYS, 4))  # distinct values: a copied neighbour is always wrong
    return keys, tuple(rng.sample(range(10), 4)), tuple(rng.sample(range(4), 3))


def _kv_prompt(item, rng: random.Random) -> tuple[str, str]:
    keys, vals, order = item
    pairs = ", ".join(f"{k}={v}" for k, v in zip(keys, vals))
    recalled = "".join(f"{keys[i]}={vals[i]}\n" for i in order[:2])
    return f"Remember: {pairs}.\n{recalled}{keys[order[2]]}=", f"{vals[order[2]]}"


def _months(rng: random.Random) -> tuple[int, int]:
    return rng.randrange(12), rng.randint(3, 5)


def _months_prompt(item: tuple[int, int], rng: random.Random) -> tuple[str, str]:
    start, shown = item
    months = [(start + i) % 12 for i in range(shown)]
    nxt = (start + shown) % 12
    return "".join(f"{m + 1}. {MONTHS[m]}\n" for m in months) + f"{nxt + 1}.", f" {MONTHS[nxt]}"


def _table(table: dict[str, str], sentence: str, question: str, solved: str) -> Family:
    """A family of :data:`SHOTS` solved sentences then the asked one; ``sentence`` and
    ``solved`` are formats of ``k`` and ``v``, ``question`` of ``k``."""

    def completion(key: str, rng: random.Random) -> tuple[str, str]:
        shots = rng.sample([k for k in table if k != key], SHOTS)  # answers are distinct within a table
        head = "".join(sentence.format(k=k, v=f" {table[k]}") + ".\n" for k in shots)
        return head + sentence.format(k=key, v=""), f" {table[key]}."

    return Family(draw=lambda rng: rng.choice(list(table)), completion=completion, answer=table.__getitem__,
                  chat=True, question=lambda k: question.format(k=k),
                  solved=lambda k: solved.format(k=k, v=table[k]))


FAMILY = {
    "count": Family(_count, _count_prompt, lambda it: str(it[0] + it[1])),
    "copy": Family(lambda rng: tuple(rng.sample(NOUNS, 3)), _copy_prompt, " ".join, chat=True,
                   question=lambda it: "Repeat exactly: " + " ".join(it), solved=" ".join),
    "kv-recall": Family(_kv, _kv_prompt, lambda it: str(it[1][it[2][2]])),
    "months": Family(_months, _months_prompt, lambda it: MONTHS[(it[0] + it[1]) % 12]),
    "capital": _table(CAPITALS, "The capital of {k} is{v}", "What is the capital of {k}?",
                      "The capital of {k} is {v}."),
    "language": _table(LANGUAGES, "In {k}, people speak{v}", "What language do people speak in {k}?",
                       "People in {k} speak {v}."),
    "plural": _table(PLURALS, "The plural of {k} is{v}", 'What is the plural of "{k}"?',
                     'The plural of "{k}" is "{v}".'),
    "opposite": _table(OPPOSITES, "The opposite of {k} is{v}", 'What is the opposite of "{k}"?',
                       'The opposite of "{k}" is "{v}".'),
}


def _chat_messages(fam: Family, item: Any, rng: random.Random) -> list[dict[str, str]]:
    """:data:`CHAT_SHOTS` other items asked and answered, then ``item`` asked."""
    shots: list[Any] = []
    while len(shots) < CHAT_SHOTS:
        s = fam.draw(rng)
        if s != item and s not in shots and fam.answer(s) != fam.answer(item):
            shots.append(s)
    msgs: list[dict[str, str]] = []
    for s in shots:
        msgs += [{"role": "user", "content": fam.question(s)}, {"role": "assistant", "content": fam.solved(s)}]
    return msgs + [{"role": "user", "content": fam.question(item)}]


def generic_probes(seed: int = 0, per_family: int = PER_FAMILY, chat_template: str | None = None,
                   special: dict[str, str] | None = None, chat_per_family: int = CHAT_PER_FAMILY) -> list[dict[str, Any]]:
    """The generic probe set.

    Args:
        seed: random seed.
        per_family: completion probes per family (fewer where a family has fewer items).
        chat_template: the checkpoint's jinja chat template; chat probes are added when given
            and it renders.
        special: ``bos_token`` / ``eos_token`` strings the template may use.
        chat_per_family: chat probes per family with a chat form (its first items).

    Returns:
        ``[{"id", "task", "prompt", "expected", "match"}]``, and ``messages`` for a chat probe (its raw
        messages; ``prompt`` is them rendered); ``match`` is ``prefix`` or ``contains``.
    """
    out: list[dict[str, Any]] = []
    chat: list[tuple[dict[str, Any], list[dict[str, str]]]] = []
    for name in FAMILIES:
        fam = FAMILY[name]
        rng = random.Random(f"generic-{seed}-{name}")
        chat_rng = random.Random(f"generic-{seed}-{name}-chat")  # the completion probes do not depend on a template
        seen: set[Any] = set()
        tries = 0
        while len(seen) < per_family and tries < 100 * per_family:  # a family smaller than asked stops short
            tries += 1
            item = fam.draw(rng)
            if item in seen:
                continue
            i = len(seen)
            seen.add(item)
            prompt, expected = fam.completion(item, rng)
            out.append({"id": f"g-{name}-{i:02d}", "task": name, "prompt": prompt, "expected": expected, "match": "prefix"})
            if chat_template and fam.chat and i < chat_per_family:
                chat.append(({"id": f"g-chat-{name}-{i:02d}", "task": f"chat-{name}", "expected": fam.answer(item),
                              "match": "contains"}, _chat_messages(fam, item, chat_rng)))
    if chat:
        rendered = [render_chat(chat_template, msgs, special or {}) for _, msgs in chat]
        if all(r is not None for r in rendered):
            out += [{**c, "prompt": r, "messages": msgs} for (c, msgs), r in zip(chat, rendered)]
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
