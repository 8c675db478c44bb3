#!/usr/bin/env bash
# GPT-2 (124M) pretraining, data parallel (megatron-core DDP): 2 GPUs per node, DP = NNODES x 2.
# Environment and pass-through flags: examples/_launch.sh (DATA_PATH=Skylion007/openwebtext for OpenWebText).
set -euo pipefail
: "${GPUS_PER_NODE:=2}"
source "$(dirname "$0")/_launch.sh"
launch_gpt "$@"
