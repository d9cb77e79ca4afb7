"""A random-weight checkpoint of a real model's shape, for measuring engines at a real size.

Usage: python random_model.py qwen3-1.7b|qwen3-moe|qwen3-small OUT_DIR --tokenizer FIXTURE_DIR [--dtype float32]

The shapes are those of the published configs (Qwen3-1.7B; Qwen3-30B-A3B's layer, cut to 8
layers and 64 experts so that it fits the lent machine's disk and time), bf16, built on the
GPU when there is one. ``qwen3-small`` (~40 M parameters, float32 with ``--dtype float32``) is for
CPU hosts: it decodes in milliseconds per token on 2 cores, as real models do on real hardware,
where the tiny fixture decodes in 0.1 ms and a serving harness's per-token cost is most of it
(``benchmarks/bench_fidelity.py``). The tokenizer is the fixture's (a small vocabulary inside the real
embedding size): outputs are garbage by construction, so such a model is disqualified on
sanity and measured for speed, memory and energy only.
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

SHAPES = {
    "qwen3-1.7b": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 2048,
                   "intermediate_size": 6144, "num_hidden_layers": 28, "num_attention_heads": 16,
                   "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": True,
                   "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6},
    "qwen3-moe": {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
                  "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 64,
                  "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
                  "num_hidden_layers": 8, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                  "vocab_size": 151936, "tie_word_embeddings": False, "max_position_embeddings": 40960,
                  "rope_theta": 1000000.0, "rms_norm_eps": 1e-6},
    "qwen3-small": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 512,
                    "intermediate_size": 1536, "num_hidden_layers": 8, "num_attention_heads": 8,
                    "num_key_value_heads": 4, "head_dim": 64, "vocab_size": 32768, "tie_word_embeddings": True,
                    "max_position_embeddings": 4096, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6},
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("out", type=Path)
    ap.add_argument("--tokenizer", type=Path, required=True, help="a folder with tokenizer.json (the fixture)")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    a = ap.parse_args()
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    t0 = time.monotonic()
    shape = dict(SHAPES[a.shape])
    cfg = AutoConfig.for_model(shape.pop("model_type"), **shape, torch_dtype=a.dtype)
    tok = a.tokenizer
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if (tok / name).is_file():
            a.out.mkdir(parents=True, exist_ok=True)
            shutil.copy2(tok / name, a.out / name)
    import json

    fixture_cfg = json.loads((tok / "config.json").read_text())
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if k in fixture_cfg:
            setattr(cfg, k, fixture_cfg[k])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, torch_dtype=getattr(torch, a.dtype))
    model.save_pretrained(a.out, safe_serialization=True)
    n = sum(p.numel() for p in model.parameters())
    print(f"{a.shape}: {n / 1e9:.3f} B parameters, {a.dtype}, written to {a.out} in {time.monotonic() - t0:.0f} s")


if __name__ == "__main__":
    main()
