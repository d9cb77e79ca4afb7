"""The generic known-answer probes (``bakeoff/analysis/generic_probes.py``): families and counts,
determinism, one answer per probe, answers right by construction, the chat form.

Engine-free. That the transformers reference answers them on a real small model is measured by
``benchmarks/probe_families.py`` (figures in the module's docstring), not here: it needs a model.
"""

from __future__ import annotations

import calendar
import json
import re
from collections import Counter

import pytest

from bakeoff.analysis import probe_tables as T
from bakeoff.analysis.generic_probes import (CHAT_PER_FAMILY, CHAT_SHOTS, FAMILIES, FAMILY, PER_FAMILY, chat_template_of,
                                             generic_probes, render_chat)

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TABLES = {"capital": (T.CAPITALS, r"The capital of (.+) is"), "language": (T.LANGUAGES, r"In (.+), people speak"),
          "plural": (T.PLURALS, r"The plural of (.+) is"), "opposite": (T.OPPOSITES, r"The opposite of (.+) is")}
CHAT_FAMILIES = [f for f in FAMILIES if FAMILY[f].chat]


@pytest.fixture(scope="module")
def with_template(tmp_path_factory):
    folder = tmp_path_factory.mktemp("chatml")
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML, "eos_token": "<|im_end|>"}))
    template, special = chat_template_of(folder)
    return generic_probes(chat_template=template, special=special)


def test_families_and_counts_are_the_stated_ones_and_seeded():
    probes = generic_probes()
    assert FAMILIES == ("count", "copy", "kv-recall", "months", "capital", "language", "plural", "opposite")
    assert Counter(p["task"] for p in probes) == {f: PER_FAMILY for f in FAMILIES} and PER_FAMILY == 30
    assert all(p["match"] == "prefix" for p in probes)  # no template: completion form only
    assert len({p["id"] for p in probes}) == len(probes) == len({p["prompt"] for p in probes})
    assert probes == generic_probes()  # seeded
    other = generic_probes(seed=1)
    assert [p["prompt"] for p in other] != [p["prompt"] for p in probes]
    # one random stream per family: asking fewer probes keeps the first ones
    assert generic_probes(per_family=5) == [p for p in probes if int(p["id"].rsplit("-", 1)[1]) < 5]
    # a family smaller than asked stops short: 30 languages, 36 month runs
    many = Counter(p["task"] for p in generic_probes(per_family=40))
    assert many["language"] == len(T.LANGUAGES) == 30 and many["months"] == 36 and many["count"] == 40


def _answer(p: dict) -> str:
    """The probe's answer worked out from its prompt alone (and, for the tables, the table)."""
    prompt, fam = p["prompt"], p["task"]
    if fam == "count":
        nums = [int(x) for x in prompt.rstrip(",").split(", ")]
        assert nums == list(range(nums[0], nums[0] + len(nums)))
        return f" {nums[-1] + 1},"
    if fam == "copy":
        m = re.fullmatch(r"Repeat: (\w+ \w+ \w+)\. Repeat: \1\. Repeat:", prompt)
        return f" {m.group(1)}."
    if fam == "kv-recall":
        head, *recalled, asked = prompt.split("\n")
        pairs = dict(kv.split("=") for kv in re.fullmatch(r"Remember: (.+)\.", head).group(1).split(", "))
        assert len(pairs) == 4 and len(set(pairs.values())) == 4  # distinct digits: one key has the answer
        assert all(pairs[k] == v for k, v in (r.split("=") for r in recalled)) and len(recalled) == 2
        key = asked.rstrip("=")
        assert key not in [r.split("=")[0] for r in recalled]
        return pairs[key]
    if fam == "months":  # checked against the calendar module, not the table
        *shown, asked = prompt.split("\n")
        numbers = [int(line.split(". ")[0]) for line in shown] + [int(asked.rstrip("."))]
        assert all(b == a % 12 + 1 for a, b in zip(numbers, numbers[1:]))  # consecutive, December -> January
        assert [line.split(". ")[1] for line in shown] == [calendar.month_name[n] for n in numbers[:-1]]
        return f" {calendar.month_name[numbers[-1]]}"
    table, pattern = TABLES[fam]
    *shots, asked = prompt.split("\n")
    for line in shots:
        key, value = re.fullmatch(pattern + r" (.+)\.", line).groups()
        assert table[key] == value
    key = re.fullmatch(pattern, asked).group(1)
    assert not re.search(rf"\b{table[key]}\b", prompt)  # the answer is never shown
    return f" {table[key]}."


