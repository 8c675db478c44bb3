#!/usr/bin/env bash
# Qwen2.5-3B SFT, 1D: DeepSpeed ZeRO-3 with parameters and optimizer offloaded to CPU memory, 1 GPU per node,
# started by the deepspeed launcher; DP = NNODES. Needs 50-60 GB of host RAM at DP1 (estimate; examples/README.md).
# Multi-node: HOSTFILE (examples/hostfile.example). Environment: examples/_launch.sh.
set -euo pipefail
: "${GPUS_PER_NODE:=1}"
source "$(dirname "$0")/_launch.sh"
launch_deepspeed --engine deepspeed --zero-stage 3 --offload-optimizer cpu --offload-param cpu \
  --recompute-granularity full "$@"
