"""Sanity: the engine under test turns the sanity prompts into the reference's token ids.

Runs before the other sanity checks (``MODULE_ORDER``), so a tokenizer that differs is named
first: every later comparison with the reference is of outputs for different inputs.
"""

from __future__ import annotations

import pytest

from evaluations.tokenizing import (added_special_ids, describer, example, mismatches, reference_ids, reference_tokenizer,
                                    sanity_prompts, uses_chat)



def engine_tokenizer(info) -> dict[str, str]:
    """What the backend's start says of the engine's tokenizer: the one it chose (``notes``) and,
    where it fell back from the one asked for, why (``fallbacks``, e.g. ORT GenAI's)."""
    if info is None:
        return {}
    said = {"tokenizer": (info.notes or {}).get("tokenizer"), "fallback": (info.fallbacks or {}).get("tokenizer")}
    return {k: v for k, v in said.items() if v}


def _compare_forms(c, tok, texts: list[str], engine_ids: dict, engine_notes: dict, backend: str):
    """Each form's engine ids against the reference's: ``(mismatched rows, a sample of three per
    form, {form: prompts compared}, {form: why not compared})``. An engine that answers another
    number of token lists than prompts fails the check (``runtime-crash``)."""
    describe = describer(tok)
    rows: list[dict] = []
    sample: list[dict] = []
    compared: dict[str, int] = {}
    not_compared: dict[str, str] = {}
    for form, got in engine_ids.items():
        if got is None or got is NotImplemented:
            not_compared[form] = engine_notes[form] or f"the {backend} backend cannot report token ids"
            continue
        want, why = reference_ids(tok, texts, form == "chat")
        if want is None:
            not_compared[form] = why
            continue
        if len(got) != len(texts):
            c.fail(f"the engine answered {len(got)} token lists for {len(texts)} prompts ({form})", "runtime-crash")
        compared[form] = len(texts)
        sample += [{"form": form, "prompt": t, "reference_ids": w, "engine_ids": g}
                   for t, w, g in list(zip(texts, want, got))[:3]]
        rows += mismatches(texts, want, got, form, describe, set(tok.all_special_ids))
    return rows, sample, compared, not_compared


@pytest.mark.check("sanity.tokenizer")
def test_tokenizer(run, settings, engine, probe_texts):
    """Every sanity prompt (the probes, chat-rendered ones included, and the open-ended
    openings) tokenized by the reference and by the engine under test
    (:meth:`backends.base.Backend.tokenize`, the engine's own tokenizer): the ids must be equal.

    BOS and other special tokens: compared like with like, as each side's generation starts.
    The reference calls its tokenizer as the transformers worker does (``tok(prompt)``: a BOS
    where the checkpoint's tokenizer adds one); the engine reports the ids it feeds its model
    (vLLM's ``/tokenize`` with ``add_special_tokens=true``, its completions default; og's
    encode; TensorRT-LLM's input processor). A chat run (the backend's client sends chat
    messages) also compares each prompt as one user message, rendered with the chat template
    and the generation prompt and no further special tokens on either side. A BOS that only one
    side adds is a failure (the model sees another input) and the evidence says that it is
    the only difference.

    Rule: pass only when ids were compared for every form the run sends and all are equal;
    fail on any differing prompt (one is enough: the same text reaches the model as another
    input, and no tolerance makes that a numerical effect); skip, with the reason, when the
    engine cannot report its ids or the reference tokenizer cannot be loaded.

    Failure class ``accuracy-regression`` ("the output disagrees with the reference"): the
    engine accepted and served the checkpoint, so nothing was rejected (``config-rejected`` is
    for a reader that refuses); what the verdict must gate on is that its outputs cannot agree
    with the reference's, whatever the cause (an engine's silent tokenizer fallback, another
    normalizer or pre-tokenizer, a BOS). The engine's own tokenizer notes are quoted.
    """
    items, source = probe_texts
    with run.check("sanity.tokenizer", "accuracy-regression") as c:
        texts = sanity_prompts(items)
        notes = engine_tokenizer(engine.info)
        forms = ["text"] + (["chat"] if uses_chat(engine) else [])
        # the engine is asked first: its failure (a hang, a crash) is named before anything is loaded
        engine_ids, engine_notes = {}, {}
        for form in forms:
            engine_ids[form] = engine.tokenize(texts, chat=form == "chat")
            engine_notes[form] = engine.tokenize_note  # why None, said by the call itself
        ref_path = settings.reference_model.path
        tok, why = reference_tokenizer(ref_path, bool(settings.reference_options.get("trust_remote_code", False)))
        if tok is None:
            c.skip(why)
        c.values.update({"prompts": len(texts), "probe_source": source, "forms": forms,
                         "reference_tokenizer": f"{type(tok).__name__} ({ref_path})", "engine_tokenizer_notes": notes,
                         "reference_adds_special_ids": added_special_ids(tok)})
        rows, sample, compared, not_compared = _compare_forms(c, tok, texts, engine_ids, engine_notes, settings.backend)
        c.values.update({"compared": compared, "not_compared": not_compared, "mismatched": len(rows)})
        if sample:
            c.evidence("sample.json", sample)
        if rows:
            c.evidence("mismatches.json", rows)
            by_form = ", ".join(f"{sum(r['form'] == f for r in rows)}/{n} {f}" for f, n in compared.items())
            note = "; engine notes: " + "; ".join(f"{k}: {v}" for k, v in notes.items()) if notes else ""
            c.fail(f"the engine tokenizes {by_form} prompts differently from the reference "
                   f"({type(tok).__name__}); e.g. {example(rows[0])}{note}")
        if not texts:  # nothing compared verifies nothing
            c.skip("no prompt to compare: the run sends none")
        if not_compared:
            c.skip("token ids not compared for "
                   + "; ".join(f"{f} prompts: {why}" for f, why in not_compared.items())
                   + (f" ({sum(compared.values())} {'/'.join(compared)} prompts compared, all equal)" if compared else ""))
        c.summary = (f"{len(texts)} prompts tokenize to the reference's ids as {' and as '.join(compared)} "
                     f"({sum(compared.values())} comparisons; reference {type(tok).__name__})")
