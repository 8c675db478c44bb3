#!/usr/bin/env bash
# GPT-2 (124M) pretraining, tensor parallel over 2 GPUs with sequence parallelism; the cross entropy
# runs on the vocabulary shards (loss parallelism: the logits are never gathered). DP = NNODES.
# Environment and pass-through flags: examples/_launch.sh (DATA_PATH=Skylion007/openwebtext for OpenWebText).
set -euo pipefail
: "${GPUS_PER_NODE:=2}"
source "$(dirname "$0")/_launch.sh"
launch_gpt --tensor-model-parallel-size 2 --sequence-parallel "$@"
