#!/usr/bin/env bash
# Qwen2.5-3B reward model, 8 GPUs per node: a score head on Qwen/Qwen2.5-3B-Instruct (PRETRAINED: an SFT export works
# the same; the head starts at zero) trained with the Bradley-Terry loss of TRL's RewardTrainer on
# trl-lib/ultrafeedback_binarized (chosen/rejected conversations), DP = NNODES x 8 with the distributed optimizer.
# Each step: 64 pairs of 2 x 2048 tokens; no reference pass. Ends with $RUN_DIR/hf, a Qwen2ForSequenceClassification
# (AutoModelForSequenceClassification loads it; the reward of a conversation is its last token's score).
# Memory per GPU: 3.1 B parameters x (2 bf16 + 4 fp32 gradient + 12 / 8 Adam and master) = 23 GB before activations.
# Environment: examples/_launch.sh (CENTER_REWARDS_COEFFICIENT, e.g. 0.01: TRL's centring of the rewards).
set -euo pipefail
PUBLISHED=Qwen/Qwen2.5-3B-Instruct  # the default PRETRAINED and tokenizer
: "${GPUS_PER_NODE:=8}" "${DATA_PATH:=trl-lib/ultrafeedback_binarized}" "${SEQ_LENGTH:=2048}" "${PACK_SEQUENCES:=0}" "${CE_FUSION:=0}"
: "${LR:=1e-5}" "${MIN_LR:=0}" "${LR_WARMUP_ITERS:=10}" "${TRAIN_ITERS:=900}"  # ~one epoch of its 62k pairs
source "$(dirname "$0")/_launch.sh"
launch --objective reward ${CENTER_REWARDS_COEFFICIENT:+--center-rewards-coefficient "$CENTER_REWARDS_COEFFICIENT"} \
  --weight-decay 0.0 --use-distributed-optimizer --recompute-granularity selective "$@"
