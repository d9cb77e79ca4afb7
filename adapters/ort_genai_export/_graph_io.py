"""What an ONNX Runtime GenAI decoder graph declares, and the inputs of one step of it.

Two layouts come out of the model builder (onnxruntime-genai 0.18.0,
``onnxruntime_genai/models/builders/base.py`` ``make_inputs_init`` / ``make_outputs_init`` and
the ``genai_config.json`` it writes):

- standard (``GroupQueryAttention``): ``input_ids`` ``[batch_size, sequence_length]``,
  ``attention_mask``, KV caches ``[batch_size, kv_heads, past_sequence_length, head_size]``;
  ``og.Generator`` and the static path of ``og.Engine`` feed it.
- paged (``--extra_options use_paged_attention=true``; ``PagedAttention``): every sequence of a
  step packed on one token axis, so ``input_ids`` is 1-D ``[num_tokens]``; no ``attention_mask``;
  KV caches ``[num_blocks, block_size, kv_heads, head_size]``; ``block_table``
  ``[batch_size, max_num_blocks]``, ``cumulative_sequence_lengths`` ``[batch_size + 1]``,
  ``past_sequence_lengths`` ``[batch_size]`` and ``attention_metadata`` ``[3]`` (all int32),
  ``logits_indices`` ``[num_logits]`` with ``prune_lm_head``; ``genai_config.json`` gains
  ``engine.dynamic_batching`` (block_size, max_batch_size, gpu_utilization_factor), the section
  that makes ``og.Engine`` batch continuously. ``og.Generator`` cannot feed it (it always makes
  ``[batch, sequence]`` ids: "Invalid rank for input: input_ids Got: 2 Expected: 1").
  ``attention_metadata`` holds ``[max query length, max KV length, KV length lower bound]`` of
  the step, as og's own ``VarlenDecoderIO`` fills it (``src/engine/decoders/varlen_decoder_io.cpp``
  ``GetAttentionMetadataForPlan``, onnxruntime-genai main; the 0.18.0 C++ sources are not public
  beside its wheel). The ``PagedAttention`` op schema in onnxruntime 1.32 says it "is designed to
  work with the CUDA Execution Provider only": a paged graph runs nowhere else.

Only the standard library at import time (numpy is passed in): the graph inspection runs this
file beside it in other exporters' environments, and the ort-genai worker imports it.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

PAGED_INPUTS = ("block_table", "cumulative_sequence_lengths", "past_sequence_lengths")
NP_TYPES = {"tensor(int64)": "int64", "tensor(int32)": "int32", "tensor(float)": "float32",
            "tensor(float16)": "float16", "tensor(bfloat16)": "float32"}


def layout(genai_config: dict[str, Any] | None) -> dict[str, Any]:
    """The decoder layout ``genai_config.json`` declares.

    Returns:
        ``{"paged": bool, "dynamic_batching": dict | None, "block_size": int | None,
        "head_size": int | None, "inputs": {nominal: graph name}}``; paged means the
        ``engine.dynamic_batching`` section is there (og.Engine's continuous path).
    """
    cfg = genai_config or {}
    decoder = (cfg.get("model") or {}).get("decoder") or {}
    dyn = (cfg.get("engine") or {}).get("dynamic_batching")
    block = dyn.get("block_size", 256) if isinstance(dyn, dict) else None
    head = decoder.get("head_size")
    return {"paged": isinstance(dyn, dict), "dynamic_batching": dyn if isinstance(dyn, dict) else None,
            "block_size": int(block) if block else None, "head_size": int(head) if head else None,
            "inputs": dict(decoder.get("inputs") or {})}


def _dim(d: Any, n_new: int, past: int, named: dict[str, int]) -> int:
    """A declared dimension's size for one sequence of ``n_new`` tokens after ``past`` cached ones."""
    if isinstance(d, int) and d > 0:
        return d
    name = str(d or "")
    if name in named:
        return named[name]
    if "past" in name:
        return past
    if "total" in name:
        return past + n_new
    if "batch" in name:
        return 2 if "+ 1" in name or "+1" in name else 1
    return n_new


class _Step(NamedTuple):
    """One step of one sequence: its new token ids, their count, the cached tokens before them,
    both together, and the sizes of named dimensions."""

    tokens: list[int]
    n: int
    past: int
    total: int
    named: dict[str, int]


def _input_ids(np, dtype, shape: list, s: _Step):
    """The new ids in the declared rank: 1-D packed (paged) or ``[1, n]``."""
    ids = np.asarray(s.tokens, dtype=dtype)
    return ids if len(shape) == 1 else ids.reshape(1, s.n)


def _attention_mask(np, dtype, shape: list, s: _Step):
    """Ones over past and new tokens, ``[1, total]``."""
    return np.ones((1, s.total), dtype=dtype)


def _position_ids(np, dtype, shape: list, s: _Step):
    """Positions ``past..total-1`` in the declared rank; MRoPE's leading section axis repeated."""
    pos = np.arange(s.past, s.total, dtype=dtype)
    if len(shape) == 1:
        return pos
    if len(shape) == 3 or (len(shape) == 2 and isinstance(shape[0], int) and shape[0] > 1):
        # MRoPE (Qwen2.5-VL / Qwen3.5): sections first, text positions equal in each
        lead = shape[0] if isinstance(shape[0], int) and shape[0] > 0 else 3
        full = (lead, 1, s.n) if len(shape) == 3 else (lead, s.n)
        return np.ascontiguousarray(np.broadcast_to(pos.reshape((1,) * (len(full) - 1) + (s.n,)), full))
    return pos.reshape(1, s.n)


def _block_table(np, dtype, shape: list, s: _Step):
    """The sequence's blocks ``0..max_num_blocks-1``, ``[1, max_num_blocks]``."""
    return np.arange(s.named.get("max_num_blocks", 1), dtype=dtype).reshape(1, -1)


def _cumulative_sequence_lengths(np, dtype, shape: list, s: _Step):
    """``[0, n]``: one sequence of the step's new tokens on the packed token axis."""
    return np.asarray([0, s.n], dtype=dtype)


def _past_sequence_lengths(np, dtype, shape: list, s: _Step):
    """``[past]``: the sequence's cached tokens."""
    return np.asarray([s.past], dtype=dtype)


def _attention_metadata(np, dtype, shape: list, s: _Step):
    """``[max query length, max KV length, KV length lower bound]`` of the step, as long as declared."""
    want = shape[0] if shape and isinstance(shape[0], int) else 3
    return np.asarray([s.n, s.total, s.total][:want], dtype=dtype)


def _logits_indices(np, dtype, shape: list, s: _Step):
    """``[n - 1]``: logits of the step's last token only."""
    return np.asarray([s.n - 1], dtype=dtype)


def _zeros(np, dtype, shape: list, s: _Step):
    """Zeros of the declared shape (an empty past KV cache, among others)."""
    return np.zeros([_dim(d, s.n, s.past, s.named) for d in shape], dtype=dtype)


# input name -> its array for one step of one sequence; any other input: zeros of its shape
FEEDERS = {"input_ids": _input_ids, "attention_mask": _attention_mask, "position_ids": _position_ids,
           "block_table": _block_table, "block_table_windowed": _block_table,
           "cumulative_sequence_lengths": _cumulative_sequence_lengths,
           "past_sequence_lengths": _past_sequence_lengths, "attention_metadata": _attention_metadata,
           "logits_indices": _logits_indices}


def step_feeds(inputs: list, np, tokens: list[int], past: int = 0, named: dict[str, int] | None = None,
               caches: dict[str, Any] | None = None) -> dict[str, Any]:
    """Inputs of one step of one sequence, shaped as the graph declares them.

    Args:
        inputs: the graph's inputs (``name``, ``shape`` with ints or dim names, ``type`` such as
            ``tensor(int64)``), e.g. ``InferenceSession.get_inputs()``.
        np: numpy.
        tokens: the step's new token ids.
        past: tokens already in the KV cache (0: prefill).
        named: sizes of named dimensions (``head_size``, ``num_blocks``, ``block_size``, ...).
        caches: KV inputs to pass as they are (a paged decode step's caches); others get zeros.

    Returns:
        ``{input name: array}``: ids in the rank the graph declares (1-D packed for a paged
        graph, ``[1, n]`` otherwise), positions ``past..past+n-1`` in their declared rank (MRoPE's
        leading section axis repeated), a mask of ones over past and new tokens, and for a paged
        graph one sequence in blocks ``0..max_num_blocks-1``.
    """
    named = dict(named or {})
    step = _Step(tokens, len(tokens), past, past + len(tokens), named)
    feeds: dict[str, Any] = {}
    for inp in inputs:
        shape, name = list(inp.shape or []), inp.name
        dtype = np.dtype(NP_TYPES.get(inp.type, "float32"))
        if caches and name in caches:
            feeds[name] = caches[name]
        else:
            feeds[name] = FEEDERS.get(name, _zeros)(np, dtype, shape, step)
    return feeds


def paged_named(lay: dict[str, Any], total_tokens: int) -> dict[str, int]:
    """Named dimension sizes of a paged graph for one sequence of ``total_tokens`` (prompt + new):
    blocks of ``genai_config`` ``engine.dynamic_batching.block_size``, enough to hold it."""
    block = lay.get("block_size") or 256
    blocks = max(1, math.ceil(total_tokens / block))
    named = {"num_blocks": blocks, "num_blocks_windowed": blocks, "max_num_blocks": blocks, "block_size": block}
    if lay.get("head_size"):
        named.update(head_size=lay["head_size"], kv_cache_dim=lay["head_size"])
    return named


def rank_problems(inputs: list, lay: dict[str, Any], paged_nodes: int) -> list[str]:
    """Disagreements between the graph's inputs, its attention ops and ``genai_config.json``.

    A paged export must hold ``PagedAttention`` nodes, declare 1-D ``input_ids`` and the
    paged metadata inputs, and carry ``engine.dynamic_batching`` (else og.Engine feeds it as a
    static batch); a graph with ``PagedAttention`` and no such section is as broken.

    Returns:
        One sentence per problem (empty: consistent).
    """
    by_name = {i.name: list(i.shape or []) for i in inputs}
    out: list[str] = []
    ids_rank = len(by_name["input_ids"]) if "input_ids" in by_name else None
    if lay["paged"]:
        if not paged_nodes:
            out.append("genai_config.json has engine.dynamic_batching (og.Engine's paged, continuous path) but the "
                       "graph has no PagedAttention node")
        if ids_rank not in (None, 1):
            out.append(f"genai_config.json has engine.dynamic_batching but the graph declares input_ids of rank "
                       f"{ids_rank} {by_name['input_ids']}; og.Engine's paged path feeds packed 1-D ids")
        missing = [n for n in PAGED_INPUTS if n not in by_name]
        if missing:
            out.append(f"paged export without the graph inputs {', '.join(missing)} that og.Engine's paged path feeds")
    elif paged_nodes:
        out.append(f"the graph has {paged_nodes} PagedAttention node(s) but genai_config.json has no "
                   "engine.dynamic_batching section: og.Engine would feed it as a static batch")
    return out


def kv_pairs(genai_config: dict[str, Any] | None, input_names: set[str], output_names: set[str]) -> dict[str, str]:
    """``{present output: past input}`` per layer, from ``genai_config.json``'s name patterns
    (``past_key_values.%d.key`` / ``present.%d.key`` and the value ones)."""
    decoder = ((genai_config or {}).get("model") or {}).get("decoder") or {}
    ins, outs = decoder.get("inputs") or {}, decoder.get("outputs") or {}
    pairs: dict[str, str] = {}
    for past_key, present_key in (("past_key_names", "present_key_names"), ("past_value_names", "present_value_names")):
        past_pat, present_pat = ins.get(past_key), outs.get(present_key)
        if past_pat and present_pat:
            for layer in range(int(decoder.get("num_hidden_layers") or 0)):
                if past_pat % layer in input_names and present_pat % layer in output_names:
                    pairs[present_pat % layer] = past_pat % layer
    return pairs


def run_in_place(sess, ort, feeds: dict[str, Any], logits: str, pairs: dict[str, str], device: str,
                 caches: dict[str, Any] | None = None) -> tuple[Any, dict[str, Any]]:
    """One step of a paged graph, its KV caches updated in place.

    ``PagedAttention`` writes the step's keys and values into the cache it is given and
    requires the ``present.*`` output to be that same buffer ("key_cache and key_cache_out
    must be the same buffer", onnxruntime 1.31 CUDA): each cache is an ``OrtValue`` on the
    device, bound as both the past input and the present output (``IOBinding``); the other
    inputs are bound from host memory.

    Args:
        sess: the ``InferenceSession``; ort: onnxruntime.
        feeds: :func:`step_feeds`'s arrays (its zero caches are used when ``caches`` is None).
        logits: the logits output's name.
        pairs: :func:`kv_pairs`.
        device: ``cuda`` or ``cpu`` (where the caches live).
        caches: ``{past input: OrtValue}`` from the previous step, or None.

    Returns:
        ``(logits as a host array, caches for the next step)``.
    """
    binding = sess.io_binding()
    caches = dict(caches or {})
    for name, arr in feeds.items():
        if name in pairs.values():
            if name not in caches:
                caches[name] = ort.OrtValue.ortvalue_from_numpy(arr, device, 0)
            binding.bind_ortvalue_input(name, caches[name])
        else:
            binding.bind_cpu_input(name, arr)
    binding.bind_output(logits, "cpu")  # bound first: get_outputs()[0]
    for present, past in pairs.items():
        binding.bind_ortvalue_output(present, caches[past])
    sess.run_with_iobinding(binding)
    return binding.get_outputs()[0].numpy(), caches
