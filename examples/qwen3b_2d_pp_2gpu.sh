#!/usr/bin/env bash
# Qwen2.5-3B SFT, 2D: pipeline parallel PP2 (18 layers per stage, 1F1B) x DP, 2 GPUs per node; DP = NNODES.
# Environment and pass-through flags: examples/_launch.sh; memory: examples/README.md.
set -euo pipefail
: "${GPUS_PER_NODE:=2}"
source "$(dirname "$0")/_launch.sh"
launch --pipeline-model-parallel-size 2 --recompute-granularity selective "$@"
