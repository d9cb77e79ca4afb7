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
import re
import tempfile
import time
import traceback
from collections import Counter
from typing import Any

try:  # as a module of the package (bakeoff, tests)
    from adapters.ort_genai_export import _graph_io
except ImportError:  # run as a file (other exporters' environments lack the package's pydantic)
    import _graph_io  # type: ignore[no-redef]

# onnx: "[ShapeInferenceError] (op_type:MatMul, node name: /model/x/MatMul): ..." and
# "... node (/model/x/MatMul) ...", ORT: "running MatMul node. Name:'/model/x/MatMul' Status".
_NODE_PATTERNS = (
    re.compile(r"op_type:\s*(?P<op>[\w.]+),\s*node name:\s*(?P<node>[^)\s]+)"),
    re.compile(r"running (?P<op>[\w.]+) node\. Name:'(?P<node>[^']+)'"),
    re.compile(r"[Nn]ode \((?P<node>[^)]+)\)(?: Op \((?P<op>[\w.]+)\))?"),
    re.compile(r"node name:\s*(?P<node>[^\s,)]+)"),
)


def locate_node(message: str) -> tuple[str | None, str | None]:
    """``(node name, op type)`` named in an onnx/onnxruntime error message, else Nones."""
    for pat in _NODE_PATTERNS:
        m = pat.search(message)
        if m:
            d = m.groupdict()
            return d.get("node"), d.get("op")
    return None, None


def _problem(failure_class: str, stage: str, exc: BaseException | str, ops_by_node: dict[str, str]) -> dict:
    msg = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
    msg = msg.strip()[:2000]
    node, op = locate_node(msg)
    if node and not op:
        op = ops_by_node.get(node)
    return {"failure_class": failure_class, "stage": stage, "node": node, "op_type": op, "message": msg}


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


