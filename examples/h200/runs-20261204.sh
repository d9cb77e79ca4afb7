#!/usr/bin/env bash
# Issue 28 on the H200, one session (2026-12-04): bakeoff's figure beside each engine's own tool on
# the random Qwen3-1.7B shape at 1 / 8 / 32 sessions, 128 output tokens (benchmarks/bench_fidelity.py):
# ORT GenAI CUDA fp16 (bakeoff's default: PagedAttention export, og.Engine, CUDA graphs) against the
# bare og loops; vLLM 0.26.0 against `vllm bench serve` on bakeoff's own server, with bakeoff's
# sweep body and with none; then the paged ORT GenAI export qualified on CUDA. Results (25.4 device
# minutes): fidelity-20261204/ beside this file, docs/gpu.md "Fidelity on the H200 (2026-12-04)".
#
#   on the CPU host: python3 ../shared/gpu-kit/resolve.py /tmp/kit-a onnxruntime-genai-cuda==0.18.0 \
#                      onnxruntime-gpu==1.31.1 pydantic
#                    python3 ../shared/gpu-kit/resolve.py /tmp/kit-b xgrammar==0.2.7 pycountry vllm==0.26.0
#                    (rm from /tmp/kit-b: tokenspeed_triton, tilelang, pynvvideocodec, z3_solver, torchcodec)
#                    mkdir -p .gpukit/parts; for k in a b; do (cd /tmp/kit-$k && tar cf - *.whl) |
#                      split -b 40M -d -a 2 - .gpukit/parts/$k; done          # a00-a06, b00-b11 (the tree is ~23 MB)
#   on the H200, one call each, carrying the part (calls < 30 s apart or the machine goes back):
#     runs-20261204.sh setup        (carry .gpukit/parts/a00): the code copy, the model job
#     bash examples/h200/device.sh recv a01 ... a06
#     runs-20261204.sh a            install set a, queue the ORT GenAI jobs
#     bash examples/h200/device.sh recv b00 ... b11
#     runs-20261204.sh b            install set b, queue the vLLM jobs; then device.sh status / collect
set -euo pipefail
D=examples/h200/device.sh
M17=/tmp/models/qwen3-1.7b-random
FID=(python3 benchmarks/bench_fidelity.py --model $M17 --sessions 1,8,32 --max-tokens 128 --pairs 3)
case "${1:-}" in
  setup)
    bash $D recv a00
    rm -rf /tmp/code && mkdir -p /tmp/code && tar cf - --exclude=./.gpukit . | tar xf - -C /tmp/code
    cd /tmp/code && bash $D job j00-model -- python3 examples/h200/random_model.py qwen3-1.7b $M17 \
      --tokenizer bakeoff/models/fixtures/shipped/tiny-qwen3 ;;
  a)
    bash $D install a
    cd /tmp/code
    bash $D job j10-paged-tests -- python3 -m pytest tests/test_ort_genai_paged.py -q -p no:cacheprovider
    bash $D job j20-fidelity-ort -- "${FID[@]}" --engines ort-genai --backend-opt ort-genai:execution_provider=cuda \
      --backend-opt ort-genai:precision=fp16 --out /tmp/art/fidelity-ort-genai.json ;;
  b)
    bash $D install b
    cd /tmp/code
    bash $D job j30-fidelity-vllm -- "${FID[@]}" --engines vllm --vllm-bodies sweep,none \
      --out /tmp/art/fidelity-vllm.json
    # the same with 16 requests per session (runs of 4 lasted under a second at 8 sessions: noisy)
    bash $D job j35-fidelity-vllm-long -- "${FID[@]}" --engines vllm --requests-per-session 16 \
      --out /tmp/art/fidelity-vllm-long.json
    # the trained fixture on CUDA with the default (paged) export; then by hand, not queued here, the
    # same with --backend-opt paged_attention=false (qualified)
    bash $D job j36-qualify-ort-fixture -- python3 -m bakeoff.cli.main qualify --model fixture:tiny-qwen3 \
      --backends ort-genai --backend-opt execution_provider=cuda --backend-opt precision=fp16 \
      --artifacts /tmp/art/qualify-fixture
    bash $D job j40-qualify-ort -- python3 -m bakeoff.cli.main qualify --model $M17 --backends ort-genai \
      --backend-opt execution_provider=cuda --backend-opt precision=fp16 --reference-opt batching=continuous \
      --artifacts /tmp/art/qualify ;;
  *) echo "usage: runs-20261204.sh setup|a|b" >&2; exit 2 ;;
esac
