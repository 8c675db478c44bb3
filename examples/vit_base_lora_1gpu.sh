#!/usr/bin/env bash
# ViT-B/16 LoRA fine-tuning on CIFAR-100 (32 px images resized to 224), 1 GPU per node; DP = NNODES. Starts from
# google/vit-base-patch16-224-in21k (PRETRAINED; downloaded once into the Hugging Face cache). The 86M base stays
# frozen; rank-16 adapters on the fused QKV and a new 100-class head train. Full recompute keeps one layer input
# per image. Ends with $RUN_DIR/hf: the adapters merged, a ViTForImageClassification.
# Environment: examples/_launch.sh (its ViT defaults; this script's own below).
set -euo pipefail
: "${GPUS_PER_NODE:=1}" "${PRETRAINED:=google/vit-base-patch16-224-in21k}" "${MODEL:=vit-base-16}" \
  "${DATA_PATH:=uoft-cs/cifar100}" \
  "${NUM_CLASSES:=100}" "${MICRO_BATCH_SIZE:=128}" "${GLOBAL_BATCH_SIZE:=512}" "${TRAIN_ITERS:=1000}" \
  "${LR:=3e-3}" "${MIN_LR:=3e-5}" "${LR_WARMUP_ITERS:=50}" "${WEIGHT_DECAY:=0.01}" "${EVAL_INTERVAL:=100}"
source "$(dirname "$0")/_launch.sh"
launch_vit --lora-rank 16 --lora-alpha 16 --lora-targets qkv \
  --lora-dropout 0.1 --recompute-granularity full "$@"
