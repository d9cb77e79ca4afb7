"""The ``bakeoff jobs`` argument parser (light: argparse only; the handlers in
:mod:`cli.jobs.cli`, which imports pydantic and huggingface_hub, are named by string and
imported only when a ``jobs`` command runs)."""

from __future__ import annotations

from pathlib import Path

import adapters

REPO = Path(__file__).resolve().parents[2]
DEFAULT_ARTIFACTS = str(REPO / "artifacts") if (REPO / "pyproject.toml").is_file() else "artifacts"  # as bakeoff qualify
H = "cli.jobs.cli:"  # the handlers' module


def _common(p, artifacts: bool = False) -> None:
    p.add_argument("--endpoint", default=None, help="Hub endpoint (default: $HF_ENDPOINT or https://huggingface.co)")
    p.add_argument("--namespace", default=None, help="user or org owning the jobs (default: the token's user)")
    if artifacts:
        p.add_argument("--artifacts", default=DEFAULT_ARTIFACTS)


def _submission(p) -> None:
    _common(p, artifacts=True)
    p.add_argument("--model", default="fixture:tiny-qwen3", help="fixture:NAME or a Hub id (a local path only for uv run here)")
    p.add_argument("--push-to", default=None, help="org/name, datasets/org/name, file:///abs/path (local runs) or none")
    p.add_argument("--path-in-repo", default=None, help="folder in the target (default: export at the root, "
                   "qualify under jobs/<tag>-<flavor>)")
    p.add_argument("--timeout", default="1h", help="job timeout: 30m, 2h, or seconds (default 1h)")
    p.add_argument("--secret", action="append", default=[], metavar="NAME", help="secret NAME; its value is read from "
                   "this environment (HF_TOKEN: or the saved login) and never written (repeatable)")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="plain environment variable")
    p.add_argument("--label", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--image", default=None, help="Docker image with uv (default: huggingface_hub's uv image)")
    p.add_argument("--python", default=None, help="Python version for uv run inside the job")
    p.add_argument("--bakeoff-spec", default=None, help="how the job installs bakeoff: git+https://...@REV, a version, "
                   "a wheel or the repo folder (paths: local uv run only); default bakeoff==<this version>")
    p.add_argument("--torch-index", default="auto", help="auto (PyTorch CPU index on cpu-* flavors) | pytorch-cpu | pypi")
    p.add_argument("--dry-run", action="store_true", help="print the script and the job request; submit nothing")
    p.add_argument("--save-script", default=None, metavar="PATH", help="also write the script (for uv run PATH)")


def add_jobs_parser(sub) -> None:
    """Add ``jobs`` and its subcommands to bakeoff's subparsers."""
    j = sub.add_parser("jobs", help="run exports and qualifications as Hugging Face Jobs (see docs/jobs.md)")
    js = j.add_subparsers(dest="command_jobs", metavar="ACTION", parser_class=type(j))
    e = js.add_parser("export", help="an adapter pipeline (ort-genai INT4/QMoE export, awq-int4, gguf, ...) as a job")
    e.add_argument("pipeline", choices=adapters.names())
    _submission(e)
    e.add_argument("--flavor", default="cpu-xl")
    # each flag is an adapter Options field of the same name; one the pipeline lacks is refused, and
    # one left out takes that adapter's default (ort-genai int4, optimum-onnx fp32, openvino fp16)
    e.add_argument("--precision", default=None, help="ort-genai: fp32|fp16|bf16|int8|int4; optimum-onnx: fp32|int8")
    e.add_argument("--execution-provider", default=None)
    e.add_argument("--block-size", type=int, default=None)
    e.add_argument("--accuracy-level", type=int, default=None)
    e.add_argument("--int4-algo", default=None)
    e.add_argument("--moe-quant-type", default=None, help="QMoE expert precision (int4, int8, ...)")
    e.add_argument("--qmoe-block-size", type=int, default=None)
    e.add_argument("--extra-option", action="append", default=[], metavar="KEY=VALUE", help="builder --extra_options")
    e.add_argument("--num-samples", type=int, default=None, help="awq-int4 calibration samples")
    e.add_argument("--max-seq-length", type=int, default=None, help="awq-int4 calibration tokens per sample")
    e.add_argument("--opset", type=int, default=None, help="optimum-onnx: ONNX opset")
    e.add_argument("--weight-format", default=None, help="openvino: fp32|fp16|int8|int4 (NNCF compression)")
    e.add_argument("--group-size", type=int, default=None, help="openvino: int4 group size (-1: per channel)")
    e.add_argument("--ratio", type=float, default=None, help="openvino: share of layers in int4, the rest int8")
    e.add_argument("--sym", action="store_true", default=None, help="openvino: symmetric int4/int8 compression")
    e.add_argument("--outtype", default=None, help="gguf: q8_0|f16|bf16|f32|auto (llama.cpp's converter)")
    e.set_defaults(func=H + "cmd_submit")
    q = js.add_parser("qualify", help="`bakeoff qualify` as one job per flavor")
    _submission(q)
    q.add_argument("--flavors", "--flavor", dest="flavors", default=None, help="comma-separated: one job each (default l40sx1)")
    q.add_argument("--backends", required=True)
    q.add_argument("--profile", default="quick", choices=["quick", "full"])
    q.add_argument("--backend-opt", action="append", default=[], metavar="[BACKEND:]KEY=VALUE")
    q.add_argument("--reference-model", default=None)
    q.set_defaults(func=H + "cmd_submit", flavor="l40sx1")
    for name, fn, help_ in (("status", "cmd_status", "stage of jobs"), ("cancel", "cmd_cancel", "cancel jobs")):
        p = js.add_parser(name, help=help_)
        p.add_argument("job_ids", nargs="+")
        _common(p)
        p.set_defaults(func=H + fn)
    lg = js.add_parser("logs", help="a job's logs (--follow: until it ends)")
    lg.add_argument("job_id")
    lg.add_argument("--follow", "-f", action="store_true")
    lg.add_argument("--tail", type=int, default=None)
    _common(lg)
    lg.set_defaults(func=H + "cmd_logs")
    w = js.add_parser("wait", help="block until jobs end; exit 1 unless all COMPLETED")
    w.add_argument("job_ids", nargs="+")
    w.add_argument("--timeout-s", type=float, default=None)
    w.add_argument("--poll-s", type=float, default=5.0)
    _common(w)
    w.set_defaults(func=H + "cmd_wait")
    f = js.add_parser("fetch", help="copy pushed run directories into artifacts/runs/")
    f.add_argument("job_ids", nargs="*")
    f.add_argument("--from", dest="from_", default=None, metavar="TARGET", help="org/name, datasets/org/name or file:///path")
    f.add_argument("--path-in-repo", default=None)
    _common(f, artifacts=True)
    f.set_defaults(func=H + "cmd_fetch")
    h = js.add_parser("hardware", help="job flavors and prices from the Hub")
    _common(h)
    h.set_defaults(func=H + "cmd_hardware")
