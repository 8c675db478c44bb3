#!/usr/bin/env bash
# DPO on CPU: a tiny Qwen2-architecture model on the shipped preference sample (examples/data/preference_sample.jsonl:
# conversations: arithmetic questions, the worked answer chosen, a brush-off rejected), TP2 x DP2 on 4 CPU ranks. One pass
# scores every pair under the starting weights (the reference), then 30 steps of TRL's sigmoid loss: rewards/margins
# and rewards/accuracies climb from 0. Ends with the summary and a plot. Extra flags pass through and win
# (--dpo-loss ipo); DRY_RUN=1 prints the line. The torchrun line is the launchers' (examples/_launch.sh).
set -euo pipefail
source "$(dirname "$0")/_launch.sh"
[ "${DRY_RUN:-0}" != 0 ] || bash scripts/setup_venv.sh
export PATH="$PWD/.venv/bin:$PATH"  # .venv's torchrun
: "${GPUS_PER_NODE:=4}" "${MASTER_PORT:=29533}" "${SHUTDOWN_TIMEOUT:=60}"
_dpo_quickstart_job() {
  job=(
    finetune_qwen.py --objective dpo
    --model tiny --data-path examples/data/preference_sample.jsonl --tokenizer examples/tokenizers/tiny-qwen
    --seq-length 64 --tensor-model-parallel-size 2 --micro-batch-size 2 --global-batch-size 8 --train-iters 30
    --lr 2e-3 --lr-warmup-iters 3 --clip-grad 1.0 --eval-interval 10 --eval-iters 1 --log-dir runs/dpo_cpu_quickstart
    "$@"
  )
}
_torchrun _dpo_quickstart_job "$@"
