"""How each side renders the generic chat probes: the parts of :func:`evaluations.reference.probe_set_of`
that choose the engine's probes, keep those both sides have, and record the two renderings."""

from __future__ import annotations

import hashlib
from dataclasses import replace
from typing import Any

from bakeoff.analysis.generic_probes import generic_probes
from bakeoff.models.resolve import Probe


def engine_probes(settings, reference: list[Probe], model_template: str | None, model_special: dict[str, str],
                  same_model: bool, rendering: dict[str, Any]) -> list[Probe]:
    """The generic probes the engine under test is sent: rendered with the model under test's chat
    template, else the reference's, saying why in ``rendering["chat_template"]``."""
    if same_model:
        return reference
    if model_template is None:
        why = "carries no chat template" if settings.model.local else "is not a local folder"
        rendering["chat_template"] = f"the reference's: the model under test {why}"
        return reference
    backend = [Probe(**p) for p in generic_probes(chat_template=model_template, special=model_special)]
    if {p.id for p in reference} - {p.id for p in backend}:  # chat probes the reference's template gives, not this one
        rendering["chat_template"] = "the reference's: the model under test's template does not render here"
        return reference
    return backend


def common_probes(reference: list[Probe], backend: list[Probe],
                  rendering: dict[str, Any]) -> tuple[list[Probe], list[Probe]]:
    """Both sides' probes less those only one side has (a chat form only one template gives), said in
    ``rendering["left_out"]``."""
    ids = {p.id for p in reference} & {p.id for p in backend}
    if len(ids) < max(len(reference), len(backend)):
        rendering["left_out"] = (f"{len(reference) - len(ids)} reference-only, {len(backend) - len(ids)} engine-only "
                                 "probes (a chat form only one side's template gives)")
        reference, backend = [p for p in reference if p.id in ids], [p for p in backend if p.id in ids]
    return reference, backend


def aligned(backend: list[Probe], reference: list[Probe]) -> list[Probe]:
    """The engine's probes with the reference's token budgets, in the reference's order."""
    budgets = {p.id: p.max_tokens for p in reference}
    backend = [replace(p, max_tokens=budgets[p.id]) for p in backend]
    by_id = {p.id: p for p in backend}
    return [by_id[p.id] for p in reference]


def note_templates(rendering: dict[str, Any], backend: list[Probe], reference: list[Probe], same_model: bool,
                   model_template: str | None, ref_template: str | None) -> None:
    """Record in ``rendering`` whether the templates are identical, their hashes, and how many prompts
    differ between the sides (the first such probe with both renderings)."""
    rendering["templates_identical"] = same_model or model_template == ref_template
    rendering["template_sha256"] = {side: hashlib.sha256(t.encode()).hexdigest()[:12] if t else None
                                    for side, t in (("model", model_template), ("reference", ref_template))}
    diff = [(b, r) for b, r in zip(backend, reference) if b.prompt != r.prompt]
    rendering["prompts_differ"] = len(diff)
    if diff:
        b, r = diff[0]
        rendering["first_difference"] = {"id": b.id, "engine_prompt": b.prompt, "reference_prompt": r.prompt}
