"""The command line both quantization children share (llm-compressor AWQ, ModelOpt): source and
output folders, the calibration set and the result file. Runs inside the tools' environments."""

from __future__ import annotations

import argparse


def calibration_parser(description: str) -> argparse.ArgumentParser:
    """``--model --out --dataset --num-samples --max-seq-length --result-json``; callers add theirs."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--dataset", default=None)
    ap.add_argument("--num-samples", type=int, default=64)
    ap.add_argument("--max-seq-length", type=int, default=256)
    ap.add_argument("--result-json", default=None)
    return ap
