#!/usr/bin/env bash
# ViT-H/14 fine-tuned from its in21k weights on Food-101, 1D: DeepSpeed ZeRO-3 (the bf16 weights sharded too, gathered
# layer by layer in forward and backward), 2 GPUs per node, started by the deepspeed launcher; DP = NNODES x 2. Multi-
# node: HOSTFILE (examples/hostfile.example). Environment: examples/_launch.sh; memory: examples/README.md.
set -euo pipefail
: "${GPUS_PER_NODE:=2}"
source "$(dirname "$0")/_launch.sh"
launch_vit_deepspeed --engine deepspeed --zero-stage 3 "$@"
