"""ModelOpt post-training quantization and unified-HF export; runs INSIDE the ModelOpt environment.

The checkpoint it writes (``config.json`` ``quantization_config`` / ``hf_quant_config.json``,
producer ``modelopt``) is what TensorRT-LLM's PyTorch backend loads as pre-quantized input
(``tensorrt_llm/llmapi/llm_utils.py`` ``is_modelopt_quant_config``).

API (NVIDIA ModelOpt documentation, "PyTorch quantization" and "Unified HF export";
``modelopt/torch/export/unified_export_hf.py``):
- ``import modelopt.torch.quantization as mtq``; ``mtq.quantize(model, mtq.INT4_AWQ_CFG |
  mtq.FP8_DEFAULT_CFG | mtq.NVFP4_DEFAULT_CFG, forward_loop)`` where ``forward_loop(model)``
  runs the calibration batches;
- ``from modelopt.torch.export import export_hf_checkpoint``;
  ``export_hf_checkpoint(model, export_dir=OUT)``.

Run as ``python adapters/trtllm_build/modelopt_quant.py --model IN --out OUT --qformat int4_awq
[--dataset FILE] [--num-samples N] [--max-seq-length L] [--result-json PATH]``.
"""

from __future__ import annotations

import json
import os
import sys
import time

from adapters._calibration import calibration_parser
from adapters.awq_int4.quantize import load_texts

QFORMATS = {"int4_awq": "INT4_AWQ_CFG", "fp8": "FP8_DEFAULT_CFG", "nvfp4": "NVFP4_DEFAULT_CFG"}


def main(argv: list[str] | None = None) -> int:
    ap = calibration_parser(__doc__.splitlines()[0])
    ap.add_argument("--qformat", choices=sorted(QFORMATS), default="int4_awq")
    args = ap.parse_args(argv)

    t0 = time.monotonic()
    import modelopt
    import modelopt.torch.quantization as mtq
    import torch
    import transformers
    from modelopt.torch.export import export_hf_checkpoint
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not torch.cuda.is_available():
        raise SystemExit("ModelOpt PTQ for TensorRT-LLM runs on an NVIDIA GPU; torch sees none")
    texts, source = load_texts(args.dataset)
    texts = texts[: args.num_samples]
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype="auto").cuda().eval()
    batches = [tokenizer(t, return_tensors="pt", truncation=True, max_length=args.max_seq_length,
                         add_special_tokens=False).input_ids.cuda() for t in texts]

    def forward_loop(m):
        with torch.no_grad():
            for ids in batches:
                m(ids)

    config = getattr(mtq, QFORMATS[args.qformat])
    t_cal = time.monotonic()
    model = mtq.quantize(model, config, forward_loop)
    quant_s = time.monotonic() - t_cal
    export_hf_checkpoint(model, export_dir=args.out)
    tokenizer.save_pretrained(args.out)
    qc = {}
    for name in ("hf_quant_config.json", "config.json"):
        path = os.path.join(args.out, name)
        if os.path.exists(path):
            with open(path) as fh:
                data = json.load(fh)
            qc = data if name == "hf_quant_config.json" else data.get("quantization_config", qc)
            if qc:
                break
    result = {"tool": "modelopt", "qformat": args.qformat, "config": QFORMATS[args.qformat],
              "calibration": {"source": source, "num_samples": len(texts), "max_seq_length": args.max_seq_length},
              "duration_s": round(time.monotonic() - t0, 2), "quantize_s": round(quant_s, 2),
              "versions": {"modelopt": modelopt.__version__, "torch": torch.__version__,
                           "transformers": transformers.__version__, "python": sys.version.split()[0]},
              "device": torch.cuda.get_device_name(0), "quantization_config": qc}
    if args.result_json:
        with open(args.result_json, "w") as fh:
            json.dump(result, fh, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
