#!/usr/bin/env bash
# ViT-H/14 (631M parameters) fine-tuned from its in21k weights on Food-101, 1D: megatron-core DDP, 2 GPUs per node; DP =
# NNODES x 2. Every GPU holds the whole model and its fp32 optimizer state (18 B/param, 11 GiB) plus ~23 GiB of
# activations for 64 images, so nothing is recomputed. Environment and pass-through flags: examples/_launch.sh; memory:
# examples/README.md.
set -euo pipefail
: "${GPUS_PER_NODE:=2}"
source "$(dirname "$0")/_launch.sh"
launch_vit "$@"
