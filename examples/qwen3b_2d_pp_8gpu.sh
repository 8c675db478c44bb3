#!/usr/bin/env bash
# Qwen2.5-3B SFT, 2D: PP2 (18 layers per stage, 1F1B) x DP4, 8 GPUs per node; DP = NNODES x 4.
# PP2 x DP4 rather than PP4 x DP2: a PP2 stage already fits, and the shallower pipeline has the smaller bubble
# (1/16 vs 3/32 of a step at global batch 64). Environment: examples/_launch.sh; memory: examples/README.md.
set -euo pipefail
: "${GPUS_PER_NODE:=8}"
source "$(dirname "$0")/_launch.sh"
launch --pipeline-model-parallel-size 2 --recompute-granularity selective "$@"
