#!/usr/bin/env bash
# Qwen2.5-3B SFT, 3D: TP2 x PP2 x DP2, 8 GPUs per node; DP = NNODES x 2.
# TP stays inside a node (NVLink); Qwen2.5-3B's 2 KV groups allow TP <= 2. Environment: examples/_launch.sh.
set -euo pipefail
: "${GPUS_PER_NODE:=8}"
source "$(dirname "$0")/_launch.sh"
launch --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --recompute-granularity selective "$@"