def test_every_expected_answer_is_right_by_construction():
    probes = generic_probes(per_family=40)
    for p in probes:
        assert p["expected"].strip() and _answer(p) == p["expected"], p


def test_the_tables_have_one_answer_per_entry():
    for name, table in [("capital", T.CAPITALS), ("language", T.LANGUAGES), ("plural", T.PLURALS), ("opposite", T.OPPOSITES)]:
        assert len(set(table.values())) == len(table), name  # distinct answers: a shot never shows the asked one
        assert not set(table) & set(table.values()) or name == "opposite", name
        assert all(k != v and v.strip() == v and v for k, v in table.items()), name
    for k, v in T.OPPOSITES.items():  # an opposite that is also asked maps back
        assert T.OPPOSITES.get(v, k) == k, (k, v)
    irregular = {"leaf", "knife", "wolf", "child", "man", "woman", "mouse", "foot", "tooth", "goose", "person"}
    for word, plural in T.PLURALS.items():  # the regular ones follow the spelling rule
        if word in irregular:
            assert plural != word + "s"
        elif re.search(r"(s|x|ch|sh)$", word):
            assert plural == word + "es", word
        elif re.search(r"[^aeiou]y$", word):
            assert plural == word[:-1] + "ies", word
        else:
            assert plural == word + "s", word
    assert list(T.MONTHS) == list(calendar.month_name)[1:]
    assert len(set(T.NOUNS)) == len(T.NOUNS) and len(set(T.KEYS)) == len(T.KEYS)


def test_chat_form_renders_through_a_chatml_template(with_template):
    assert [p for p in with_template if p["match"] == "prefix"] == generic_probes()  # completion: as without one
    chat_probes = [p for p in with_template if p["match"] == "contains"]
    assert Counter(p["task"] for p in chat_probes) == {f"chat-{f}": CHAT_PER_FAMILY for f in CHAT_FAMILIES}
    assert CHAT_FAMILIES == ["copy", "capital", "language", "plural", "opposite"]
    assert len({p["id"] for p in chat_probes}) == len(chat_probes) == 60
    for p in chat_probes:
        assert p["prompt"].startswith("<|im_start|>user\n") and p["prompt"].endswith("<|im_end|>\n<|im_start|>assistant\n")
        fam = p["task"].removeprefix("chat-")
        *turns, last = p["prompt"].split("<|im_start|>user\n")[1:]
        assert len(turns) == CHAT_SHOTS == 1  # one answered turn, then the question
        for turn in turns:  # a question and its answer, which is not the asked one
            assert turn.count("<|im_end|>\n<|im_start|>assistant\n") == 1
            assert not re.search(r"(?<![0-9A-Za-z])" + re.escape(p["expected"]) + r"(?![0-9A-Za-z])", turn), p
        assert last.startswith("Repeat exactly: " if fam == "copy" else "What ")
        if fam != "copy":  # an echo of the question does not contain the answer
            assert not re.search(r"(?<![0-9A-Za-z])" + re.escape(p["expected"]) + r"(?![0-9A-Za-z])", last), p
    completion = {p["id"]: p for p in generic_probes()}
    for p in chat_probes:  # the chat probes ask their family's first items
        twin = completion[p["id"].replace("g-chat-", "g-")]
        assert twin["expected"].strip(" .") == p["expected"]


def test_a_template_that_does_not_render_gives_no_chat_probes(tmp_path):
    assert render_chat("{{ raise_exception('no') }}", [], {}) is None
    assert all(p["match"] == "prefix" for p in generic_probes(chat_template="{{ raise_exception('no') }}"))
    assert chat_template_of(tmp_path / "missing") == (None, {})
