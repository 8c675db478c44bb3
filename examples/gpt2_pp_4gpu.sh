#!/usr/bin/env bash
# GPT-2 (124M) pretraining, pipeline parallel: 12 layers in 4 stages of 3, 1F1B over 8 micro-batches
# per step (bubble (p-1)/(m+p-1) = 3/11). DP = NNODES.
# Environment and pass-through flags: examples/_launch.sh (DATA_PATH=Skylion007/openwebtext for OpenWebText).
set -euo pipefail
: "${GPUS_PER_NODE:=4}"
source "$(dirname "$0")/_launch.sh"
launch_gpt --pipeline-model-parallel-size 4 "$@"
