#!/usr/bin/env bash
# Qwen2.5-3B KTO after SFT, 8 GPUs per node: TRL's KTOTrainer loss (beta 0.1) on trl-lib/kto-mix-14k (prompt,
# completion and a desirable/undesirable label; paired data such as trl-lib/ultrafeedback_binarized is unpaired as TRL
# does), from Qwen/Qwen2.5-3B-Instruct (PRETRAINED: an SFT export such as runs/qwen3b_4d_8gpu/hf works the same),
# DP = NNODES x 8 with the distributed optimizer. Before step 1 one forward-only pass scores every example and its KL
# row (the prompt with another example's completion) under the starting weights (the reference; cached beside the
# data cache); each step starts with a forward-only pass over its KL rows (the KL estimate). Each step: 64 examples
# of 2048 tokens. Ends with $RUN_DIR/hf.
# Memory per GPU: 3.1 B parameters x (2 bf16 + 4 fp32 gradient + 12 / 8 Adam and master) = 23 GB before activations.
# Environment: examples/_launch.sh (KTO_BETA=0.1, KTO_LOSS=kto or apo_zero_unpaired, KTO_DESIRABLE_WEIGHT=1 and
# KTO_UNDESIRABLE_WEIGHT=1: the run prints the KTO paper's advice when the labels are unbalanced).
set -euo pipefail
PUBLISHED=Qwen/Qwen2.5-3B-Instruct  # the default PRETRAINED and tokenizer
: "${GPUS_PER_NODE:=8}" "${DATA_PATH:=trl-lib/kto-mix-14k}" "${SEQ_LENGTH:=2048}" "${PACK_SEQUENCES:=0}"
: "${MICRO_BATCH_SIZE:=4}"  # each micro-batch is a KL chunk (TRL's per_device_train_batch_size), so at least 2
: "${LR:=1e-6}" "${MIN_LR:=0}" "${LR_WARMUP_ITERS:=10}" "${TRAIN_ITERS:=210}"  # ~one epoch of its 13.5k examples
source "$(dirname "$0")/_launch.sh"
launch --objective kto --dpo-beta "${KTO_BETA:-0.1}" --kto-loss "${KTO_LOSS:-kto}" \
  --kto-desirable-weight "${KTO_DESIRABLE_WEIGHT:-1}" --kto-undesirable-weight "${KTO_UNDESIRABLE_WEIGHT:-1}" \
  --weight-decay 0.0 --use-distributed-optimizer --recompute-granularity selective "$@"
