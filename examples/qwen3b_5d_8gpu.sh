#!/usr/bin/env bash
# Qwen2.5-3B SFT, 5D, upcycled to Mixture-of-Experts (preset qwen2.5-3b-moe: 8 experts of half the dense FFN,
# top-2, a gated shared expert; 11.6B parameters, 4.3B active): DP2 x PP2 x TP2 + sequence parallel x EP2 on 8 GPUs
# per node, experts folded over DP x TP (expert TP 1, alltoall dispatcher), distributed optimizer, full recompute;
# DP = NNODES x 2. Starts from the dense Qwen/Qwen2.5-3B (PRETRAINED), upcycled while loading (the same function at
# step 0: examples/README.md, "Mixture of Experts"). Environment: examples/_launch.sh; memory: examples/README.md.
set -euo pipefail
: "${GPUS_PER_NODE:=8}"
source "$(dirname "$0")/_launch.sh"
launch --model qwen2.5-3b-moe --tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 2 \
  --expert-model-parallel-size 2 --expert-tensor-parallel-size 1 --moe-aux-loss-coeff 1e-2 --moe-z-loss-coeff 1e-3 \
  --use-distributed-optimizer --recompute-granularity full "$@"
