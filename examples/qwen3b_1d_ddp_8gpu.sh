#!/usr/bin/env bash
# Qwen2.5-3B SFT, 1D: data parallel only (megatron-core DDP) with the distributed optimizer (Adam state and fp32
# master weights sharded over DP), 8 GPUs per node; DP = NNODES x 8. Environment: examples/_launch.sh.
set -euo pipefail
: "${GPUS_PER_NODE:=8}"
source "$(dirname "$0")/_launch.sh"
launch --use-distributed-optimizer --recompute-granularity selective "$@"
