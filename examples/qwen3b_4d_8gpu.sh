#!/usr/bin/env bash
# Qwen2.5-3B SFT, 4D: TP2 + sequence parallel x PP2 interleaved (VPP2: 9-layer chunks) x DP2 with the distributed
# optimizer, 8 GPUs per node; DP = NNODES x 2. Environment: examples/_launch.sh; memory: examples/README.md.
set -euo pipefail
: "${GPUS_PER_NODE:=8}"
source "$(dirname "$0")/_launch.sh"
launch --tensor-model-parallel-size 2 --sequence-parallel \
  --pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 9 \
  --use-distributed-optimizer --recompute-granularity selective "$@"
