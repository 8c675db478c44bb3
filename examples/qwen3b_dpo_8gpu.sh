#!/usr/bin/env bash
# Qwen2.5-3B DPO after SFT, 8 GPUs per node: TRL's sigmoid loss (beta 0.1) on trl-lib/ultrafeedback_binarized
# (chosen/rejected conversations sharing their prompt), from Qwen/Qwen2.5-3B-Instruct (PRETRAINED: an SFT export such
# as runs/qwen3b_4d_8gpu/hf works the same), DP = NNODES x 8 with the distributed optimizer. Before step 1 one
# forward-only pass scores every pair under the starting weights (the reference; cached beside the data cache, so a
# resumed run reads it back). Each step: 64 pairs of 2 x 2048 tokens. Ends with $RUN_DIR/hf.
# Memory per GPU: 3.1 B parameters x (2 bf16 + 4 fp32 gradient + 12 / 8 Adam and master) = 23 GB before activations.
# Environment: examples/_launch.sh (DPO_BETA=0.1, DPO_LOSS=sigmoid or any of TRL's, e.g. ipo, robust, or
# sigmoid,bco_pair,sft with DPO_LOSS_WEIGHTS=0.8,0.2,1 for MPO).
set -euo pipefail
PUBLISHED=Qwen/Qwen2.5-3B-Instruct  # the default PRETRAINED and tokenizer
: "${GPUS_PER_NODE:=8}" "${DATA_PATH:=trl-lib/ultrafeedback_binarized}" "${SEQ_LENGTH:=2048}" "${PACK_SEQUENCES:=0}"
: "${LR:=5e-7}" "${MIN_LR:=0}" "${LR_WARMUP_ITERS:=10}" "${TRAIN_ITERS:=900}"  # ~one epoch of its 62k pairs
source "$(dirname "$0")/_launch.sh"
launch --objective dpo --dpo-beta "${DPO_BETA:-0.1}" --dpo-loss "${DPO_LOSS:-sigmoid}" \
  ${DPO_LOSS_WEIGHTS:+--dpo-loss-weights "$DPO_LOSS_WEIGHTS"} --weight-decay 0.0 \
  --use-distributed-optimizer --recompute-granularity selective "$@"
