#!/usr/bin/env bash
# The third H200 session's runs (2026-12-02, afternoon): the real-size shapes the second session
# did not reach. Queued through device.sh's job runner (jobs run in name order) as the kit's part
# sets arrive: `c` (pydantic, which bakeoff needs and the image lacks) comes with the first call
# beside the fixture (built on the CPU host, carried in .h200/bc), `a` is ONNX Runtime GenAI CUDA,
# `b` vLLM 0.26.0. Runs land in /tmp/art/<set>; `device.sh collect` brings them back.
#
#   runs-20261202b.sh setup   copy the carried fixture cache to /tmp/bc, install set c
#   runs-20261202b.sh models  random Qwen3-1.7B and Qwen3-MoE checkpoints
#   runs-20261202b.sh a       ORT GenAI CUDA int4 on 1.7B; ORT GenAI on the MoE shape
#   runs-20261202b.sh b       the load generator against vllm bench serve on 16 cores (1,000 streams);
#                             vLLM on 1.7B (auto and fp8 KV), on the MoE shape, a capture attempt
set -euo pipefail
D=examples/h200/device.sh
Q="python3 -m bakeoff.cli.main qualify"
M17=/tmp/models/qwen3-1.7b-random
MOE=/tmp/models/qwen3-moe-random
REF=(--reference-opt batching=continuous)
case "$1" in
  setup)
    mkdir -p /tmp/bc && cp -r .h200/bc/. /tmp/bc/ && bash $D install c ;;
  models)
    fix=$(ls -d /tmp/bc/fixtures/tiny-qwen3-[0-9a-f]* | head -1)
    bash $D job j00-models -- bash -c "python3 examples/h200/random_model.py qwen3-1.7b $M17 --tokenizer $fix && python3 examples/h200/random_model.py qwen3-moe $MOE --tokenizer $fix"
    ;;
  a)
    bash $D job j10-ort-1p7b-int4 -- $Q --model $M17 --backends ort-genai --backend-opt execution_provider=cuda --backend-opt precision=int4 "${REF[@]}" --profile full --artifacts /tmp/art/big ;;
  b)
    bash $D job j15-bench -- python3 benchmarks/bench_loadgen.py --concurrency 256,512,1000 --skip-real --reps 3 --out /tmp/art/bench_loadgen_h200.json
    bash $D job j20-vllm-1p7b -- $Q --model $M17 --backends vllm "${REF[@]}" --profile full --artifacts /tmp/art/big
    bash $D job j21-vllm-1p7b-fp8 -- $Q --model $M17 --backends vllm --backend-opt kv_cache_dtype=fp8 "${REF[@]}" --artifacts /tmp/art/big
    bash $D job j22-moe -- $Q --model $MOE --backends vllm,ort-genai --backend-opt ort-genai:execution_provider=cuda --backend-opt ort-genai:precision=fp16 "${REF[@]}" --profile full --artifacts /tmp/art/moe
    bash $D job j30-capture -- $Q --backends vllm --backend-opt gpu_memory_utilization=0.996 --artifacts /tmp/art/failures ;;
  *) echo "usage: runs-20261202b.sh setup|models|a|b" >&2; exit 2 ;;
esac
