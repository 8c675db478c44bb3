#!/usr/bin/env bash
# GPT-2 quickstart: a tiny GPT-2 (4 layers, 64 wide) pretrains on the shipped Shakespeare sample
# (examples/data/tiny_shakespeare_sample.txt: a text file, tokenized once by the shipped tiny GPT-2 tokenizer into a
# cached .bin/.idx corpus that megatron-core's GPTDataset reads, as it reads any Megatron prefix) on 2 CPU ranks with
# tensor parallelism (TP2 + SP, gloo; the loss on vocabulary shards). Ends with a summary table and a plot in
# runs/gpt2_cpu_quickstart.
# Extra flags pass through and win: bash examples/gpt2_cpu_quickstart.sh --train-iters 20. DRY_RUN=1 prints the line.
set -euo pipefail
source "$(dirname "$0")/_launch.sh"  # the repo root as cwd, and _run
[ "${DRY_RUN:-0}" != 0 ] || bash scripts/setup_venv.sh
# PROFILE=1 (_launch.sh): torch.profiler traces of steps 2-4 in runs/gpt2_cpu_quickstart-profile/traces
# SHUTDOWN_TIMEOUT: torchrun's grace for the ranks' final save after a SIGTERM (its default: 30 s; _launch.sh)
export SHUTDOWN_TIMEOUT=${SHUTDOWN_TIMEOUT:-60}
_run .venv/bin/python -m megatron_ext.launch --nproc-per-node 2 --master-port "${MASTER_PORT:-29534}" \
  --shutdown-timeout "$SHUTDOWN_TIMEOUT" pretrain_gpt.py \
  --model tiny --data-path examples/data/tiny_shakespeare_sample.txt --tokenizer examples/tokenizers/tiny-gpt2 \
  --distributed-backend gloo --tensor-model-parallel-size 2 --sequence-parallel --seq-length 128 \
  --micro-batch-size 8 --global-batch-size 16 --train-iters 200 --lr 3e-3 --min-lr 3e-4 --lr-warmup-iters 20 \
  --weight-decay 0.1 --clip-grad 1.0 --eval-interval 50 --eval-iters 2 \
  --log-dir "runs/gpt2_cpu_quickstart$run_suffix" "${profile[@]}" "$@"
