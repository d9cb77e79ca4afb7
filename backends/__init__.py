"""Backends: one small interface over every engine, and a lazy registry.

The registry maps the ``--backend`` value to ``"module:Class"``; the module is imported only
when that backend is used (lm-eval ``lm_eval/models/__init__.py`` style). Engine packages
are never imported here nor in the backend classes: only inside their child processes.
"""

from __future__ import annotations

import importlib

from bakeoff.api.errors import UserError

REGISTRY: dict[str, str] = {
    "transformers": "backends.transformers.backend:TransformersBackend",
    "vllm": "backends.vllm.backend:VllmBackend",
    "ort-genai": "backends.ort_genai.backend:OrtGenaiBackend",
    "trtllm": "backends.trtllm.backend:TrtllmBackend",
    "openai": "backends.openai.backend:OpenAIBackend",
    "openvino": "backends.openvino.backend:OpenVinoBackend",
    "optimum-ort": "backends.optimum_ort.backend:OptimumOrtBackend",
    "llamacpp": "backends.llamacpp.backend:LlamaCppBackend",
}

# Backends `bakeoff qualify` runs when --backends is not given: those that need no
# user-supplied endpoint.
DEFAULT_QUALIFY = ["transformers", "vllm", "ort-genai", "optimum-ort", "openvino", "trtllm"]


def names() -> list[str]:
    """Registered backend names, sorted."""
    return sorted(REGISTRY)


def validate(name: str) -> str:
    """Return ``name`` if registered.

    Raises:
        UserError: naming the valid choices.
    """
    if name not in REGISTRY:
        raise UserError(f"unknown backend {name!r}; choose one of: {', '.join(names())}")
    return name


def preflight(model_path, name: str, cuda: bool | None = None, flags: set[str] | None = None, options: dict | None = None):
    """``bakeoff.analysis.preflight.preflight`` with the rules of the backend registered as ``name``
    (``preflight_rule`` and ``preflight_checkpoint_rule``); ``options``: the run's backend options."""
    # lazy: keeps `bakeoff --help` fast (the registry is on its path; bakeoff.analysis.preflight 0.1 s: pydantic)
    from bakeoff.analysis.preflight import preflight as predict

    cls = resolve(name)
    return predict(model_path, name, cls.preflight_rule, cuda, flags, options, cls.preflight_checkpoint_rule)


def raise_if_rejected(model_path, name: str, cuda: bool | None = None, flags: set[str] | None = None,
                      options: dict | None = None):
    """``bakeoff.analysis.preflight.raise_if_rejected`` with the rules of the backend ``name``."""
    # lazy: keeps `bakeoff --help` fast (the registry is on its path; bakeoff.analysis.preflight 0.1 s: pydantic)
    from bakeoff.analysis.preflight import raise_if_rejected as check

    cls = resolve(name)
    return check(model_path, name, cls.preflight_rule, cuda, flags, options, cls.preflight_checkpoint_rule)


def resolve(name: str) -> type:
    """Import and return the backend class registered as ``name``.

    Raises:
        UserError: if the name is not registered.
    """
    target = REGISTRY[validate(name)]
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)
