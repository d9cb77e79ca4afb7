"""AWQ W4A16 quantization with llm-compressor; runs INSIDE the llm-compressor environment.

Standalone on purpose (standard library + the environment's packages only), so that it also
runs as a Hugging Face Job or by hand::

    python adapters/awq_int4/quantize.py --model IN --out OUT [--dataset FILE] [--num-samples N]
        [--max-seq-length L] [--result-json PATH]

API used (read from llmcompressor 0.14.0.1's installed source):
- ``llmcompressor.oneshot(model=, tokenizer=, dataset=, recipe=, max_seq_length=,
  num_calibration_samples=)`` (``entrypoints/oneshot.py``);
- ``llmcompressor.modifiers.transform.awq.AWQModifier(mappings=None, offload_device=...,
  duo_scaling=True, n_grid=20)`` (the scaling transform; mappings resolved per architecture)
  followed by ``llmcompressor.modifiers.quantization.QuantizationModifier(scheme="W4A16_ASYM",
  targets=["Linear"], ignore=["lm_head"])``; ``llmcompressor.modifiers.awq.AWQModifier`` is a
  deprecated shim for this pair;
- ``model.save_pretrained(out, save_compressed=True)`` writes compressed-tensors
  (``pack-quantized``).

Workaround (docs/field-notes.md "Quantization and export tools"): on a host with no accelerator,
AWQ's smoothing loop calls ``IntermediatesCache.pin_memory`` unconditionally
(``modifiers/transform/awq/base.py``), which fails with ``RuntimeError: Cannot access
accelerator device when none is available``. Pinning only speeds up host-to-device copies, so it
is made a no-op at runtime when no accelerator is present (site-packages is never edited), and
the workaround is recorded in the result.
"""

from __future__ import annotations

import json
import os
import sys
import time

from adapters._calibration import calibration_parser

SCHEME = "W4A16_ASYM"

# A small, varied built-in calibration set (prose, dialogue, code, numbers, lists).
BUILTIN_TEXTS = [
    "The river bent twice before it reached the town, and each bend had a mill on it.",
    "Q: How many legs does a spider have? A: Eight, arranged in four pairs.",
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a",
    "Shopping list: flour, eggs, two lemons, a bag of rice, olive oil and fresh basil.",
    "In 1969 the first crewed landing on the Moon took place; the mission lasted eight days.",
    "She opened the letter slowly, read the first line, and laughed out loud.",
    "SELECT name, COUNT(*) FROM orders WHERE status = 'shipped' GROUP BY name ORDER BY 2 DESC;",
    "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen.",
    "count: 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25",
    "Dear team, the release is scheduled for Thursday; please merge your fixes by Tuesday noon.",
    "A prime number has exactly two divisors: 2, 3, 5, 7, 11, 13, 17, 19, 23 and 29 are the first ten.",
    "The recipe says to knead the dough for ten minutes, then let it rest in a warm place.",
    "import json\nwith open('config.json') as fh:\n    cfg = json.load(fh)\nprint(cfg['hidden_size'])",
    "User: Can you translate 'good morning' into French? Assistant: Bonjour.",
    "Mountains form where tectonic plates collide and push the crust upward over millions of years.",
    "The committee approved the budget by seven votes to two after a long debate.",
    "copy: red green blue => red green blue",
    "To reset the router, hold the button on the back for ten seconds until the light blinks.",
    "Water boils at 100 degrees Celsius at sea level, and at lower temperatures on high mountains.",
    "He played the same four notes again and again until the melody finally made sense.",
    "for (int i = 0; i < n; ++i) { sum += values[i] * weights[i]; }",
    "The library closes at eight on weekdays and at five on Saturdays; it is closed on Sundays.",
    "Seventeen plus twenty-five equals forty-two; forty-two divided by six equals seven.",
    "Autumn leaves turn red and yellow as trees stop producing chlorophyll.",
]


