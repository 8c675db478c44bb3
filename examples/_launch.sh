# Shared by the examples/qwen3b_*.sh launchers (sourced, never run): Qwen2.5-3B SFT on MetaMathQA under torchrun.
# A launcher sets its GPUS_PER_NODE default, sources this file and calls `launch <its mesh flags> "$@"`.
#
# Environment (all optional; relative paths are relative to the repository root):
#   NNODES=1 NODE_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 GPUS_PER_NODE=<launcher's: 2 or 8>
#     world = NNODES x GPUS_PER_NODE; the launcher fixes TP/PP, and DP is what the world leaves.
#   DATA_PATH=meta-math/MetaMathQA  TOKENIZER=Qwen/Qwen2.5-3B (a hub id or a local dir)  SEQ_LENGTH=4096
#   MICRO_BATCH_SIZE=1  GLOBAL_BATCH_SIZE=64 (sequences per step, kept as set on any number of nodes:
#     it must be divisible by MICRO_BATCH_SIZE x DP, or finetune_qwen.py refuses to start)
#   TRAIN_ITERS=1000 LR=1e-5 MIN_LR=1e-6 LR_WARMUP_ITERS=30 SAVE_INTERVAL=200 EVAL_INTERVAL=100
#   RUN_DIR=runs/<launcher name> (logs/ and tensorboard/ go there)  CHECKPOINT_DIR=$RUN_DIR/checkpoints
#     (--save and --load: a rerun resumes; on many nodes both must be on a filesystem every node sees)
#   DRY_RUN=1: print the torchrun command (one shell-quoted line) and exit 0 instead of running it.
# Extra flags given to a launcher are appended last, so they override: qwen3b_3d_8gpu.sh --train-iters 20

cd "$(dirname "${BASH_SOURCE[0]}")/.."  # the repo root, whatever the caller's cwd

launch() {
  local name run_dir
  name=$(basename "$0" .sh)
  run_dir=${RUN_DIR:-runs/$name}
  local cmd=(
    torchrun --nnodes "${NNODES:-1}" --node-rank "${NODE_RANK:-0}" --master-addr "${MASTER_ADDR:-127.0.0.1}"
    --master-port "${MASTER_PORT:-29500}" --nproc-per-node "${GPUS_PER_NODE:?the launcher sets a default}"
    finetune_qwen.py
    --model qwen2.5-3b --bf16
    --data-path "${DATA_PATH:-meta-math/MetaMathQA}" --tokenizer "${TOKENIZER:-Qwen/Qwen2.5-3B}"
    --seq-length "${SEQ_LENGTH:-4096}" --pack-sequences
    --micro-batch-size "${MICRO_BATCH_SIZE:-1}" --global-batch-size "${GLOBAL_BATCH_SIZE:-64}"
    --train-iters "${TRAIN_ITERS:-1000}" --lr "${LR:-1e-5}" --min-lr "${MIN_LR:-1e-6}" --lr-decay-style cosine
    --lr-warmup-iters "${LR_WARMUP_ITERS:-30}" --weight-decay 0.1 --clip-grad 1.0
    --eval-interval "${EVAL_INTERVAL:-100}"
    --save "${CHECKPOINT_DIR:-$run_dir/checkpoints}" --load "${CHECKPOINT_DIR:-$run_dir/checkpoints}"
    --save-interval "${SAVE_INTERVAL:-200}"
    --log-dir "$run_dir/logs" --tensorboard-dir "$run_dir/tensorboard"
    "$@"
  )
  if [ "${DRY_RUN:-0}" != 0 ]; then
    local line
    printf -v line '%q ' "${cmd[@]}"
    echo "${line% }"
    exit 0
  fi
  exec "${cmd[@]}"
}
