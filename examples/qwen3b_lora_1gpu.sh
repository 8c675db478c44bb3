#!/usr/bin/env bash
# Qwen2.5-3B LoRA SFT on MetaMathQA, 1 GPU per node; DP = NNODES. Starts from Qwen/Qwen2.5-3B (PRETRAINED); the
# 3.1B base stays frozen (bf16, no gradient, no optimizer state) while rank-16 adapters on every attention and MLP
# linear (26M parameters) train at lr 2e-4. Ends with $RUN_DIR/hf (the adapters merged: a Qwen2ForCausalLM) and
# $RUN_DIR/adapter (a PEFT LoRA adapter: peft.PeftModel.from_pretrained(<Qwen/Qwen2.5-3B>, "$RUN_DIR/adapter")).
# Memory (80 GB): 6.2 GB of bf16 weights + the adapters with their gradients and Adam state (~0.5 GB) + seq 4096's
# activations. Environment: examples/_launch.sh.
set -euo pipefail
: "${GPUS_PER_NODE:=1}" "${LR:=2e-4}" "${MIN_LR:=2e-5}"
source "$(dirname "$0")/_launch.sh"
launch --lora-rank 16 --lora-alpha 32 --lora-targets qkv,proj,fc1,fc2 --lora-dropout 0.05 \
  --recompute-granularity selective \
  --save-peft "${RUN_DIR:-runs/$(basename "$0" .sh)}/adapter" "$@"
