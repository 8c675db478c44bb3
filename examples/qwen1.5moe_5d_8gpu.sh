#!/usr/bin/env bash
# Qwen1.5-MoE-A2.7B SFT, 5D (60 experts, top-4, gated shared expert; 14.3B parameters, 2.7B active): DP2 x PP2 x
# TP2 + sequence parallel x EP4 on 8 GPUs per node, experts folded over DP x TP (expert TP 1, alltoall dispatcher),
# distributed optimizer, full recompute; DP = NNODES x 2. Starts from Qwen/Qwen1.5-MoE-A2.7B (PRETRAINED), ends
# with $RUN_DIR/hf. Environment: examples/_launch.sh.
set -euo pipefail
: "${GPUS_PER_NODE:=8}" "${PRETRAINED:=Qwen/Qwen1.5-MoE-A2.7B}" "${MODEL:=qwen1.5-moe-a2.7b}"
: "${SHUTDOWN_TIMEOUT:=600}"  # 14.3B parameters with their Adam state: ~200 GB from all ranks together
source "$(dirname "$0")/_launch.sh"
launch --tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 2 \
  --expert-model-parallel-size 4 --expert-tensor-parallel-size 1 --moe-aux-loss-coeff 1e-3 \
  --use-distributed-optimizer --recompute-granularity full "$@"
