#!/usr/bin/env bash
# Qwen2.5-3B SFT, 1D: data parallel only (megatron-core DDP), 2 GPUs per node; DP = NNODES x 2.
# Plain DDP keeps bf16 weights, fp32 grads and fp32 Adam state whole on every GPU (~52 GiB), so the layers are
# recomputed in full. Environment and pass-through flags: examples/_launch.sh; memory: examples/README.md.
set -euo pipefail
: "${GPUS_PER_NODE:=2}"
source "$(dirname "$0")/_launch.sh"
launch --recompute-granularity full "$@"
