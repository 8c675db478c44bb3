#!/usr/bin/env bash
# ViT-B/16 LoRA fine-tuning on CIFAR-100 (32 px images resized to 224), 1 GPU per node; DP = NNODES. Starts from
# google/vit-base-patch16-224-in21k, converted once into CKPT (weights only; default below):
#   hf download google/vit-base-patch16-224-in21k --local-dir hf/vit-base-patch16-224-in21k
#   python tools/convert_hf_to_mcore.py --hf-path hf/vit-base-patch16-224-in21k --save ckpt/vit-base-16-in21k-mcore
# The 86M base stays frozen; rank-16 adapters on the fused QKV and a new 100-class head train. Full recompute keeps
# one layer input per image. A rerun starts again from CKPT (--finetune loads weights only).
# Environment: examples/_launch.sh (its ViT defaults; this script's own below).
set -euo pipefail
: "${GPUS_PER_NODE:=1}" "${CKPT:=ckpt/vit-base-16-in21k-mcore}" "${DATA_PATH:=uoft-cs/cifar100}" \
  "${NUM_CLASSES:=100}" "${MICRO_BATCH_SIZE:=128}" "${GLOBAL_BATCH_SIZE:=512}" "${TRAIN_ITERS:=1000}" \
  "${LR:=3e-3}" "${MIN_LR:=3e-5}" "${LR_WARMUP_ITERS:=50}" "${WEIGHT_DECAY:=0.01}" "${EVAL_INTERVAL:=100}"
source "$(dirname "$0")/_launch.sh"
launch_vit --model vit-base-16 --load "$CKPT" --finetune --lora-rank 16 --lora-alpha 16 --lora-targets qkv \
  --lora-dropout 0.1 --recompute-granularity full "$@"
