"""``bakeoff quantize`` and ``bakeoff calibrate``: tool commands beside qualify/report."""

from __future__ import annotations

import json
from pathlib import Path

from bakeoff.errors import EngineFailure, UserError


def cmd_quantize(args) -> int:
    """Quantize a checkpoint (``bakeoff quantize awq --model M --out DIR``)."""
    from adapters.awq_int4 import quantize_awq
    from bakeoff.models import resolve

    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {args.out} is a file; pass a new or empty folder for the quantized checkpoint")
    from bakeoff.artifacts import check_writable

    check_writable(out.resolve().parent)
    model = resolve(args.model, log=lambda s: print(f"[fixture] {s}", flush=True))
    if not model.local:
        raise UserError(f"quantize needs a local checkpoint folder; {args.model} is not one (download it first)")
    try:
        result = quantize_awq(model.path, Path(args.out), dataset=args.dataset, num_samples=args.num_samples,
                              log=lambda s: print(s, flush=True))
    except EngineFailure as exc:
        print(f"bakeoff: quantization failed: {exc.failure_class}: {exc.message}")
        for name, text in exc.evidence.items():
            print(f"--- {name}\n{text[-3000:]}")
        return 1
    print(json.dumps(result.model_dump(), indent=2, default=str))
    print(f"\nW4A16 checkpoint: {args.out}\nqualify it: .venv/bin/pytest evaluations/ --backend vllm --model {args.out} "
          f"--reference-model {args.model}")
    return 0


def cmd_calibrate(args) -> int:
    """Run the load generator against the synthetic SSE server and report its own error."""
    from bakeoff.loadgen.calibrate import cli_calibrate

    return cli_calibrate(args.rest)


def add_tool_parsers(sub) -> None:
    """Add ``quantize`` and ``calibrate`` to the ``bakeoff`` sub-command parser."""
    q = sub.add_parser("quantize", help="quantize a checkpoint (AWQ W4A16 as compressed-tensors, llm-compressor)")
    q.add_argument("method", choices=["awq"])
    q.add_argument("--model", required=True, help="checkpoint folder or fixture:NAME")
    q.add_argument("--out", required=True, help="output folder (must not exist or be empty)")
    q.add_argument("--dataset", default=None, help="calibration texts: .jsonl with a text field, or one text per line")
    q.add_argument("--num-samples", type=int, default=64)
    q.set_defaults(func=cmd_quantize)
    c = sub.add_parser("calibrate", help="measure the load generator's own timing error against a synthetic server",
                       add_help=False)
    c.add_argument("rest", nargs="*", help="--concurrency N [--ttft-ms 50 --itl-ms 10 --processes P --out FILE]")
    c.set_defaults(func=cmd_calibrate)
