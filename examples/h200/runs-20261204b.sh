#!/usr/bin/env bash
# Issue 28 on the H200, second session of 2026-12-04: the targets left open by runs-20261204.sh.
# ORT GenAI CUDA fp16 (default: PagedAttention export, og.Engine continuous batching, CUDA graphs)
# against the bare og loops with an engine step's frames sent as one frame and made beside the next
# step (StepFramer); vLLM 0.26.0 against `vllm bench serve` on bakeoff's own server with 16 requests
# per session and 5 pairs (3
# pairs of 4 requests could not resolve 8 sessions); the trained fixture qualified on CUDA with the
# default paged export (the inspection's og.Engine token fixed in c953fb2). Same kit parts and
# procedure as runs-20261204.sh (setup with a00, recv a01-a04, `a`, recv b00-b07, `recv b08` + `b`).
set -euo pipefail
D=examples/h200/device.sh
M17=/tmp/models/qwen3-1.7b-random
FID=(python3 benchmarks/bench_fidelity.py --model $M17 --sessions 1,8,32 --max-tokens 128)
case "${1:-}" in
  setup)
    bash $D recv a00
    rm -rf /tmp/code && mkdir -p /tmp/code && tar cf - --exclude=./.gpukit . | tar xf - -C /tmp/code
    cd /tmp/code && bash $D job j00-model -- python3 examples/h200/random_model.py qwen3-1.7b $M17 \
      --tokenizer bakeoff/models/fixtures/shipped/tiny-qwen3 ;;
  a)
    bash $D install a
    cd /tmp/code
    bash $D job j20-fidelity-ort -- "${FID[@]}" --engines ort-genai --requests-per-session 8 --pairs 5 \
      --backend-opt ort-genai:execution_provider=cuda --backend-opt ort-genai:precision=fp16 \
      --out /tmp/art/fidelity-ort-genai.json
    bash $D job j25-qualify-ort-fixture -- python3 -m bakeoff.cli.main qualify --model fixture:tiny-qwen3 \
      --backends ort-genai --backend-opt execution_provider=cuda --backend-opt precision=fp16 \
      --artifacts /tmp/art/qualify-fixture ;;
  b)
    bash $D install b
    cd /tmp/code
    bash $D job j30-fidelity-vllm -- "${FID[@]}" --engines vllm --requests-per-session 16 --pairs 5 \
      --out /tmp/art/fidelity-vllm.json ;;
  *) echo "usage: runs-20261204b.sh setup|a|b" >&2; exit 2 ;;
esac