def inspect(export_dir: str, expect: dict[str, Any]) -> dict[str, Any]:
    """Inspect the export in ``export_dir``; ``expect`` holds ``precision`` and ``moe_quant_type``."""
    import onnx

    cfg_path = os.path.join(export_dir, "genai_config.json")
    filename, named, genai_config = "model.onnx", {}, None
    try:
        with open(cfg_path) as fh:
            genai_config = json.load(fh)
        decoder = genai_config["model"]["decoder"]
        filename = decoder.get("filename", filename)
        named = {"kv_cache_dim": int(decoder["head_size"]), "head_size": int(decoder["head_size"])}
    except (OSError, KeyError, ValueError, TypeError):
        pass
    lay = _graph_io.layout(genai_config)
    if lay["paged"]:  # one sequence of the forward step's 4 tokens in whole blocks
        named.update(_graph_io.paged_named(lay, 4))
    filename = expect.get("onnx_file") or filename  # exports without genai_config.json (optimum's) name theirs
    path = os.path.join(export_dir, filename)
    rep: dict[str, Any] = {"onnx_file": filename, "timings_s": {}, "problems": [], "warnings": [], "versions": {"onnx": onnx.__version__}}
    t = time.monotonic()
    model = onnx.load(path, load_external_data=False)
    counts: Counter = Counter()
    ops_by_node: dict[str, str] = {}
    bits: Counter = Counter()
    consumed: set[str] = {o.name for o in model.graph.output}
    for node in model.graph.node:
        key = node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}.{node.op_type}"
        consumed.update(node.input)
        counts[key] += 1
        ops_by_node[node.name] = node.op_type
        if node.op_type == "MatMulNBits":
            b = next((a.i for a in node.attribute if a.name == "bits"), 4)
            bits[str(b)] += 1
    rep["n_nodes"] = sum(counts.values())
    rep["op_counts"] = dict(counts.most_common())
    rep["matmulnbits_bits"] = dict(bits)
    op_types = {k.rsplit(".", 1)[-1] for k in counts}
    rep["has_moe"] = "MoE" in op_types
    rep["has_qmoe"] = "QMoE" in op_types
    rep["precision_observed"] = ("int4" if bits.get("4") else "int8" if bits.get("8") else "float")
    # What the decoder takes, as declared: the forward step and og's stage feed that, and a
    # paged graph (1-D packed ids, PagedAttention) must agree with genai_config.json.
    rep["input_shapes"] = {i.name: [d.dim_value if d.HasField("dim_value") else d.dim_param
                                    for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
    paged_nodes = [n for n, o in ops_by_node.items() if o == "PagedAttention"]
    rep["paged_attention"] = bool(paged_nodes) and lay["paged"]
    rep["dynamic_batching"] = lay["dynamic_batching"]
    declared = [type("Input", (), {"name": k, "shape": v}) for k, v in rep["input_shapes"].items()]
    for msg in _graph_io.rank_problems(declared, lay, len(paged_nodes)):
        rep["problems"].append({"failure_class": "export-defect", "stage": "paged",
                                "node": paged_nodes[0] if paged_nodes else None,
                                "op_type": "PagedAttention" if paged_nodes else None, "message": msg})
    if expect.get("paged_attention") and not paged_nodes:
        rep["problems"].append({"failure_class": "export-defect", "stage": "paged", "node": None, "op_type": None,
                                "message": "requested paged_attention (builder use_paged_attention=true) but the graph "
                                           f"has no PagedAttention node (attention ops: "
                                           f"{sorted(o for o in op_types if 'Attention' in o) or 'none'})"})
    # Dead ends: a node none of whose outputs is used, e.g. a final norm bypassed because the
    # builder took an in-layer Linear with out_features == vocab_size for the LM head.
    for node in model.graph.node:
        if node.output and not any(o and o in consumed for o in node.output):
            rep["problems"].append({
                "failure_class": "export-defect", "stage": "graph", "node": node.name, "op_type": node.op_type,
                "message": f"dead node: no output of {node.name} ({node.op_type}) is consumed or a graph output"})
    rep["timings_s"]["op_counts"] = round(time.monotonic() - t, 3)

    # Precision: what was asked must show in the graph.
    precision = expect.get("precision")
    if precision in ("int4", "int8"):
        want = precision[3:]
        if not bits.get(want):
            rep["problems"].append(_problem(
                "export-defect", "precision",
                f"requested {precision} but the graph has no {want}-bit MatMulNBits "
                f"(MatMulNBits bits: {dict(bits) or 'none'}; MatMul: {counts.get('MatMul', 0)})", ops_by_node))
        if rep["has_moe"]:
            moe_nodes = [n for n, o in ops_by_node.items() if o == "MoE"]
            rep["problems"].append({
                "failure_class": "export-defect", "stage": "precision", "node": moe_nodes[0], "op_type": "MoE",
                "message": (f"requested {precision} (moe_quant_type={expect.get('moe_quant_type') or 'default'}) but "
                            f"{len(moe_nodes)} MoE node(s) are float MoE, not QMoE: {', '.join(moe_nodes[:4])}")})

    # The builder writes intermediate value_info hints that strict inference rejects on
    # valid graphs (0.18.0: rank-0 hints for [1] constants), and ORT registers ops such as
    # SimplifiedLayerNormalization in the ONNX domain that onnx does not know. So the checker
    # and strict inference run on a copy without value_info, with permissive schemas for
    # those ops; the hint mismatches are kept as warnings.
    t = time.monotonic()
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
    del model
    try:
        try:
            onnx.checker.check_model(stripped, full_check=True)
            rep["checker_ok"] = True
        except Exception as exc:  # noqa: BLE001 - every checker error is a finding
            rep["checker_ok"] = False
            rep["problems"].append(_problem("export-defect", "checker", exc, ops_by_node))
        rep["timings_s"]["checker"] = round(time.monotonic() - t, 3)
        t = time.monotonic()
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
    finally:
        os.unlink(stripped)
    rep["timings_s"]["shape_inference"] = round(time.monotonic() - t, 3)

    t = time.monotonic()
    try:
        import numpy as np
        import onnxruntime as ort

        rep["versions"]["onnxruntime"] = ort.__version__
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        # a graph built for CUDA (fp16 attention and MatMulNBits kernels) runs its forward step
        # on the CUDA provider; the CPU provider lacks some of its fp16 kernels
        ep = expect.get("execution_provider") or "cpu"
        providers = ["CPUExecutionProvider"]
        if ep == "cuda":
            if "CUDAExecutionProvider" not in ort.get_available_providers():
                raise _NoProvider(f"graph built for {ep}; this onnxruntime has no CUDAExecutionProvider "
                                  f"({', '.join(ort.get_available_providers())}): forward step not run")
            providers = ["CUDAExecutionProvider", "CPUExecutionProvider"]
        sess = ort.InferenceSession(path, opts, providers=providers)
    except _NoProvider as exc:
        sess = None
        rep["warnings"].append(str(exc))
    except Exception as exc:  # noqa: BLE001
        sess = None
        rep["forward_ok"] = False
        invalid = any(m in str(exc) for m in _GRAPH_INVALID)
        rep["problems"].append(_problem("export-defect" if invalid else "load-failure", "session", exc, ops_by_node))
    if sess is not None:
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
        del sess
    rep["timings_s"]["forward"] = round(time.monotonic() - t, 3)

    if expect.get("og_load") is False:  # not an ONNX Runtime GenAI export: no og.Model stage
        return rep
    t = time.monotonic()
    try:
        import onnxruntime_genai as og

        rep["versions"]["onnxruntime-genai"] = og.__version__
        ep = expect.get("execution_provider") or "cpu"
        if ep == "cuda" and not og.is_cuda_available():
            raise _NoProvider(f"graph built for {ep}; this onnxruntime-genai has no CUDA "
                              "(og.is_cuda_available() is False): og stage not run")
        og_model = og.Model(export_dir)
        if lay["paged"]:
            rep["og_engine_capabilities"] = _og_engine_token(og, og_model)
        else:
            params = og.GeneratorParams(og_model)
            params.set_search_options(max_length=8, do_sample=False)
            gen = og.Generator(og_model, params)
            gen.append_tokens([1, 2, 3])
            gen.generate_next_token()
            del gen
        rep["og_load_ok"] = True
        del og_model
    except _NoProvider as exc:
        rep["warnings"].append(str(exc))
    except Exception as exc:  # noqa: BLE001
        rep["og_load_ok"] = False
        invalid = any(m in str(exc) for m in _GRAPH_INVALID)
        rep["problems"].append(_problem("export-defect" if invalid else "load-failure", "og-load", exc, ops_by_node))
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
