#!/usr/bin/env bash
# Issue 38 on the H200, 2026-12-06: ORT GenAI CUDA fp16 (bakeoff's default: PagedAttention export, og.Engine
# continuous batching, CUDA graphs) against the bare og loops at 1, 8 and 32 sessions, each ratio with its
# 95% interval and more pairs until the interval's half-width is <= 0.03 (up to 10); and the trained
# fixture qualified on CUDA, which also runs the GPU telemetry that now samples every visible GPU.
# Kit a (8 parts of 36 MiB, the tree being 24 MiB: onnxruntime-genai-cuda 0.18.0, onnxruntime-gpu 1.31.1, pydantic), made with
# ../shared/gpu-kit/resolve.py and split.sh; calls: `recv a00` + setup, `recv a01`..`recv a06`, `recv a07` + a +
# `wait`, then `wait` until the queue is empty.
set -euo pipefail
D=examples/h200/device.sh
M17=/tmp/models/qwen3-1.7b-random
case "${1:-}" in
  setup)
    rm -rf /tmp/code && mkdir -p /tmp/code && tar cf - --exclude=./.gpukit . | tar xf - -C /tmp/code
    cd /tmp/code && bash $D job j00-model -- python3 examples/h200/random_model.py qwen3-1.7b $M17 \
      --tokenizer bakeoff/models/fixtures/shipped/tiny-qwen3 ;;
  a)
    bash $D install a
    cd /tmp/code
    bash $D job j20-fidelity-ort -- python3 benchmarks/bench_fidelity.py --model $M17 --sessions 1,8,32 --max-tokens 128 \
      --engines ort-genai --requests-per-session 8 --pairs 5 --max-pairs 10 \
      --backend-opt ort-genai:execution_provider=cuda --backend-opt ort-genai:precision=fp16 \
      --out /tmp/art/fidelity-ort-genai.json
    bash $D job j25-qualify-ort-fixture -- python3 -m bakeoff.cli.main qualify --model fixture:tiny-qwen3 \
      --backends ort-genai --backend-opt execution_provider=cuda --backend-opt precision=fp16 \
      --artifacts /tmp/art/qualify-fixture ;;
  b)  # a fresh machine: setup first; kit b (13 parts of 36 MiB: vLLM 0.26.0 and its needs, pydantic among them,
      # without tokenspeed-triton, tilelang, z3-solver, PyNvVideoCodec and torchcodec)
    bash $D install b
    cd /tmp/code
    bash $D job j30-fidelity-vllm -- python3 benchmarks/bench_fidelity.py --model $M17 --sessions 1,8,32 --max-tokens 128 \
      --engines vllm --requests-per-session 16 --pairs 5 --max-pairs 6 --out /tmp/art/fidelity-vllm.json ;;
  *) echo "usage: runs-20261206.sh setup|a|b" >&2; exit 2 ;;
esac
