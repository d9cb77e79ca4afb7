#!/usr/bin/env bash
# Issue 28, ONNX Runtime GenAI part: bakeoff's ORT GenAI CUDA default (PagedAttention export,
# og.Engine continuous batching) on the random Qwen3-1.7B shape at 1 / 8 / 32 sessions against the
# bare og loops on the same export, plus the paged_attention=false side of the matrix. Only the ORT
# GenAI kit travels: set `a` (onnxruntime-genai-cuda 0.18.0, onnxruntime-gpu 1.31.1, pydantic;
# 263 MiB). A run call carries at most 64 MiB with the working tree (~22 MiB), so parts of 34 MiB:
#
#   on the CPU host: python3 ../shared/gpu-kit/resolve.py /tmp/kit-a onnxruntime-genai-cuda==0.18.0 \
#                      onnxruntime-gpu==1.31.1 pydantic
#                    mkdir -p .gpukit/parts && (cd /tmp/kit-a && tar cf - *.whl) | split -b 34M -d -a 2 - .gpukit/parts/a
#                    mkdir -p .h200/bc/fixtures && cp -r ~/.cache/bakeoff/fixtures/tiny-qwen3-* .h200/bc/fixtures/
#   on the H200, one call each (carry the part; keep calls < 30 s apart or the machine is handed back):
#     runs-20261203b.sh setup            part a00, the fixture (carry .h200), the code copy, the model
#     bash examples/h200/device.sh recv a01 ... a07
#     runs-20261203b.sh a                install set a, queue the jobs; then `device.sh status` / `collect`
#
# Seen 2026-12-03 (a helper's session, by hand, same commands; docs/gpu.md): with the default (paged
# + CUDA graphs) the worker made 384 / 2,672 / 7,788 tok/s at 1 / 8 / 32 sessions, 1.00 / 0.95 /
# 0.88 of a bare og.Engine loop on its export (was 116 / 258 / 923 without PagedAttention).
set -euo pipefail
D=examples/h200/device.sh
M17=/tmp/models/qwen3-1.7b-random
Q="python3 -m bakeoff.cli.main qualify"
REF=(--reference-opt batching=continuous)
CUDA=(--backend-opt execution_provider=cuda --backend-opt precision=fp16)
case "${1:-}" in
  setup)
    bash $D recv a00
    mkdir -p /tmp/bc && cp -r .h200/bc/. /tmp/bc/
    rm -rf /tmp/code && mkdir -p /tmp/code && tar cf - --exclude=./.gpukit --exclude=./.h200 . | tar xf - -C /tmp/code
    fix=$(ls -d /tmp/bc/fixtures/tiny-qwen3-[0-9a-f]* | head -1)
    cd /tmp/code && bash $D job j00-model -- python3 examples/h200/random_model.py qwen3-1.7b $M17 --tokenizer "$fix" ;;
  a)
    bash $D install a
    cd /tmp/code
    # the CUDA-only checks: a paged export inspected (forward step with in-place caches, og.Engine's
    # token), the backend's default (paged, continuous batching) streaming, logprobs through the graph
    bash $D job j10-paged-tests -- python3 -m pytest tests/test_ort_genai_paged.py -q -p no:cacheprovider
    # bakeoff's sweep vs the bare loops, paired (issue 28's table; target >= 0.90 at 1, 8 and 32)
    bash $D job j20-fidelity -- python3 benchmarks/bench_fidelity.py --model $M17 --engines ort-genai \
      --sessions 1,8,32 --max-tokens 128 --backend-opt ort-genai:execution_provider=cuda \
      --backend-opt ort-genai:precision=fp16 --out /tmp/art/fidelity-ort-genai.json
    # the worker alone under bakeoff's closed loop vs bare og loops (og.Generator batch too where it can run)
    bash $D job j21-worker-paged -- python3 benchmarks/ort_genai_fidelity.py --model $M17 "${CUDA[@]}" \
      --sessions 1,8,32 --max-tokens 128 --cycles 3
    bash $D job j22-worker-static -- python3 benchmarks/ort_genai_fidelity.py --model $M17 "${CUDA[@]}" \
      --backend-opt paged_attention=false --sessions 1,8,32 --max-tokens 128 --cycles 3
    bash $D job j23-worker-no-graph -- python3 benchmarks/ort_genai_fidelity.py --model $M17 "${CUDA[@]}" \
      --backend-opt cuda_graph=false --sessions 1,8,32 --max-tokens 128 --cycles 3
    # the verdict and the sweep with the new default, then both exports as one matrix
    bash $D job j30-qualify -- $Q --model $M17 --backends ort-genai "${CUDA[@]}" "${REF[@]}" --profile full \
      --artifacts /tmp/art/big
    bash $D job j31-matrix -- $Q --model $M17 --backends ort-genai "${CUDA[@]}" --matrix paged_attention=true,false \
      "${REF[@]}" --profile full --artifacts /tmp/art/matrix ;;
  *) echo "usage: runs-20261203b.sh setup|a" >&2; exit 2 ;;
esac
