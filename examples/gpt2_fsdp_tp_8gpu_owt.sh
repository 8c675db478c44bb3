#!/usr/bin/env bash
# GPT-2 medium (355M) on OpenWebText, 2D FSDP4 x TP2 on 8 GPUs per node (nanoGPT's OpenWebText recipe:
# ~0.5M tokens per step as 480 x 1024-token sequences). Preprocess once into a Megatron corpus, then train on it:
#   python tools/preprocess_data.py --input Skylion007/openwebtext --output-prefix data/owt --json-keys text \
#       --tokenizer-model openai-community/gpt2 --append-eod --workers 16
#   DATA_PATH=data/owt_text_document bash examples/gpt2_fsdp_tp_8gpu_owt.sh
# (DATA_PATH may also be the hub id, preprocessed into the cache at the first run, or weighted prefixes.)
# Environment and pass-through flags: examples/_launch.sh.
set -euo pipefail
: "${GPUS_PER_NODE:=8}" "${MODEL:=gpt2-medium}"
: "${DATA_PATH:=Skylion007/openwebtext}" "${GLOBAL_BATCH_SIZE:=480}" "${MICRO_BATCH_SIZE:=12}"
: "${TRAIN_ITERS:=600000}" "${LR_WARMUP_ITERS:=2000}"
export DATA_PATH GLOBAL_BATCH_SIZE MICRO_BATCH_SIZE TRAIN_ITERS LR_WARMUP_ITERS
source "$(dirname "$0")/_launch.sh"
launch_gpt --engine fsdp --tensor-model-parallel-size 2 "$@"
