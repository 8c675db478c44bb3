#!/usr/bin/env bash
# GPT-2 (124M), 2D: FSDP2 over DP x megatron-core tensor parallelism (TP2 inside each pair of GPUs,
# vocab-parallel loss), 4 GPUs per node: FSDP2 x TP2 on one node.
# Environment and pass-through flags: examples/_launch.sh.
set -euo pipefail
: "${GPUS_PER_NODE:=4}"
source "$(dirname "$0")/_launch.sh"
launch_gpt --engine fsdp --tensor-model-parallel-size 2 "$@"
