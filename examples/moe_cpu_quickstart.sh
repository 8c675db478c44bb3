#!/usr/bin/env bash
# Mixture-of-Experts on CPU: the tiny Qwen2-MoE (4 experts, top-2, gated shared expert) fine-tuned on the shipped
# MetaMathQA sample, 4 gloo ranks as TP2 + sequence parallel x EP2 (experts folded over TP, alltoall dispatcher),
# load-balancing and z-loss on. Logs router load (busiest expert, CV of tokens per expert) every step and plots it
# beside the loss (training.png), about a minute.
# Extra flags pass through and win: bash examples/moe_cpu_quickstart.sh --train-iters 5. DRY_RUN=1 prints the line.
set -euo pipefail
source "$(dirname "$0")/_launch.sh"  # the repo root as cwd, and _run
[ "${DRY_RUN:-0}" != 0 ] || bash scripts/setup_venv.sh
# PROFILE=1 (_launch.sh): torch.profiler traces of steps 2-4 in runs/moe_cpu_quickstart-profile/traces
# SHUTDOWN_TIMEOUT: torchrun's grace for the ranks' final save after a SIGTERM (its default: 30 s; _launch.sh)
export SHUTDOWN_TIMEOUT=${SHUTDOWN_TIMEOUT:-60}
_run .venv/bin/python -m megatron_ext.launch --nproc-per-node 4 --master-port "${MASTER_PORT:-29533}" \
  --shutdown-timeout "$SHUTDOWN_TIMEOUT" finetune_qwen.py \
  --model tiny-moe --data-path examples/data/metamathqa_sample.jsonl --tokenizer examples/tokenizers/tiny-qwen \
  --pack-sequences --seq-length 256 --tensor-model-parallel-size 2 --sequence-parallel \
  --expert-model-parallel-size 2 --expert-tensor-parallel-size 1 --moe-aux-loss-coeff 1e-2 --moe-z-loss-coeff 1e-3 \
  --micro-batch-size 2 --global-batch-size 8 --train-iters 40 --lr 3e-3 --lr-warmup-iters 4 --clip-grad 1.0 \
  --eval-interval 10 --eval-iters 2 --log-dir "runs/moe_cpu_quickstart$run_suffix" "${profile[@]}" "$@"
