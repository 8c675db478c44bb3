#!/usr/bin/env bash
# The README's main job: supervised fine-tuning of a tiny Qwen2-architecture model on the shipped MetaMathQA sample
# (examples/data, tokenized by the shipped tiny Qwen tokenizer with Qwen2.5's chat template), packed sequences,
# on a 4-rank CPU mesh (TP2 x PP2, gloo). Ends with a summary table and the path of a loss/throughput plot.
# Extra flags pass through and win: bash examples/cpu_quickstart.sh --train-iters 5
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh
profile=()  # PROFILE=1: torch.profiler traces of steps 2-4 in <log-dir>/traces
[ "${PROFILE:-0}" = 0 ] || profile=(--profile)
exec .venv/bin/torchrun --nproc-per-node 4 --master-port "${MASTER_PORT:-29531}" finetune_qwen.py \
  --model tiny --data-path examples/data/metamathqa_sample.jsonl --tokenizer examples/tokenizers/tiny-qwen \
  --pack-sequences --seq-length 256 --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 \
  --micro-batch-size 2 --global-batch-size 8 --train-iters 40 --lr 3e-3 --lr-warmup-iters 4 --clip-grad 1.0 \
  --eval-interval 10 --eval-iters 2 --log-dir runs/cpu_quickstart "${profile[@]}" "$@"
