#!/usr/bin/env bash
# The README's main job: a tiny Qwen-architecture model trained on a 4-rank CPU mesh (TP2 x PP2, gloo).
# Synthetic tokens until the MetaMathQA SFT data lands. Extra flags pass through: bash examples/cpu_quickstart.sh --train-iters 5
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh
exec .venv/bin/torchrun --nproc-per-node 4 --master-port "${MASTER_PORT:-29531}" finetune_qwen.py \
  --model tiny --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 \
  --micro-batch-size 2 --global-batch-size 8 --seq-length 64 \
  --train-iters 40 --lr 3e-3 --lr-warmup-iters 4 --clip-grad 1.0 \
  --log-dir runs/cpu_quickstart "$@"
