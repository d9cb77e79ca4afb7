#!/usr/bin/env bash
# The fourth H200 session's runs (2026-12-03): what the third did not reach. vLLM on the random
# Qwen3-MoE shape (kv_cache_dtype auto and fp8 as one matrix, full profile) and vLLM fp8 KV on the
# Qwen3-1.7B shape. Only vLLM travels this time: one part set `b` (vLLM 0.26.0 and its needs,
# pydantic among them: 90 wheels, 455 MiB in 12 parts of 38 MiB). The code runs from a copy made
# by the first call (/tmp/code), so later calls' trees do not change a run under way.
#
#   runs-20261203.sh setup   first part, the carried fixture cache to /tmp/bc, the code copy,
#                            the random checkpoints queued (they need only the image's torch)
#   runs-20261203.sh b       install set b and queue the vLLM runs
set -euo pipefail
D=examples/h200/device.sh
Q="python3 -m bakeoff.cli.main qualify"
M17=/tmp/models/qwen3-1.7b-random
MOE=/tmp/models/qwen3-moe-random
REF=(--reference-opt batching=continuous)
case "$1" in
  setup)
    bash $D recv b01
    mkdir -p /tmp/bc && cp -r .h200/bc/. /tmp/bc/
    rm -rf /tmp/code && mkdir -p /tmp/code && tar cf - --exclude=./.gpukit --exclude=./.h200 . | tar xf - -C /tmp/code
    fix=$(ls -d /tmp/bc/fixtures/tiny-qwen3-[0-9a-f]* | head -1)
    cd /tmp/code && bash $D job j00-models -- bash -c "python3 examples/h200/random_model.py qwen3-moe $MOE --tokenizer $fix && python3 examples/h200/random_model.py qwen3-1.7b $M17 --tokenizer $fix" ;;
  b)
    bash $D install b
    cd /tmp/code
    bash $D job j20-moe -- $Q --model $MOE --backends vllm --matrix kv_cache_dtype=auto,fp8 "${REF[@]}" --profile full --artifacts /tmp/art/moe
    bash $D job j30-1p7b-fp8 -- $Q --model $M17 --backends vllm --backend-opt kv_cache_dtype=fp8 "${REF[@]}" --profile full --artifacts /tmp/art/big ;;
  *) echo "usage: runs-20261203.sh setup|b" >&2; exit 2 ;;
esac
