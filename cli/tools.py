"""``bakeoff quantize`` and ``bakeoff calibrate``: tool commands beside qualify/report."""

from __future__ import annotations

import json
import math
import shlex
import time
from pathlib import Path

from bakeoff.api.errors import EngineFailure, UserError


MAX_NUM_SAMPLES = 100_000  # calibration texts for AWQ: llm-compressor's recipes use hundreds


def cmd_quantize(args) -> int:
    """Quantize a checkpoint (``bakeoff quantize awq --model M --out DIR``)."""
    # lazy: keeps `bakeoff --help` fast: this module is on its path (adapters.awq_int4 0.1 s: pydantic); tests patch adapters.awq_int4.quantize_awq
    from adapters.awq_int4 import quantize_awq
    from bakeoff.models.resolve import resolve

    # everything is checked before the fixture build (minutes) and llm-compressor's
    # environment (minutes), and nothing is written until then (issue 15)
    out = _quantize_out(args)
    _quantize_source(args, out)
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
    print(f"\nW4A16 checkpoint: {args.out}\nqualify it: .venv/bin/pytest evaluations/ --backend vllm "
          f"--model={shlex.quote(str(args.out))} --reference-model={shlex.quote(str(args.model))}")
    return 0


def _quantize_out(args) -> Path:
    """``bakeoff quantize``'s sample count, calibration dataset and output folder, checked; the folder.

    Raises:
        UserError: one of them is not usable, in words that say what to pass.
    """
    if not 1 <= args.num_samples <= MAX_NUM_SAMPLES:
        raise UserError(f"--num-samples must be at least 1 and at most {MAX_NUM_SAMPLES:,}, got {args.num_samples}")
    if args.dataset is not None and not Path(args.dataset).is_file():
        raise UserError(f"--dataset {args.dataset} is not a file; pass a .jsonl with a text field, or one text per line")
    if args.dataset is not None:  # read now by the adapter's own reader, not minutes later in its environment
        # lazy: keeps `bakeoff --help` fast: this module is on its path (adapters.awq_int4 0.1 s)
        from adapters.awq_int4.quantize import load_texts

        try:
            load_texts(args.dataset)
        except (SystemExit, OSError, ValueError, RecursionError) as exc:
            raise UserError(f"--dataset {args.dataset} holds no calibration text ({type(exc).__name__}: "
                            f"{' '.join(str(exc).split())[:100]}); pass a .jsonl with a text field, or one text per line") from None
    if not args.out.strip():  # Path('') is the working folder: the checkpoint would land in it
        raise UserError("--out is empty; pass a new or empty folder for the quantized checkpoint")
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
    return out


def _quantize_source(args, out: Path) -> None:
    """The checkpoint to quantize, checked against ``out`` and read now (its config, whether it is
    already quantized) rather than minutes later in llm-compressor's environment.

    Raises:
        UserError: the output folder cannot be made, or the checkpoint is not a local, unquantized one.
    """
    # lazy: keeps `bakeoff --help` fast: this module is on its path (bakeoff.analysis.preflight 0.1 s, resolve 70 ms)
    from bakeoff.analysis.preflight import describe_quantization
    from bakeoff.host.artifacts import check_creatable
    from bakeoff.models.resolve import check as check_model
    from bakeoff.models.resolve import resolve

    fix = "pass --out in a folder you can write"
    check_creatable(out, "--out", fix)
    check_creatable(out.resolve().parent, "the folder of --out", fix)  # the log and the result go beside --out
    check_model(args.model)
    source_dir = Path(args.model).expanduser().resolve() if not args.model.startswith("fixture:") else None
    if source_dir is not None and (out.resolve() == source_dir or source_dir in out.resolve().parents):
        raise UserError(f"--out {args.out} is inside the checkpoint {args.model}; the quantized copy goes beside it, "
                        "never into it: pass --out DIR outside the model folder")
    if not args.model.startswith("fixture:"):
        source = resolve(args.model, build=False)
        if not source.local:
            raise UserError(f"quantize needs a local checkpoint folder; {args.model} is not one (download it first)")
        # lazy: keeps `bakeoff --help` fast: this module is on its path (bakeoff.host.artifacts 10 ms)
        from bakeoff.host.artifacts import read_json

        try:  # llm-compressor reads it minutes later, after its environment is made: read it now
            config = read_json(Path(source.path) / "config.json")
        except (OSError, ValueError) as exc:
            config = exc
        if not isinstance(config, dict):
            why = f"{type(config).__name__}: {' '.join(str(config).split())[:80]}" if isinstance(config, Exception) else \
                f"a JSON {type(config).__name__}, not an object"
            raise UserError(f"{args.model}/config.json is not a checkpoint config ({why}); pass a Hugging Face checkpoint folder")
        bad = [k for k, v in config.items() if isinstance(v, float) and not math.isfinite(v)]
        if bad:  # JSON's 1e400 reads as inf: no model has an infinite size, and the engine would fail minutes later
            raise UserError(f"{args.model}/config.json has {bad[0]} = {config[bad[0]]}; pass a checkpoint whose config "
                            "holds finite numbers")
        existing = describe_quantization(source.path)
        if existing.get("quantized"):  # quantize_awq's own check, made before its environment is created
            raise UserError(f"{args.model} is already quantized ({existing.get('method')} {existing.get('scheme')}); "
                            "pass it to a backend as it is")


