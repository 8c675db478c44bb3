#!/usr/bin/env bash
# Qwen2.5-3B SFT, 2D on DeepSpeed's pipeline engine: PP2 (18 layers per stage) x DP with ZeRO-1, 2 GPUs per node,
# started by the deepspeed launcher; DP = NNODES. Full recompute in groups of 2 layers (activation checkpoints).
# Multi-node: HOSTFILE (examples/hostfile.example). Environment: examples/_launch.sh; memory: examples/README.md.
set -euo pipefail
: "${GPUS_PER_NODE:=2}"
source "$(dirname "$0")/_launch.sh"
launch_deepspeed --engine deepspeed --zero-stage 1 --pipeline-model-parallel-size 2 \
  --recompute-granularity full --recompute-num-layers 2 "$@"
