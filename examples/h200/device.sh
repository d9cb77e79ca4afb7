#!/usr/bin/env bash
# How the H200 runs in examples/h200/ were made: the lent H200 machine has no package index, so
# the engines travel as wheel parts (.gpukit/parts, made by ../shared/gpu-kit's resolve.py and
# split into 60 MiB pieces: a* = ONNX Runtime GenAI CUDA + onnxruntime-gpu + pydantic, b* = vLLM
# 0.26.0 and its needs), one part per device call, appended under /tmp/k. Jobs run one after
# another in a background runner (setsid: it outlives the call), so later calls carry parts
# while the GPU works. Each call ends with `status`.
#
#   device.sh recv PART            append .gpukit/parts/PART to /tmp/k/<a|b>.tar
#   device.sh install a|b          untar and pip install --no-index --no-deps --target /tmp/site
#   device.sh job NAME -- CMD...   queue CMD (run from the repo with the kit on PYTHONPATH)
#   device.sh status               the runner's progress, the GPU, the queue
#   device.sh collect              runs (JSON, logs; no weights) as one tar.gz under $OUT
#   device.sh wait SECS            keep the machine busy until the queue is empty or SECS pass, then
#                                  collect (so a machine lost later loses nothing) and status
set -uo pipefail
K=/tmp/k; Q=$K/queue; LOGS=$K/logs
mkdir -p "$K" "$Q" "$LOGS"
repo=$(pwd)
export PYTHONPATH=/tmp/site BAKEOFF_CACHE=/tmp/bc BAKEOFF_ENVS=preinstalled PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1

runner() {  # one job at a time, in name order, until the queue has been empty for 20 minutes
  idle=0
  while [ $idle -lt 1200 ]; do
    job=$(ls "$Q" 2>/dev/null | grep -v '\.running$' | sort | head -1)
    if [ -z "$job" ]; then sleep 2; idle=$((idle + 2)); continue; fi
    idle=0; mv "$Q/$job" "$Q/$job.running"
    echo "$(date -u +%T) start $job" >> "$LOGS/runner.log"
    (cd "$repo" && bash "$Q/$job.running") > "$LOGS/$job.log" 2>&1
    echo "$(date -u +%T) end $job rc=$?" >> "$LOGS/runner.log"; rm -f "$Q/$job.running"
  done
}

case "${1:-}" in
  recv) p=$2; cat ".gpukit/parts/$p" >> "$K/${p:0:1}.tar"; ls -la "$K"/*.tar ;;
  install)
    mkdir -p "$K/$2" /tmp/site && tar xf "$K/$2.tar" -C "$K/$2" && rm "$K/$2.tar" &&
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$K/$2"/*.whl &&
      echo "kit $2 installed: $(ls "$K/$2" | wc -l) wheels" ;;
  job) name=$2; shift 3; printf '%q ' "$@" > "$Q/$name"; echo >> "$Q/$name"
    if ! pgrep -f "device.sh runner" >/dev/null; then setsid nohup bash "$0" runner >/dev/null 2>&1 < /dev/null & fi
    echo "queued $name" ;;
  runner) runner ;;
  status)
    cat "$LOGS/runner.log" 2>/dev/null; ls "$Q"
    for f in $(ls -t "$LOGS"/*.log 2>/dev/null | grep -v runner | head -1); do echo "== $f"; tail -c 2500 "$f"; done
    nvidia-smi --query-gpu=memory.used,utilization.gpu,power.draw --format=csv,noheader ;;
  collect)
    tar czf "$OUT/h200-runs.tgz" -C /tmp art --exclude='*.safetensors' --exclude='*.onnx' --exclude='*.onnx.data' \
      --exclude='*.bin' 2>/dev/null; tar czf "$OUT/h200-logs.tgz" -C "$K" logs; ls -la "$OUT" ;;
  wait) end=$((SECONDS + $2)); while [ $SECONDS -lt $end ] && [ -n "$(ls "$Q")" ]; do sleep 5; done
    bash "$0" collect >/dev/null; bash "$0" status | tail -c 2500 ;;
  *) echo "usage: device.sh recv|install|job|status|collect|wait" >&2; exit 2 ;;
esac