# bounds of `bakeoff calibrate`: beyond them a level would not finish in any useful time
CALIBRATE_LIMITS = {"--ttft-ms": (0.0, 60_000.0), "--itl-ms": (0.0, 10_000.0), "--ttft-budget-ms": (0.0, 60_000.0)}
CALIBRATE_COUNTS = {"--output-tokens": 100_000, "--requests-per-session": 1_000, "--processes": 256,
                    "--server-workers": 64}
MAX_CONCURRENCY = 100_000
MAX_LEVEL_S = 3600.0  # one level's planned schedule (requests per session x stream time)


MAX_LEVELS = 64


def _levels(values: list[str]) -> list[int]:
    """``--concurrency 1,32 --concurrency 256`` -> ``[1, 32, 256]``.

    Raises:
        UserError: an empty item (``1,,2``), a non-number, a level below 1 or above the bound.
    """
    raw = [x.strip() for v in values for x in str(v).split(",")]
    given = " ".join(values)
    if any(not x for x in raw):
        raise UserError(f"--concurrency {given!r} has an empty level; pass whole numbers, e.g. 1,32,256")
    try:
        levels = [int(x) for x in raw]
    except ValueError:
        raise UserError(f"--concurrency takes whole numbers, e.g. 32 or 1,32,256; got {given}") from None
    if len(levels) > MAX_LEVELS:  # each level is a measured point: 5,000 ran on for minutes, silently
        raise UserError(f"--concurrency has {len(levels):,} levels; pass at most {MAX_LEVELS}, e.g. 1,32,256")
    if min(levels) < 1 or max(levels) > MAX_CONCURRENCY:
        raise UserError(f"--concurrency needs levels of at least 1 stream and at most {MAX_CONCURRENCY:,}, e.g. 1,32,256; "
                        f"got {given}")
    return levels


def _check_out(out: str | None) -> Path | None:
    """``--out FILE``: a file (new or to replace) in a folder that exists and can be written.

    Raises:
        UserError: empty, a folder, or a folder that is missing or not writable.
    """
    # lazy: keeps `bakeoff --help` fast: this module is on its path (bakeoff.host.artifacts 10 ms)
    from bakeoff.host.artifacts import check_creatable

    if out is None:
        return None
    path = Path(out).expanduser()
    if not out.strip() or path.is_dir() or out.endswith("/"):
        raise UserError(f"--out {out!r} is a folder or empty; pass a file name for the JSON result, e.g. calibration.json")
    if path.exists() and not path.is_file():
        raise UserError(f"--out {out} is not a regular file; pass a file name for the JSON result")
    if not path.resolve().parent.is_dir():
        raise UserError(f"--out {out}: its folder does not exist; pass a file in an existing folder")
    check_creatable(path.resolve().parent, "the folder of --out", "pass --out in a folder you can write")
    return path


