#!/usr/bin/env bash
# ViT quickstart: a tiny ViT (4 layers, 32 px images in 8 px patches) learns the shipped 5-class shapes sample
# (examples/data/shapes_sample.parquet, 300 images; tools/make_image_sample.py) on 2 CPU ranks (DP2, gloo) in about
# a minute. Ends with a summary table (loss, top-1) and a plot in runs/vit_cpu_quickstart.
# Extra flags pass through and win: bash examples/vit_cpu_quickstart.sh --train-iters 20. DRY_RUN=1 prints the line.
set -euo pipefail
source "$(dirname "$0")/_launch.sh"  # the repo root as cwd, and _run
[ "${DRY_RUN:-0}" != 0 ] || bash scripts/setup_venv.sh
# PROFILE=1 (_launch.sh): torch.profiler traces of steps 2-4 in runs/vit_cpu_quickstart-profile/traces
# SHUTDOWN_TIMEOUT: torchrun's grace for the ranks' final save after a SIGTERM (its default: 30 s; _launch.sh)
export SHUTDOWN_TIMEOUT=${SHUTDOWN_TIMEOUT:-60}
_run .venv/bin/python -m megatron_ext.launch --nproc-per-node 2 --master-port "${MASTER_PORT:-29532}" \
  --shutdown-timeout "$SHUTDOWN_TIMEOUT" pretrain_vit.py \
  --model tiny --data-path examples/data/shapes_sample.parquet --num-classes 5 --num-workers 1 \
  --distributed-backend gloo --micro-batch-size 16 --global-batch-size 32 --train-iters 600 --lr 5e-4 \
  --lr-warmup-iters 20 --weight-decay 0.05 --clip-grad 1.0 --eval-interval 100 --eval-iters 1 \
  --log-dir "runs/vit_cpu_quickstart$run_suffix" "${profile[@]}" "$@"
