"""Read an OpenVINO IR export back, inside the ``openvino`` environment (a child process).

``python -m adapters.openvino_export._inspect_ir IR_DIR --out FILE`` writes
``{"op_counts", "weight_types", "tokenizer_ir", "openvino"}``: op type counts of
``openvino_model.xml``, the element types of the weight constants feeding MatMul/Gather
(through any Convert/Subtract/Multiply decompression), and whether the tokenizer and
detokenizer IR OpenVINO GenAI needs are there. Standard library at import time.
"""

from __future__ import annotations

import argparse
import json
import os
from collections import Counter


def inspect(ir_dir: str) -> dict:
    import openvino as ov

    model = ov.Core().read_model(os.path.join(ir_dir, "openvino_model.xml"))
    ops: Counter = Counter()
    weights: Counter = Counter()
    for node in model.get_ordered_ops():
        kind = node.get_type_name()
        ops[kind] += 1
        if kind == "Constant" and node.get_output_partial_shape(0).rank.get_length() >= 2:
            consumers = {t.get_node().get_type_name() for t in node.output(0).get_target_inputs()}
            if consumers & {"MatMul", "Gather", "Convert", "Subtract", "Multiply", "Reshape"}:
                weights[node.get_output_element_type(0).get_type_name()] += 1
    return {"op_counts": dict(ops.most_common()), "weight_types": dict(weights.most_common()),
            "tokenizer_ir": all(os.path.isfile(os.path.join(ir_dir, f))
                                for f in ("openvino_tokenizer.xml", "openvino_detokenizer.xml")),
            "openvino": ov.get_version()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("ir_dir")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    rep = inspect(args.ir_dir)
    with open(args.out, "w") as fh:
        json.dump(rep, fh)


if __name__ == "__main__":
    main()
