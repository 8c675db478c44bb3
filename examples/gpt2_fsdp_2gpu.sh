#!/usr/bin/env bash
# GPT-2 (124M) pretraining under torch FSDP2 (--engine fsdp): parameters, gradients and AdamW state sharded
# over the 2 GPUs of a node (fp32 master weights, bf16 compute; built on the meta device, each rank materialising only
# its shards). DP = NNODES x 2.
# Environment and pass-through flags: examples/_launch.sh.
set -euo pipefail
: "${GPUS_PER_NODE:=2}"
source "$(dirname "$0")/_launch.sh"
launch_gpt --engine fsdp "$@"
