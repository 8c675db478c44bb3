#!/usr/bin/env bash
# qwen3b_lora_1gpu.sh on 8 GPUs per node: the same Qwen2.5-3B LoRA SFT (rank-16 adapters on every attention and MLP
# linear, frozen bf16 base) data-parallel over DP = NNODES x 8, with the distributed optimizer sharding the adapters'
# Adam state. Ends with $RUN_DIR/hf (merged) and $RUN_DIR/adapter (PEFT). Environment: examples/_launch.sh.
set -euo pipefail
: "${GPUS_PER_NODE:=8}" "${LR:=2e-4}" "${MIN_LR:=2e-5}"
source "$(dirname "$0")/_launch.sh"
launch --use-distributed-optimizer --recompute-granularity selective --lora-rank 16 --lora-alpha 32 --lora-targets qkv,proj,fc1,fc2 \
  --lora-dropout 0.05 --save-peft "${RUN_DIR:-runs/$(basename "$0" .sh)}/adapter" "$@"
