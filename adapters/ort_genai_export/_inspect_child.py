"""Graph inspection, run inside the ONNX Runtime GenAI environment (a child process).

``python -m adapters.ort_genai_export._inspect_child EXPORT_DIR --expect JSON --out FILE``
writes a :class:`GraphReport`-shaped JSON to FILE. Stages (each recorded, none raises):

1. op counts over ``onnx.load(load_external_data=False)``;
2. ``onnx.checker.check_model(path, full_check=True)`` (full check = strict shape inference);
3. ``onnx.shape_inference.infer_shapes_path(path, out, strict_mode=True, data_prop=True)``;
4. precision: ``MatMulNBits`` for int4/int8 linears, ``QMoE`` and no float ``MoE`` for a
   quantized MoE;
5. one forward step with ``onnxruntime.InferenceSession`` on a 4-token prompt, empty past;
6. ``onnxruntime_genai.Model`` load and one generated token, through ``og.Generator``, or
   through ``og.Engine`` for a paged export (``genai_config.json`` ``engine.dynamic_batching``;
   ``og.Generator`` cannot feed its 1-D ids) (skipped when ``expect`` says ``"og_load": false``;
   ``expect["onnx_file"]`` names the model file of exports without a ``genai_config.json``,
   e.g. optimum's).

Before the checker, the decoder's declared inputs are read (``input_shapes``) and a paged
graph is checked against ``genai_config.json`` (:func:`_graph_io.rank_problems`, stage
``paged``); the forward step feeds what the graph declares (:func:`_graph_io.step_feeds`).
A graph built for CUDA is not run where onnxruntime / onnxruntime-genai have no CUDA (a
warning says so): ``PagedAttention`` has a CUDA kernel only.

Only the standard library at import time: this module also runs under bakeoff's own Python
for its parsing helpers.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import traceback
from typing import Any

try:  # as a module of the package (bakeoff, tests)
    from adapters.ort_genai_export import _graph_census, _graph_io
except ImportError:  # run as a file (other exporters' environments lack the package's pydantic)
    import _graph_census  # type: ignore[no-redef]
    import _graph_io  # type: ignore[no-redef]

_problem, locate_node = _graph_census.problem, _graph_census.locate_node

_TENSOR_TYPES = ("float", "float16", "bfloat16", "double", "int64", "int32", "int16", "int8", "uint8", "uint16",
                 "uint32", "uint64", "bool", "string")
# ORT session-creation errors that mean the graph itself is invalid (not a missing kernel).
_GRAPH_INVALID = ("ShapeInferenceError", "TypeInferenceError", "INVALID_GRAPH", "Type Error", "Type mismatch",
                  "Invalid model", "INVALID_PROTOBUF")


def _register_ort_onnx_domain_ops(onnx, model) -> list[str]:
    """Register permissive onnx schemas for ops in the ONNX domain that onnx lacks (ORT's own).

    Only ops that onnxruntime itself registers are covered, so a truly unknown op still fails
    the checker. Returns the op types registered.
    """
    defs = onnx.defs
    try:
        from onnxruntime.capi import onnxruntime_pybind11_state as C

        known_to_ort = {s.name for s in C.get_all_operator_schema() if s.domain in ("", "ai.onnx")}
    except Exception:  # noqa: BLE001 - no ORT schema list: register nothing
        return []
    attrs: dict[str, dict[str, int]] = {}
    for node in model.graph.node:
        if node.domain in ("", "ai.onnx") and not defs.has(node.op_type, "") and node.op_type in known_to_ort:
            attrs.setdefault(node.op_type, {}).update({a.name: a.type for a in node.attribute})
    P, A = defs.OpSchema.FormalParameter, defs.OpSchema.Attribute
    variadic = defs.OpSchema.FormalParameterOption.Variadic
    types = [f"tensor({t})" for t in _TENSOR_TYPES]
    for op, at in attrs.items():
        defs.register_schema(defs.OpSchema(
            op, "", 1, doc="ORT-registered op (registered for checking by bakeoff)",
            inputs=[P("inputs", "T", "", param_option=variadic, is_homogeneous=False, min_arity=0)],
            outputs=[P("outputs", "T", "", param_option=variadic, is_homogeneous=False, min_arity=0)],
            type_constraints=[("T", types, "")],
            attributes=[A(k, defs.OpSchema.AttrType(int(t)), "", required=False) for k, t in at.items()]))
    return sorted(attrs)


class _NoProvider(Exception):
    """The graph's execution provider is not in this onnxruntime build: nothing to judge."""


def _feeds(sess, np, named: dict[str, int], seq: int = 4) -> dict:
    """Inputs for one prefill step of ``seq`` tokens (ids 1..seq), empty past, shaped as the
    graph declares them (:func:`_graph_io.step_feeds`: 1-D packed ids for a paged graph)."""
    return _graph_io.step_feeds(sess.get_inputs(), np, [i % 8 + 1 for i in range(1, seq + 1)], 0, named)


def _og_engine_token(og, og_model, max_runs: int = 1000) -> dict[str, int]:
    """One token of a 3-token prompt through ``og.Engine``, the only og API that feeds a paged
    graph (``og.Generator`` makes 2-D ids); returns the Engine's capabilities.

    The turn asks for at least one token (``set_min_generated_tokens(1)``): a trained model may
    answer the prompt with its EOS, and og.Engine then ends the turn (``finish_reason`` EOS) without
    a token event (seen on the H200 with ``fixture:tiny-qwen3``, 2026-12-04: 1000 steps, no token).
    The loop ends when the turn finishes, whatever its reason.

    Raises:
        RuntimeError: the request failed, finished without a token (the reason named), or gave no
        token within ``max_runs`` Engine steps.
    """
    import numpy as np

    engine = og.Engine(og_model)
    caps = engine.get_capabilities()
    buf = engine.create_event_buffer(16)
    req = engine.create_request()
    opts = og.TurnOptions(req)
    opts.set_do_sample(False)
    opts.set_max_generated_tokens(1)
    opts.set_min_generated_tokens(1)
    req.begin_turn(np.asarray([1, 2, 3], dtype=np.int32), opts)
    token, failed = int(og.EngineEventFlags.TOKEN.value), int(og.EngineEventFlags.FAILED.value)
    got, finished = None, None
    for _ in range(max_runs):
        for ev in engine.run(buf) or ():
            if int(ev.flags.value) & failed:
                raise RuntimeError(f"og.Engine request failed: error_code={ev.error_code}")
            if int(ev.flags.value) & token:
                got = int(ev.token)
            if ev.finish_reason != og.FinishReason.NONE:
                finished = ev.finish_reason
        if got is not None or finished is not None:
            break
    req.close()
    if got is None:
        if finished is not None:
            raise RuntimeError(f"og.Engine finished the turn without a token (finish reason {finished})")
        raise RuntimeError(f"og.Engine gave no token in {max_runs} steps")
    return {"configured_max_batch_size": int(caps.configured_max_batch_size),
            "max_request_length": int(caps.max_request_length), "max_scheduled_tokens": int(caps.max_scheduled_tokens)}


def _decoder_config(export_dir: str) -> tuple[dict | None, str, dict[str, int]]:
    """``genai_config.json`` (None when unreadable), the decoder's model file and its named dims."""
    filename, named, genai_config = "model.onnx", {}, None
    try:
        with open(os.path.join(export_dir, "genai_config.json")) as fh:
            genai_config = json.load(fh)
        decoder = genai_config["model"]["decoder"]
        filename = decoder.get("filename", filename)
        named = {"kv_cache_dim": int(decoder["head_size"]), "head_size": int(decoder["head_size"])}
    except (OSError, KeyError, ValueError, TypeError):
        pass
    return genai_config, filename, named


def _strip_value_info(onnx, model, rep: dict[str, Any], export_dir: str) -> tuple[str, Any]:
    """Save the checker's copy of the graph, without the value_info hints onnx can recompute, the
    ONNX-domain ops ORT registers given permissive schemas; returns its path and the hints."""
    rep["checker_registered_ops"] = _register_ort_onnx_domain_ops(onnx, model)
    stripped = os.path.join(export_dir, f".bakeoff-inspect-{os.getpid()}.onnx")
    hints = onnx.helper.make_graph([], "hints", [], [], value_info=list(model.graph.value_info))
    # Keep the hints onnx cannot recompute: outputs of ops it has no inference for.
    opaque = {o for n in model.graph.node
              if n.domain not in ("", "ai.onnx") or n.op_type in rep["checker_registered_ops"] for o in n.output}
    kept = [v for v in model.graph.value_info if v.name in opaque]
    del model.graph.value_info[:]
    model.graph.value_info.extend(kept)
    onnx.save(model, stripped)
    return stripped, hints


def _checker(onnx, stripped: str, rep: dict[str, Any], ops_by_node: dict[str, str]) -> None:
    """``onnx.checker.check_model(full_check=True)`` on the stripped copy: ``checker_ok`` or a problem."""
    try:
        onnx.checker.check_model(stripped, full_check=True)
        rep["checker_ok"] = True
    except Exception as exc:  # noqa: BLE001 - every checker error is a finding
        rep["checker_ok"] = False
        rep["problems"].append(_problem("export-defect", "checker", exc, ops_by_node))


def _shape_inference(onnx, stripped: str, path: str, hints, rep: dict[str, Any], ops_by_node: dict[str, str]) -> None:
    """Strict shape inference on the stripped copy (``shape_inference_ok`` or a problem), then on
    the graph with its hints, whose disagreements are warnings only (ORT ignores them)."""
    with tempfile.TemporaryDirectory() as tmp:
        try:
            onnx.shape_inference.infer_shapes_path(stripped, os.path.join(tmp, "inferred.onnx"),
                                                   strict_mode=True, data_prop=True)
            rep["shape_inference_ok"] = True
        except Exception as exc:  # noqa: BLE001
            rep["shape_inference_ok"] = False
            rep["problems"].append(_problem("export-defect", "shape-inference", exc, ops_by_node))
        if rep["shape_inference_ok"] and len(hints.value_info):
            try:
                onnx.shape_inference.infer_shapes_path(path, os.path.join(tmp, "hinted.onnx"), strict_mode=True)
            except Exception as exc:  # noqa: BLE001 - annotation only: ORT ignores it
                rep["warnings"].append(f"value_info hint disagrees with inferred shape: {exc}"[:600])


def _load_problem(stage: str, exc: BaseException, ops_by_node: dict[str, str]) -> dict:
    """A failed load as a problem: an export defect when the message says the graph is invalid,
    else a load failure."""
    invalid = any(m in str(exc) for m in _GRAPH_INVALID)
    return _problem("export-defect" if invalid else "load-failure", stage, exc, ops_by_node)


def _providers(ort, expect: dict[str, Any]) -> list[str]:
    """The forward step's execution providers: a graph built for CUDA (fp16 attention and
    MatMulNBits kernels) runs on CUDA, the CPU provider lacking some of its fp16 kernels.

    Raises:
        _NoProvider: built for CUDA, and this onnxruntime has no CUDA provider.
    """
    ep = expect.get("execution_provider") or "cpu"
    if ep != "cuda":
        return ["CPUExecutionProvider"]
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        raise _NoProvider(f"graph built for {ep}; this onnxruntime has no CUDAExecutionProvider "
                          f"({', '.join(ort.get_available_providers())}): forward step not run")
    return ["CUDAExecutionProvider", "CPUExecutionProvider"]


def _session(path: str, expect: dict[str, Any], rep: dict[str, Any], ops_by_node: dict[str, str]):
    """``(InferenceSession, numpy, onnxruntime)`` for the forward step, or Nones (a warning when
    the provider is missing, else a session problem)."""
    try:
        import numpy as np
        import onnxruntime as ort

        rep["versions"]["onnxruntime"] = ort.__version__
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        providers = _providers(ort, expect)
        return ort.InferenceSession(path, opts, providers=providers), np, ort
    except _NoProvider as exc:
        rep["warnings"].append(str(exc))
    except Exception as exc:  # noqa: BLE001
        rep["forward_ok"] = False
        rep["problems"].append(_load_problem("session", exc, ops_by_node))
    return None, None, None


def _forward(sess, np, ort, lay: dict[str, Any], genai_config: dict | None, named: dict[str, int],
             rep: dict[str, Any], ops_by_node: dict[str, str]) -> None:
    """One prefill step of 4 tokens: ``logits_shape`` and ``forward_ok``, or a forward problem
    (non-finite logits included)."""
    try:
        if lay["paged"]:  # PagedAttention updates its caches in place: bound as input and output
            pairs = _graph_io.kv_pairs(genai_config, {i.name for i in sess.get_inputs()},
                                       {o.name for o in sess.get_outputs()})
            device = "cuda" if "CUDAExecutionProvider" in sess.get_providers() else "cpu"
            out = _graph_io.run_in_place(sess, ort, _feeds(sess, np, named), "logits", pairs, device)[0]
        else:
            out = sess.run(["logits"], _feeds(sess, np, named))[0]
        rep["logits_shape"] = [int(x) for x in out.shape]
        if not np.isfinite(out).all():
            raise ValueError(f"logits contain non-finite values ({int((~np.isfinite(out)).sum())} of {out.size})")
        rep["forward_ok"] = True
    except Exception as exc:  # noqa: BLE001
        rep["forward_ok"] = False
        rep["problems"].append(_problem("export-defect", "forward", exc, ops_by_node))


def _og_token(og, og_model, lay: dict[str, Any], rep: dict[str, Any]) -> None:
    """One generated token of a 3-token prompt: through ``og.Engine`` for a paged export (its
    capabilities recorded), else through ``og.Generator``."""
    if lay["paged"]:
        rep["og_engine_capabilities"] = _og_engine_token(og, og_model)
        return
    params = og.GeneratorParams(og_model)
    params.set_search_options(max_length=8, do_sample=False)
    gen = og.Generator(og_model, params)
    gen.append_tokens([1, 2, 3])
    gen.generate_next_token()
    del gen


def _og_load(export_dir: str, expect: dict[str, Any], lay: dict[str, Any], rep: dict[str, Any],
             ops_by_node: dict[str, str]) -> None:
    """``onnxruntime_genai.Model`` load and one token: ``og_load_ok``, a warning when og has no
    CUDA for a CUDA graph, or an og-load problem."""
    try:
        import onnxruntime_genai as og

        rep["versions"]["onnxruntime-genai"] = og.__version__
        ep = expect.get("execution_provider") or "cpu"
        if ep == "cuda" and not og.is_cuda_available():
            raise _NoProvider(f"graph built for {ep}; this onnxruntime-genai has no CUDA "
                              "(og.is_cuda_available() is False): og stage not run")
        og_model = og.Model(export_dir)
        _og_token(og, og_model, lay, rep)
        rep["og_load_ok"] = True
        del og_model
    except _NoProvider as exc:
        rep["warnings"].append(str(exc))
    except Exception as exc:  # noqa: BLE001
        rep["og_load_ok"] = False
        rep["problems"].append(_load_problem("og-load", exc, ops_by_node))


def inspect(export_dir: str, expect: dict[str, Any]) -> dict[str, Any]:
    """Inspect the export in ``export_dir``; ``expect`` holds ``precision`` and ``moe_quant_type``."""
    import onnx

    genai_config, filename, named = _decoder_config(export_dir)
    lay = _graph_io.layout(genai_config)
    if lay["paged"]:  # one sequence of the forward step's 4 tokens in whole blocks
        named.update(_graph_io.paged_named(lay, 4))
    filename = expect.get("onnx_file") or filename  # exports without genai_config.json (optimum's) name theirs
    path = os.path.join(export_dir, filename)
    rep: dict[str, Any] = {"onnx_file": filename, "timings_s": {}, "problems": [], "warnings": [], "versions": {"onnx": onnx.__version__}}
    t = time.monotonic()
    model = onnx.load(path, load_external_data=False)
    counts, ops_by_node, bits, consumed = _graph_census.census(model)
    op_types = _graph_census.record_ops(rep, counts, bits)
    # What the decoder takes, as declared: the forward step and og's stage feed that, and a
    # paged graph (1-D packed ids, PagedAttention) must agree with genai_config.json.
    rep["input_shapes"] = _graph_census.input_shapes(model)
    rep["problems"].extend(_graph_census.paged_problems(rep, lay, ops_by_node, op_types, expect))
    rep["problems"].extend(_graph_census.dead_nodes(model, consumed))
    rep["timings_s"]["op_counts"] = round(time.monotonic() - t, 3)
    rep["problems"].extend(_graph_census.precision_problems(expect, rep, bits, counts, ops_by_node))

    # The builder writes intermediate value_info hints that strict inference rejects on
    # valid graphs (0.18.0: rank-0 hints for [1] constants), and ORT registers ops such as
    # SimplifiedLayerNormalization in the ONNX domain that onnx does not know. So the checker
    # and strict inference run on a copy without value_info, with permissive schemas for
    # those ops; the hint mismatches are kept as warnings.
    t = time.monotonic()
    stripped, hints = _strip_value_info(onnx, model, rep, export_dir)
    del model
    try:
        _checker(onnx, stripped, rep, ops_by_node)
        rep["timings_s"]["checker"] = round(time.monotonic() - t, 3)
        t = time.monotonic()
        _shape_inference(onnx, stripped, path, hints, rep, ops_by_node)
    finally:
        os.unlink(stripped)
    rep["timings_s"]["shape_inference"] = round(time.monotonic() - t, 3)

    t = time.monotonic()
    sess, np, ort = _session(path, expect, rep, ops_by_node)
    if sess is not None:
        _forward(sess, np, ort, lay, genai_config, named, rep, ops_by_node)
        del sess
    rep["timings_s"]["forward"] = round(time.monotonic() - t, 3)

    if expect.get("og_load") is False:  # not an ONNX Runtime GenAI export: no og.Model stage
        return rep
    t = time.monotonic()
    _og_load(export_dir, expect, lay, rep, ops_by_node)
    rep["timings_s"]["og_load"] = round(time.monotonic() - t, 3)
    return rep


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("export_dir")
    ap.add_argument("--expect", default="{}")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    try:
        rep = inspect(args.export_dir, json.loads(args.expect))
    except Exception as exc:  # noqa: BLE001 - unreadable model: one load-failure
        rep = {"onnx_file": "model.onnx", "problems": [{
            "failure_class": "load-failure", "stage": "read", "node": None, "op_type": None,
            "message": f"{type(exc).__name__}: {exc}"[:2000]}], "traceback": traceback.format_exc()}
    tmp = args.out + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(rep, fh, indent=1)
    os.replace(tmp, args.out)


if __name__ == "__main__":
    main()
