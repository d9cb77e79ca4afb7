"""The judge's reference answers are kept (evaluations/judging.py): a second run asking the same
questions of the same reference does not start it, and gets the same answers; another model or
other options, a new question or a damaged entry ask the reference again.

The reference here is a stand-in that counts its starts and calls; the real judge runs in
tests/test_gallery.py and every engine's qualification.
"""

from __future__ import annotations

import pytest

from evaluations.judging import ReferenceAnswers


class Reference:
    base_url = "http://reference"

    def __init__(self):
        self.starts = self.scores = self.generations = 0

    def start(self):
        self.starts += 1
        return self

    def score(self, base_url, prompt, ids, text, top_k):
        assert base_url == self.base_url
        self.scores += 1
        return {"logprobs": [-0.5] * len(ids or text), "top_logprobs": [[["x", -0.1]]] * top_k, "prompt": prompt}

    def generate(self, backend, prompts):
        assert backend is self
        self.generations += len(prompts)
        return [{"status": "ok", "output_token_ids": [len(p)], "output_text": p[::-1]} for _, p, _ in prompts]


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("BAKEOFF_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _ask(ref: Reference, key: list, extra: bool = False) -> list:
    answers = ReferenceAnswers(key, ref.start, ref.score, ref.generate)
    out = [answers.generate([("0", "count: 1 2", 8), ("1", "copy: ab =>", 8)]),
           answers.score("count: 1 2", [5, 6], "", top_k=0), answers.score("copy: ab =>", None, " ab", top_k=3)]
    if extra:
        out.append(answers.score("keys: aF ; a", [9], "", top_k=3))
    return out + [(answers.asked, answers.cached, answers.backend is not None)]


def test_a_second_run_does_not_start_the_reference_and_gets_the_same_answers():
    ref = Reference()
    first = _ask(ref, ["model", [["config.json", 1, 2]], {}])
    assert first[-1] == (4, 0, True) and (ref.starts, ref.scores, ref.generations) == (1, 2, 2)
    again = _ask(ref, ["model", [["config.json", 1, 2]], {}])
    assert again[-1] == (4, 4, False) and (ref.starts, ref.scores, ref.generations) == (1, 2, 2)
    assert again[:-1] == first[:-1]


@pytest.mark.parametrize("key", [["model", [["config.json", 1, 3]], {}],  # the model's files changed
                                 ["model", [["config.json", 1, 2]], {"dtype": "float32"}],  # other options
                                 ["other", [["config.json", 1, 2]], {}]])
def test_another_reference_is_asked_again(key):
    ref = Reference()
    _ask(ref, ["model", [["config.json", 1, 2]], {}])
    assert _ask(ref, key)[-1] == (4, 0, True) and ref.starts == 2


def test_a_new_question_starts_the_reference_once_for_it_alone():
    ref = Reference()
    _ask(ref, ["m", [], {}])
    assert _ask(ref, ["m", [], {}], extra=True)[-1] == (5, 4, True)
    assert (ref.starts, ref.scores, ref.generations) == (2, 3, 2)


def test_a_damaged_or_foreign_entry_is_asked_again(cache):
    ref = Reference()
    _ask(ref, ["m", [], {}])
    entries = sorted((cache / "judge").glob("*/*.json"))
    assert len(entries) == 4
    entries[0].write_text("{not json")
    entries[1].write_text('{"question": ["score", "another prompt"], "answer": {"logprobs": []}}')
    assert _ask(ref, ["m", [], {}])[-1] == (4, 2, True)


def test_a_failed_generation_is_not_kept():
    ref = Reference()
    ref.generate = lambda backend, prompts: [{"status": "error", "output_token_ids": None, "output_text": ""}
                                             for _ in prompts]
    answers = ReferenceAnswers(["m", [], {}], ref.start, ref.score, ref.generate)
    assert answers.generate([("0", "p", 4)])[0]["status"] == "error"
    again = ReferenceAnswers(["m", [], {}], ref.start, ref.score, ref.generate)
    again.generate([("0", "p", 4)])
    assert again.cached == 0 and ref.starts == 2


def test_the_kl_report_scores_a_spread_sample_of_the_probe_outputs():
    from evaluations.test_judge import KL_PROBES, kl_sample

    outs = [{"id": f"g-{fam}-{i}"} for fam in ("count", "copy", "kv", "chat") for i in range(75)]
    got = kl_sample(outs)
    assert len(got) == KL_PROBES == 32 and len({o["id"] for o in got}) == 32
    assert {o["id"].split("-")[1] for o in got} == {"count", "copy", "kv", "chat"}  # every family
    assert kl_sample(outs[:10]) == outs[:10]
