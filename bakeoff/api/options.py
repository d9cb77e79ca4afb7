"""Parsing of ``--backend-opt key=value`` into a backend's pydantic Options model."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ValidationError

from bakeoff.api.errors import UserError


def parse_kv(items: list[str], flag: str = "--backend-opt") -> dict[str, Any]:
    """Parse ``["k=v", ...]``; values are JSON where they parse (``3``, ``true``, ``{...}``).

    Raises:
        UserError: for an item without ``=``, with an empty key, or a key given twice
            (which value was meant is ambiguous).
    """
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise UserError(f"malformed {flag} {item!r}: expected key=value, e.g. {flag} max_model_len=2048")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        if key in out:
            raise UserError(f"{flag} {key} given twice ({key}={out[key]!r} and {item!r}); pass it once")
        out[key] = value
    return out


def parse_options(backend: str, model: type[BaseModel], options: dict[str, Any]) -> BaseModel:
    """Validate options against a backend's ``Options`` model.

    Raises:
        UserError: one line naming the bad key and the valid keys.
    """
    try:
        return model.model_validate(options)
    except ValidationError as exc:
        err = exc.errors()[0]
        key = ".".join(str(p) for p in err.get("loc", ())) or "?"
        valid = ", ".join(sorted(model.model_fields))
        if err.get("type") == "extra_forbidden":
            raise UserError(f"unknown option {key!r} for backend {backend}; valid options: {valid}") from None
        raise UserError(f"bad value for option {key!r} of backend {backend}: {err.get('msg')}; valid options: {valid}") from None


def split_backend_opts(items: list[str], backends_: list[str]) -> dict[str, list[str]]:
    """``[BACKEND:]KEY=VALUE`` -> options per backend (no prefix: every backend)."""
    per: dict[str, list[str]] = {b: [] for b in backends_}
    for item in items:
        head, sep, rest = item.partition(":")
        if sep and "=" not in head and head in per:
            per[head].append(rest)
        elif sep and "=" not in head and head not in per:
            raise UserError(f"--backend-opt {item!r} names backend {head!r}, which is not among --backends {','.join(backends_)}")
        else:
            for b in per:
                per[b].append(item)
    for b, opts in per.items():
        parse_kv(opts)
    return per
