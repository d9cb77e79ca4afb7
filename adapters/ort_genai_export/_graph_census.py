"""What the graph inspection reads from a loaded ONNX decoder without running it.

The first stage of :func:`adapters.ort_genai_export._inspect_child.inspect`: op counts,
``MatMulNBits`` bit widths, the declared inputs, a paged graph's agreement with
``genai_config.json``, dead nodes and the requested precision, all over
``onnx.load(load_external_data=False)``'s ``ModelProto``; and the inspection's problem records,
the node and op read from an onnx / onnxruntime error message (:func:`locate_node`).

Only the standard library at import time: it runs beside the inspector as a file in other
exporters' environments, as :mod:`._graph_io` does.
"""

from __future__ import annotations

import re
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


def problem(failure_class: str, stage: str, exc: BaseException | str, ops_by_node: dict[str, str]) -> dict:
    """A problem record; node and op type read from the message (the op from the node's name
    when the message names only the node)."""
    msg = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
    msg = msg.strip()[:2000]
    node, op = locate_node(msg)
    if node and not op:
        op = ops_by_node.get(node)
    return {"failure_class": failure_class, "stage": stage, "node": node, "op_type": op, "message": msg}


def census(model) -> tuple[Counter, dict[str, str], Counter, set[str]]:
    """Op counts (domain-qualified outside ONNX's), op type by node name, ``MatMulNBits`` count
    by bit width, and every consumed value name (graph outputs included)."""
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
    return counts, ops_by_node, bits, consumed


def record_ops(rep: dict[str, Any], counts: Counter, bits: Counter) -> set[str]:
    """Write the op counts, MoE / QMoE presence and the observed precision into ``rep``; returns
    the op types without their domain."""
    rep["n_nodes"] = sum(counts.values())
    rep["op_counts"] = dict(counts.most_common())
    rep["matmulnbits_bits"] = dict(bits)
    op_types = {k.rsplit(".", 1)[-1] for k in counts}
    rep["has_moe"] = "MoE" in op_types
    rep["has_qmoe"] = "QMoE" in op_types
    rep["precision_observed"] = ("int4" if bits.get("4") else "int8" if bits.get("8") else "float")
    return op_types


def input_shapes(model) -> dict[str, list]:
    """The decoder's declared inputs: ``{name: [dim value or dim name, ...]}``."""
    return {i.name: [d.dim_value if d.HasField("dim_value") else d.dim_param
                     for d in i.type.tensor_type.shape.dim] for i in model.graph.input}


def paged_problems(rep: dict[str, Any], lay: dict[str, Any], ops_by_node: dict[str, str], op_types: set[str],
                   expect: dict[str, Any]) -> list[dict]:
    """Records whether the graph is paged in ``rep``; returns its disagreements with
    ``genai_config.json`` and a requested but missing ``PagedAttention``, as problems."""
    paged_nodes = [n for n, o in ops_by_node.items() if o == "PagedAttention"]
    rep["paged_attention"] = bool(paged_nodes) and lay["paged"]
    rep["dynamic_batching"] = lay["dynamic_batching"]
    declared = [type("Input", (), {"name": k, "shape": v}) for k, v in rep["input_shapes"].items()]
    problems = [{"failure_class": "export-defect", "stage": "paged", "node": paged_nodes[0] if paged_nodes else None,
                 "op_type": "PagedAttention" if paged_nodes else None, "message": msg}
                for msg in _graph_io.rank_problems(declared, lay, len(paged_nodes))]
    if expect.get("paged_attention") and not paged_nodes:
        problems.append({"failure_class": "export-defect", "stage": "paged", "node": None, "op_type": None,
                         "message": "requested paged_attention (builder use_paged_attention=true) but the graph "
                                    f"has no PagedAttention node (attention ops: "
                                    f"{sorted(o for o in op_types if 'Attention' in o) or 'none'})"})
    return problems


def dead_nodes(model, consumed: set[str]) -> list[dict]:
    """Dead ends as problems: a node none of whose outputs is used, e.g. a final norm bypassed
    because the builder took an in-layer Linear with out_features == vocab_size for the LM head."""
    return [{"failure_class": "export-defect", "stage": "graph", "node": node.name, "op_type": node.op_type,
             "message": f"dead node: no output of {node.name} ({node.op_type}) is consumed or a graph output"}
            for node in model.graph.node if node.output and not any(o and o in consumed for o in node.output)]


def precision_problems(expect: dict[str, Any], rep: dict[str, Any], bits: Counter, counts: Counter,
                        ops_by_node: dict[str, str]) -> list[dict]:
    """Precision: what was asked (int4 / int8) must show in the graph, MoE included (QMoE)."""
    precision = expect.get("precision")
    if precision not in ("int4", "int8"):
        return []
    problems = []
    want = precision[3:]
    if not bits.get(want):
        problems.append(problem(
            "export-defect", "precision",
            f"requested {precision} but the graph has no {want}-bit MatMulNBits "
            f"(MatMulNBits bits: {dict(bits) or 'none'}; MatMul: {counts.get('MatMul', 0)})", ops_by_node))
    if rep["has_moe"]:
        moe_nodes = [n for n, o in ops_by_node.items() if o == "MoE"]
        problems.append({
            "failure_class": "export-defect", "stage": "precision", "node": moe_nodes[0], "op_type": "MoE",
            "message": (f"requested {precision} (moe_quant_type={expect.get('moe_quant_type') or 'default'}) but "
                        f"{len(moe_nodes)} MoE node(s) are float MoE, not QMoE: {', '.join(moe_nodes[:4])}")})
    return problems
