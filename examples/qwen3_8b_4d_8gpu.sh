#!/usr/bin/env bash
# Qwen3-8B SFT, 4D: TP2 + sequence parallel x PP2 interleaved (VPP2: 9-layer chunks) x DP2 with the distributed
# optimizer, 8 GPUs per node; DP = NNODES x 2. Starts from Qwen/Qwen3-8B (PRETRAINED; its own chat template, with
# <think> blocks), ends with $RUN_DIR/hf. Environment: examples/_launch.sh.
# Memory per GPU (80 GB): 8.2 B parameters (untied embeddings) / (TP2 x PP2) = 2.05 B x (2 bf16 + 4 fp32 grad +
# 12 / DP2 Adam and master) = 24.6 GB; SP and selective recompute keep seq 4096's activations of the ~5 chunks the
# interleaved warm-up holds near 16 GB: ~41 GB, room for a longer SEQ_LENGTH.
set -euo pipefail
PUBLISHED=Qwen/Qwen3-8B  # the default PRETRAINED, and the tokenizer of a PRETRAINED=none run
: "${GPUS_PER_NODE:=8}" "${MODEL:=qwen3-8b}"
: "${SHUTDOWN_TIMEOUT:=600}"  # 8.2B parameters with their Adam state: ~115 GB from all ranks together
source "$(dirname "$0")/_launch.sh"
launch --tensor-model-parallel-size 2 --sequence-parallel \
  --pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 9 \
  --use-distributed-optimizer --recompute-granularity selective "$@"
