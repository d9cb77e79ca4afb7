"""``bakeoff quantize`` and ``bakeoff calibrate``: tool commands beside qualify/report."""

from __future__ import annotations

import json
from pathlib import Path

from bakeoff.api.errors import EngineFailure, UserError


def cmd_quantize(args) -> int:
    """Quantize a checkpoint (``bakeoff quantize awq --model M --out DIR``)."""
    from adapters.awq_int4 import quantize_awq
    from bakeoff.host.artifacts import check_creatable
    from bakeoff.models.resolve import check as check_model
    from bakeoff.models.resolve import resolve
    from bakeoff.analysis.preflight import describe_quantization

    # everything is checked before the fixture build (minutes) and llm-compressor's
    # environment (minutes), and nothing is written until then (issue 15)
    if args.num_samples < 1:
        raise UserError(f"--num-samples must be at least 1, got {args.num_samples}")
    if args.dataset is not None and not Path(args.dataset).is_file():
        raise UserError(f"--dataset {args.dataset} is not a file; pass a .jsonl with a text field, or one text per line")
    out = Path(args.out).expanduser()
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {args.out} is a file; pass a new or empty folder for the quantized checkpoint")
    try:
        not_empty = out.is_dir() and any(out.iterdir())
    except OSError as exc:
        raise UserError(f"--out {args.out} cannot be read ({exc.strerror or exc}); "
                        "pass a new or empty folder you can write") from None
    if not_empty:
        raise UserError(f"output folder {args.out} exists and is not empty; choose a new one (nothing is overwritten)")
    fix = "pass --out in a folder you can write"
    check_creatable(out, "--out", fix)
    check_creatable(out.resolve().parent, "the folder of --out", fix)  # the log and the result go beside --out
    check_model(args.model)
    if not args.model.startswith("fixture:"):
        source = resolve(args.model, build=False)
        if not source.local:
            raise UserError(f"quantize needs a local checkpoint folder; {args.model} is not one (download it first)")
        existing = describe_quantization(source.path)
        if existing.get("quantized"):  # quantize_awq's own check, made before its environment is created
            raise UserError(f"{args.model} is already quantized ({existing.get('method')} {existing.get('scheme')}); "
                            "pass it to a backend as it is")
    model = resolve(args.model, log=lambda s: print(f"[fixture] {s}", flush=True))
    try:
        result = quantize_awq(model.path, out, dataset=args.dataset, num_samples=args.num_samples,
                              log=lambda s: print(s, flush=True), mtp_as_released=args.mtp_as_released)
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
    q.add_argument("--mtp-as-released", action="store_true",
                   help="leave the BF16 MTP head out of quantization_config.ignore (the released Qwen3.5 INT4 "
                        "layout, which vLLM's MTP refuses until patched)")
    q.set_defaults(func=cmd_quantize)
    c = sub.add_parser("calibrate", help="measure the load generator's own timing error against a synthetic server",
                       add_help=False)
    c.add_argument("rest", nargs="*", help="--concurrency N [--ttft-ms 50 --itl-ms 10 --processes P --out FILE]")
    c.set_defaults(func=cmd_calibrate)
