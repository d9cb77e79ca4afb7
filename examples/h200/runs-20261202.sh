#!/usr/bin/env bash
# The second H200 session's runs (2026-12-02), queued through device.sh's job runner in sets as
# the kit's parts arrive: `models` needs only the image (torch, transformers), `a` the ORT GenAI
# CUDA part set, `b` vLLM's. Runs land in /tmp/art/<set>; `device.sh collect` brings them back.
set -euo pipefail
D=examples/h200/device.sh
FIX=/tmp/bc/fixtures/tiny-qwen3-67391ac4d72d
Q="python3 -m bakeoff.cli.main qualify"
BIG=(--profile full --reference-opt batching=continuous)
case "$1" in
  models)
    bash $D job j00-models -- bash -c "python3 examples/h200/random_model.py qwen3-1.7b /tmp/models/qwen3-1.7b-random --tokenizer $FIX && python3 examples/h200/random_model.py qwen3-moe /tmp/models/qwen3-moe-random --tokenizer $FIX" ;;
  a)
    bash $D job j10-ort-int4 -- $Q --backends ort-genai --backend-opt execution_provider=cuda --backend-opt precision=int4 --artifacts /tmp/art/fixture
    bash $D job j11-ort-1p7b -- $Q --model /tmp/models/qwen3-1.7b-random --backends ort-genai --matrix precision=fp16,int4 --backend-opt execution_provider=cuda "${BIG[@]}" --artifacts /tmp/art/big ;;
  b)
    bash $D job j20-vllm-spec -- $Q --backends vllm --matrix speculative=none,ngram --artifacts /tmp/art/fixture
    bash $D job j21-vllm-gmu -- $Q --backends vllm --backend-opt gpu_memory_utilization=0.999 --artifacts /tmp/art/failures
    bash $D job j22-vllm-attn -- $Q --backends vllm --backend-opt attention_backend=FLASHINFER --artifacts /tmp/art/failures
    bash $D job j23-vllm-1p7b -- $Q --model /tmp/models/qwen3-1.7b-random --backends vllm "${BIG[@]}" --artifacts /tmp/art/big
    bash $D job j24-moe -- $Q --model /tmp/models/qwen3-moe-random --backends vllm,ort-genai --backend-opt ort-genai:execution_provider=cuda --backend-opt ort-genai:precision=fp16 "${BIG[@]}" --artifacts /tmp/art/big
    bash $D job j30-bench -- python3 benchmarks/bench_loadgen.py --concurrency 256,512,1000 --skip-real --reps 2 --processes-at 256 --out /tmp/art/bench_loadgen_h200.json ;;
  *) echo "usage: runs-20261202.sh models|a|b" >&2; exit 2 ;;
esac