def load_texts(path: str | None) -> tuple[list[str], str]:
    """Calibration texts and a description of their source.

    A ``.jsonl`` file gives one record per line: its ``text`` field, else its first string
    value; any other file gives one text per non-empty line.
    """
    if not path:
        return list(BUILTIN_TEXTS), "builtin"
    texts: list[str] = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            line = line.strip()
            if not line:
                continue
            if path.endswith(".jsonl"):
                rec = json.loads(line)
                text = rec.get("text") if isinstance(rec, dict) else rec
                if not isinstance(text, str) and isinstance(rec, dict):
                    text = next((v for v in rec.values() if isinstance(v, str)), None)
                if isinstance(text, str) and text.strip():
                    texts.append(text)
            else:
                texts.append(line)
    if not texts:
        raise SystemExit(f"calibration file {path} has no text")
    return texts, os.path.abspath(path)


def apply_cpu_workaround() -> list[str]:
    """Make ``IntermediatesCache.pin_memory`` a no-op when no accelerator exists."""
    import torch

    accel = getattr(torch, "accelerator", None)
    has_accel = torch.cuda.is_available() or bool(accel and accel.is_available())
    if has_accel:
        return []
    from llmcompressor.pipelines.cache import IntermediatesCache

    IntermediatesCache.pin_memory = lambda self, batch_index, input_names=None: None
    return ["llmcompressor.pipelines.cache.IntermediatesCache.pin_memory made a no-op at runtime: no "
            "accelerator on this host and AWQ's smoothing loop pins unconditionally ('RuntimeError: Cannot "
            "access accelerator device when none is available'); pinning only speeds up host-to-device copies"]


def main(argv: list[str] | None = None) -> int:
    ap = calibration_parser(__doc__.splitlines()[0])
    ap.add_argument("--ignore", action="append", default=[], help="a module pattern left unquantized (repeatable)")
    args = ap.parse_args(argv)

    t0 = time.monotonic()
    import compressed_tensors
    import llmcompressor
    import torch
    import transformers
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.modifiers.transform.awq import AWQModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    workarounds = apply_cpu_workaround()
    texts, source = load_texts(args.dataset)
    texts = texts[: args.num_samples]
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype="auto")
    ds = Dataset.from_dict({"text": texts}).map(
        lambda ex: tokenizer(ex["text"], truncation=True, max_length=args.max_seq_length, add_special_tokens=False),
        remove_columns=["text"])
    ignore = args.ignore or ["lm_head"]
    recipe = [AWQModifier(duo_scaling=True),
              QuantizationModifier(scheme=SCHEME, targets=["Linear"], ignore=ignore)]
    t_cal = time.monotonic()
    oneshot(model=model, tokenizer=tokenizer, dataset=ds, recipe=recipe, max_seq_length=args.max_seq_length,
            num_calibration_samples=len(texts))
    oneshot_s = time.monotonic() - t_cal
    model.save_pretrained(args.out, save_compressed=True)
    tokenizer.save_pretrained(args.out)
    with open(os.path.join(args.out, "config.json")) as fh:
        qc = json.load(fh).get("quantization_config", {})
    result = {
        "method": "awq", "scheme": SCHEME, "tool": "llmcompressor",
        "recipe": [{"AWQModifier": {"duo_scaling": True, "mappings": "default for the architecture"}},
                   {"QuantizationModifier": {"scheme": SCHEME, "targets": ["Linear"], "ignore": ignore}}],
        "calibration": {"source": source, "num_samples": len(texts), "max_seq_length": args.max_seq_length,
                        "tokens": int(sum(len(x) for x in ds["input_ids"]))},
        "duration_s": round(time.monotonic() - t0, 2), "oneshot_s": round(oneshot_s, 2),
        "versions": {"llmcompressor": llmcompressor.__version__, "compressed-tensors": compressed_tensors.__version__,
                     "torch": torch.__version__, "transformers": transformers.__version__,
                     "python": sys.version.split()[0]},
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "workarounds": workarounds,
        "quantization_config": qc,
    }
    if args.result_json:
        with open(args.result_json, "w") as fh:
            json.dump(result, fh, indent=2, default=str)
    print("bakeoff-quantization " + json.dumps({"duration_s": result["duration_s"], "format": qc.get("format")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
