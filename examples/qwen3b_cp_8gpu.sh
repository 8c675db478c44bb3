#!/usr/bin/env bash
# Qwen2.5-3B SFT, long context: 32768-token packed sequences under context parallelism, TP2 + sequence parallel x
# CP4 (each rank holds 2 of the 8 chunks of every document; K/V all-gathered over CP), full recompute, distributed
# optimizer (sharded over DP x CP), 8 GPUs per node; DP = NNODES. Global batch 8 sequences: the same 262k tokens per
# step as the 4096-token launchers. Environment: examples/_launch.sh; memory: examples/README.md.
set -euo pipefail
: "${GPUS_PER_NODE:=8}"
: "${SEQ_LENGTH:=32768}"
: "${GLOBAL_BATCH_SIZE:=8}"
source "$(dirname "$0")/_launch.sh"
launch --tensor-model-parallel-size 2 --sequence-parallel --context-parallel-size 4 \
  --use-distributed-optimizer --recompute-granularity full "$@"
