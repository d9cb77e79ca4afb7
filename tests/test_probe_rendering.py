"""Each side renders the chat probes with its own model's template (``evaluations/reference.py``
:func:`probe_set_of`): the engine under test with ``--model``'s, the reference with its own,
same ids in the same order; the reference's outputs are keyed by the prompts it saw."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from bakeoff.models.resolve import ResolvedModel
from evaluations.reference import probe_set_of, reference_cache_key
from tests.fakes.broken_checkpoints import LLAMA2_TEMPLATE

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _model(folder: Path, template: str | None) -> ResolvedModel:
    folder.mkdir()
    cfg = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}
    (folder / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": template} if template else cfg))
    return ResolvedModel(label=folder.name, path=str(folder), local=True)


def _settings(model: ResolvedModel, reference: ResolvedModel) -> SimpleNamespace:
    return SimpleNamespace(model=model, reference_model=reference, reference_options={"device": "cpu"})


def test_one_model_renders_once(tmp_path):
    real = _model(tmp_path / "real", CHATML)
    s = probe_set_of(_settings(real, real))
    assert s.backend == s.reference and s.source == "generic" and not s.differing_ids()
    assert s.rendering["prompts_differ"] == 0 and s.rendering["templates_identical"] is True
    assert any("<|im_start|>assistant" in p.prompt for p in s.reference)  # chat probes there


def test_a_wrong_template_renders_the_engines_chat_probes_otherwise(tmp_path):
    real, wrong = _model(tmp_path / "real", CHATML), _model(tmp_path / "wrong", LLAMA2_TEMPLATE)
    s = probe_set_of(_settings(wrong, real))
    assert [p.id for p in s.backend] == [p.id for p in s.reference]  # paired probe by probe
    chat = {p.id for p in s.reference if "<|im_start|>assistant" in p.prompt}
    assert chat and s.differing_ids() == chat and s.rendering["prompts_differ"] == len(chat)
    for b, r in zip(s.backend, s.reference):
        assert (b.expected, b.match, b.task) == (r.expected, r.match, r.task)
        assert ("[INST]" in b.prompt) == (b.id in chat) and "[INST]" not in r.prompt
    first = s.rendering["first_difference"]
    assert first["engine_prompt"].startswith("<|im_start|>[INST] ") and first["reference_prompt"].endswith("assistant\n")
    assert s.rendering["chat_template"] == "the model under test's" and s.rendering["templates_identical"] is False
    # the reference's outputs are keyed by what it computes: its own rendering, whatever the engine is sent
    same = probe_set_of(_settings(real, real))
    assert reference_cache_key(_settings(wrong, real), s) == reference_cache_key(_settings(real, real), same)
    swapped = probe_set_of(_settings(real, wrong))  # the [INST] rendering on the reference's side
    assert reference_cache_key(_settings(real, real), swapped) != reference_cache_key(_settings(real, real), same)


def test_a_model_without_a_template_is_sent_the_references_rendering(tmp_path):
    real, bare = _model(tmp_path / "real", CHATML), _model(tmp_path / "bare", None)
    s = probe_set_of(_settings(bare, real))
    assert s.backend == s.reference and "carries no chat template" in s.rendering["chat_template"]


def test_a_template_that_does_not_render_here_falls_back_saying_so(tmp_path):
    real, odd = _model(tmp_path / "real", CHATML), _model(tmp_path / "odd", "{{ raise_exception('no') }}")
    s = probe_set_of(_settings(odd, real))
    assert s.backend == s.reference and "does not render here" in s.rendering["chat_template"]


def test_chat_probes_only_the_engines_template_gives_are_left_out(tmp_path):
    bare, chat = _model(tmp_path / "bare", None), _model(tmp_path / "chat", CHATML)
    s = probe_set_of(_settings(chat, bare))
    assert [p.id for p in s.backend] == [p.id for p in s.reference] and not s.differing_ids()
    assert not any("<|im_start|>" in p.prompt for p in s.backend) and "engine-only" in s.rendering["left_out"]


def test_template_effect_needs_the_differently_rendered_probes_to_diverge_more():
    """The rule of ``sanity.reference_agreement`` for a chat template that differs from the
    reference's: real divergences among those probes against those rendered alike (Fisher exact,
    one-sided, p < 0.01, a gap of 25 points or more)."""
    from bakeoff.analysis.paired import fisher_greater
    from evaluations.test_sanity import template_effect

    def rows(chat_real: int, alike_real: int) -> list[dict]:
        chat = [{"id": f"c{i}", "outcome": "real" if i < chat_real else "exact"} for i in range(60)]
        alike = [{"id": f"a{i}", "outcome": "real" if i < alike_real else "tie"} for i in range(240)]
        return chat + alike

    chat_ids = {f"c{i}" for i in range(60)}
    wrong = template_effect(rows(60, 0), chat_ids)  # the real-model double: every chat reply diverges
    assert wrong["template_changes_answers"] and wrong["p_value"] < 1e-30
    assert not template_effect(rows(3, 10), chat_ids)["template_changes_answers"]  # diverging alike: noise
    int4 = template_effect(rows(40, 130), chat_ids)  # a quantized engine diverging everywhere: 67% vs 54%
    assert not int4["template_changes_answers"]
    assert not template_effect(rows(1, 0), {"c0"})["template_changes_answers"]  # one probe never decides (p=1/300)
    assert fisher_greater(5, 10, 5, 10) > 0.5 and fisher_greater(0, 0, 3, 10) == 1.0


def test_token_budgets_come_from_the_reference_tokenizer_alike_on_both_sides(tmp_path):
    """A completion probe generates its expected text's tokens + PROBE_SLACK_TOKENS (never more than
    the character bound); each probe has the same budget on both sides; the shipped probes too."""
    from transformers import AutoTokenizer

    from bakeoff.models import fixtures
    from evaluations.probing import PROBE_SLACK_TOKENS, probe_max_tokens

    trained = Path(fixtures.build("tiny-qwen3"))
    tok = AutoTokenizer.from_pretrained(trained)
    model = ResolvedModel(label="tiny-qwen3", path=str(trained), local=True, fixture="tiny-qwen3")
    s = probe_set_of(_settings(model, model))
    assert s.source == "model" and "reference tokenizer" in s.rendering["token_budget"]
    assert s.backend == s.reference
    for p in s.reference:
        n = len(tok(p.expected, add_special_tokens=False)["input_ids"])
        assert p.max_tokens == min(n + PROBE_SLACK_TOKENS, probe_max_tokens(p.expected, p.match))
    assert any(p.max_tokens < probe_max_tokens(p.expected, p.match) for p in s.reference)  # tighter than characters
    # generic probes (a model that ships none): the engine's side gets the reference's budgets, id by id
    real, wrong = _model(tmp_path / "real", CHATML), _model(tmp_path / "wrong", LLAMA2_TEMPLATE)
    g = probe_set_of(_settings(wrong, real))
    assert [(p.id, p.max_tokens) for p in g.backend] == [(p.id, p.max_tokens) for p in g.reference]


def test_without_a_tokenizer_the_budget_is_the_character_bound_saying_why(tmp_path):
    from evaluations.probing import probe_max_tokens

    real = _model(tmp_path / "real", CHATML)  # tokenizer_config.json only: no vocabulary to count with
    s = probe_set_of(_settings(real, real))
    assert s.rendering["token_budget"].startswith("len(expected) + 4 characters: ")
    assert all(p.max_tokens == probe_max_tokens(p.expected, p.match) for p in s.reference)
    assert {p.max_tokens for p in s.reference if p.match == "contains"} == {48}


def test_a_tokenizer_that_cannot_encode_leaves_the_character_bound(tmp_path, monkeypatch):
    import evaluations.reference as reference
    from evaluations.probing import probe_max_tokens

    def broken(text, add_special_tokens=True):
        raise ValueError("no vocabulary")

    monkeypatch.setattr(reference, "reference_tokenizer", lambda path, trust_remote_code=False: (broken, ""))
    real = _model(tmp_path / "real", CHATML)
    s = probe_set_of(_settings(real, real))
    assert "did not encode the answers (ValueError: no vocabulary)" in s.rendering["token_budget"]
    assert all(p.max_tokens == probe_max_tokens(p.expected, p.match) for p in s.reference)
