#!/usr/bin/env bash
# Qwen3-30B-A3B SFT (128 experts, top-8, no shared expert; 30.5 B parameters, 3.3 B active): EP8 across the node's
# 8 GPUs, grouped-GEMM experts (torch._grouped_mm, the default where it runs), alltoall dispatcher, distributed
# optimizer, full recompute, Qwen3-MoE's own load-balancing loss (router_aux_loss_coef 0.001 over every layer's
# routing: --moe-aux-loss-scope model); DP = NNODES x 8. Starts from Qwen/Qwen3-30B-A3B (PRETRAINED), ends with
# $RUN_DIR/hf. Environment: examples/_launch.sh.
# Memory per GPU: the experts are 29.0 B parameters, 16 of 128 per rank = 3.63 B x (2 bf16 + 4 fp32 grad + 12 /
# expert-DP Adam and master); the dense part (attention, embeddings, routers) is 1.5 B x (2 + 4 + 12 / DP).
# One node (expert-DP 1): 65 + 11 = 76 GB before activations, so it needs 141 GB GPUs (H200); on 80 GB GPUs run it
# on two nodes (NNODES=2: expert-DP 2 halves the experts' optimizer state, 44 + 10 = 54 GB, ~8 GB of activations).
set -euo pipefail
PUBLISHED=Qwen/Qwen3-30B-A3B  # the default PRETRAINED, and the tokenizer of a PRETRAINED=none run
: "${GPUS_PER_NODE:=8}" "${MODEL:=qwen3-30b-a3b}"
: "${SHUTDOWN_TIMEOUT:=900}"  # 30.5B parameters with their Adam state: ~430 GB from all ranks together
source "$(dirname "$0")/_launch.sh"
launch --expert-model-parallel-size 8 --moe-token-dispatcher-type alltoall \
  --moe-aux-loss-coeff 1e-3 --moe-aux-loss-scope model --use-distributed-optimizer --recompute-granularity full "$@"
