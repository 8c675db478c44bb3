#!/usr/bin/env bash
# ViT-H/14 fine-tuned from its in21k weights on Food-101, 1D: DeepSpeed ZeRO-3 + ZeRO++ (int8 weight all-gathers, int4
# gradient reduce-scatters, a secondary weight shard per node: hpZ), 2 GPUs per node, started by the deepspeed launcher;
# DP = NNODES x 2. hpZ and the int4 gradients only happen across nodes (multi-node: HOSTFILE,
# examples/hostfile.example): on one node DeepSpeed reduces gradients unquantized, and the run says so in one line.
# Environment: examples/_launch.sh; memory: examples/README.md.
set -euo pipefail
: "${GPUS_PER_NODE:=2}"
source "$(dirname "$0")/_launch.sh"
launch_vit_deepspeed --engine deepspeed --zero-stage 3 --zeropp "$@"
