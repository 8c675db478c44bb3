#!/usr/bin/env bash
# The README's main job: supervised fine-tuning of a tiny Qwen2-architecture model on the shipped MetaMathQA sample
# (examples/data, tokenized by the shipped tiny Qwen tokenizer with Qwen2.5's chat template), packed sequences,
# on a 4-rank CPU mesh (TP2 x PP2, gloo). Ends with a summary table and the path of a loss/throughput plot.
# Extra flags pass through and win: bash examples/cpu_quickstart.sh --train-iters 5. DRY_RUN=1 prints the line.
# The torchrun line is the launchers' (examples/_launch.sh): NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT (29531)
# and GPUS_PER_NODE (here CPU ranks per node, 4) work as there; two "nodes" on one machine, each in its own shell:
#   NNODES=2 NODE_RANK=0 GPUS_PER_NODE=2 bash examples/cpu_quickstart.sh   # and NODE_RANK=1 in a second shell
set -euo pipefail
source "$(dirname "$0")/_launch.sh"  # the repo root as cwd, _run and _torchrun
[ "${DRY_RUN:-0}" != 0 ] || bash scripts/setup_venv.sh
export PATH="$PWD/.venv/bin:$PATH"  # .venv's torchrun
: "${GPUS_PER_NODE:=4}" "${MASTER_PORT:=29531}" "${SHUTDOWN_TIMEOUT:=60}"
# PROFILE=1 (_launch.sh): torch.profiler traces of steps 2-4 in runs/cpu_quickstart-profile/traces
_quickstart_job() {
  job=(
    finetune_qwen.py
    --model tiny --data-path examples/data/metamathqa_sample.jsonl --tokenizer examples/tokenizers/tiny-qwen
    --pack-sequences --seq-length 256 --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2
    --micro-batch-size 2 --global-batch-size 8 --train-iters 40 --lr 3e-3 --lr-warmup-iters 4 --clip-grad 1.0
    --eval-interval 10 --eval-iters 2 --log-dir "runs/cpu_quickstart$run_suffix" "${profile[@]}" "$@"
  )
}
_torchrun _quickstart_job "$@"
