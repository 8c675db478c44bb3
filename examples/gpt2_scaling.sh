#!/usr/bin/env bash
# GPT-2 (124M) data-parallel scaling on one node: the same job (same global batch, so the same tokens per step) on
# 1, 2 and 4 GPUs (SCALING_GPUS="1 2 4"), then tools/compare_runs.py: throughput, speedup and scaling efficiency
# against GPUs, time per step and its split, peak memory, MFU and the loss curves, in $RUN_DIR/report/index.html.
# Environment and pass-through flags (given to every run): examples/_launch.sh; TRAIN_ITERS defaults to 200 here.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${RUN_DIR:-runs/gpt2_scaling}
runs=()
for gpus in ${SCALING_GPUS:-1 2 4}; do
  GPUS_PER_NODE=$gpus RUN_DIR=$out/dp$gpus TRAIN_ITERS=${TRAIN_ITERS:-200} bash examples/gpt2_ddp_2gpu.sh "$@"
  runs+=("$out/dp$gpus/logs:${gpus}gpu")
done
report=(python tools/compare_runs.py "${runs[@]}" -o "$out/report")
if [ "${DRY_RUN:-0}" != 0 ]; then
  printf -v line '%q ' "${report[@]}"
  echo "${line% }"
else
  "${report[@]}"
fi