def cmd_calibrate(args) -> int:
    """Run the load generator against the synthetic SSE server and report its own error: prints the
    JSON result; exit 0 when every level is within budget, else 1. Every value is checked first
    (bounded, finite; ``--out`` writable) so that nothing is measured for a result that cannot
    be written or a level that would not end."""
    levels = _levels(args.concurrency)
    for flag, (low, high) in CALIBRATE_LIMITS.items():
        v = getattr(args, flag[2:].replace("-", "_"))
        if not (math.isfinite(v) and low <= v <= high) or (flag == "--ttft-budget-ms" and v <= 0):
            raise UserError(f"{flag} must be a number of milliseconds from {low:g} to {high:,.0f}"
                            f"{' (above 0)' if flag == '--ttft-budget-ms' else ''}, got {v}")
    for flag, high in CALIBRATE_COUNTS.items():
        v = getattr(args, flag[2:].replace("-", "_"))
        if not 1 <= v <= high:
            raise UserError(f"{flag} must be from 1 to {high:,}, got {v}")
    level_s = args.requests_per_session * (args.ttft_ms + args.itl_ms * (args.output_tokens - 1)) / 1e3
    if level_s > MAX_LEVEL_S:
        raise UserError(f"each level would stream for {level_s:,.0f} s (--requests-per-session x (--ttft-ms + --itl-ms x "
                        f"(--output-tokens - 1))), more than {MAX_LEVEL_S:.0f} s; lower --itl-ms or --output-tokens")
    out = _check_out(args.out)
    # lazy: keeps `bakeoff --help` fast: this module is on its path (bakeoff.host.artifacts 10 ms)
    from bakeoff.host.artifacts import atomic_write_text
    from bakeoff.loadgen.calibrate import calibrate_sweep

    t0 = time.monotonic()
    res = calibrate_sweep(levels, stop_at_first_miss=False, ttft_ms=args.ttft_ms, itl_ms=args.itl_ms,
                          output_tokens=args.output_tokens, requests_per_session=args.requests_per_session,
                          processes=args.processes, server_workers=args.server_workers,
                          budget={"ttft_p50_ms": args.ttft_budget_ms})
    res["elapsed_s"] = round(time.monotonic() - t0, 2)
    text = json.dumps(res, indent=2)
    print(text)
    if out is not None:
        atomic_write_text(out, text + "\n")
    return 0 if all(p["within_budget"] for p in res["points"]) else 1


def add_tool_parsers(sub) -> None:
    """Add ``quantize`` and ``calibrate`` to the ``bakeoff`` sub-command parser (handlers by name)."""
    q = sub.add_parser("quantize", help="quantize a checkpoint (AWQ W4A16 as compressed-tensors, llm-compressor)")
    q.add_argument("method", choices=["awq"])
    q.add_argument("--model", required=True, help="checkpoint folder or fixture:NAME")
    q.add_argument("--out", required=True, help="output folder (must not exist or be empty)")
    q.add_argument("--dataset", default=None, help="calibration texts: .jsonl with a text field, or one text per line")
    q.add_argument("--num-samples", type=int, default=64)
    q.add_argument("--mtp-as-released", action="store_true",
                   help="leave the BF16 MTP head out of quantization_config.ignore (the released Qwen3.5 INT4 "
                        "layout, which vLLM's MTP refuses until patched)")
    q.set_defaults(func="cli.tools:cmd_quantize")
    c = sub.add_parser("calibrate", help="measure the load generator's own timing error against a synthetic server",
                       description="Measure the load generator against the synthetic SSE server's send times; prints "
                                   "JSON, exit 0 when every level is within budget, else 1.")
    c.add_argument("--concurrency", action="append", required=True, help="streams per level: 32 or 1,32,256 (repeatable)")
    c.add_argument("--ttft-ms", type=float, default=50.0, help="the server's time to first token (default 50)")
    c.add_argument("--itl-ms", type=float, default=10.0, help="the server's inter-token latency (default 10)")
    c.add_argument("--output-tokens", type=int, default=64)
    c.add_argument("--requests-per-session", type=int, default=3)
    c.add_argument("--processes", type=int, default=1, help="client processes")
    c.add_argument("--server-workers", type=int, default=1, help="synthetic server processes")
    c.add_argument("--ttft-budget-ms", type=float, default=5.0, help="median TTFT error allowed (default 5)")
    c.add_argument("--out", default=None, metavar="FILE", help="also write the JSON result here")
    c.set_defaults(func="cli.tools:cmd_calibrate")
