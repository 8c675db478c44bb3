# Shared by the examples/qwen3b_*.sh and vit_*gpu.sh launchers (sourced, never run): Qwen2.5-3B SFT on MetaMathQA
# or ViT image classification under torchrun (`launch`, `launch_vit`) or the deepspeed launcher (`launch_deepspeed`,
# `launch_vit_deepspeed`). A launcher sets its GPUS_PER_NODE default, sources this file and calls one of the four
# with its own flags and "$@".
#
# Environment (all optional; relative paths are relative to the repository root):
#   NNODES=1 NODE_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 GPUS_PER_NODE=<launcher's: 1, 2 or 8>
#     world = NNODES x GPUS_PER_NODE; the launcher fixes TP/PP, and DP is what the world leaves.
#     torchrun: run the launcher once on every node, each with its own NODE_RANK (0 .. NNODES-1).
#     deepspeed: run the launcher once, on one node; it starts the first NNODES hosts of HOSTFILE through pdsh over
#     ssh (pdsh must be installed on that node). NODE_RANK is not used (a node's rank is its line in HOSTFILE);
#     MASTER_ADDR defaults to the first host of HOSTFILE, and on one node the deepspeed launcher uses 127.0.0.1
#     whatever it is set to.
#   HOSTFILE (deepspeed launchers, required when NNODES > 1; examples/hostfile.example): one `host slots=<GPUs>`
#     line per node, the first being rank 0's; passwordless ssh to every host, and the repository and its .venv
#     at the same path on every node. With NNODES=1 no hostfile is passed (the job runs on this node). Checked
#     before anything starts (one line, status 2): `host slots=N` lines, no host twice, at least NNODES hosts,
#     each used one with GPUS_PER_NODE slots or more.
#   PRETRAINED: the weights a run starts from (--pretrained: a hub id, a Hugging Face directory or one of our
#     checkpoints); default: the published model the launcher is about (Qwen/Qwen2.5-3B, the 5D launcher upcycling
#     it to MoE while loading; Qwen/Qwen1.5-MoE-A2.7B; Qwen/Qwen3-8B; Qwen/Qwen3-30B-A3B, whose tokenizer (Qwen3's
#     chat template) a PRETRAINED=none run keeps; google/vit-huge-patch14-224-in21k;
#     google/vit-base-patch16-224-in21k); GPT-2 launchers pretrain from scratch unless PRETRAINED is set (e.g.
#     openai-community/gpt2). PRETRAINED=none: a random init of MODEL (the launcher's preset). Downloaded once per
#     node into the Hugging Face cache (HF_HOME, HF_HUB_OFFLINE=1 on nodes without a network). A rerun that finds a
#     checkpoint in CHECKPOINT_DIR resumes it instead. Every run ends by writing $RUN_DIR/hf, a Hugging Face model.
#   Qwen: DATA_PATH=meta-math/MetaMathQA  TOKENIZER=<the pretrained model's> (a hub id or a local dir)  SEQ_LENGTH=4096
#     MICRO_BATCH_SIZE=1  GLOBAL_BATCH_SIZE=64 (sequences per step, kept as set on any number of nodes:
#     it must be divisible by MICRO_BATCH_SIZE x DP, or finetune_qwen.py refuses to start)
#     TRAIN_ITERS=1000 LR=1e-5 MIN_LR=1e-6 LR_WARMUP_ITERS=30 EVAL_INTERVAL=100 PACK_SEQUENCES=1 (0: one example
#     per row, as DPO's pairs need) EVAL_GENERATE_SAMPLES=0 CE_FUSION=1 (--cross-entropy-loss-fusion; 0: the whole
#     logits, as --dpo-use-weighting needs)
#   ViT (defaults: ViT-H/14 in21k fine-tuned on Food-101; vit_base_lora_1gpu.sh sets its own): DATA_PATH=ethz/food101
#     NUM_CLASSES=101 NUM_WORKERS=6 (image-decoding processes per GPU) MICRO_BATCH_SIZE=64 GLOBAL_BATCH_SIZE=512
#     (images per step, divisible by MICRO_BATCH_SIZE x DP) TRAIN_ITERS=3000 LR=5e-4 MIN_LR=1e-5
#     LR_WARMUP_ITERS=300 WEIGHT_DECAY=0.05 EVAL_INTERVAL=300
#   GPT-2 (gpt2_*.sh): DATA_PATH=karpathy/tiny_shakespeare (or Skylion007/openwebtext, a .txt/.jsonl/.parquet, a
#     nanoGPT train.bin) TOKENIZER=openai-community/gpt2 (or the pretrained model's) SEQ_LENGTH=1024 MICRO_BATCH_SIZE=8 GLOBAL_BATCH_SIZE=64
#     TRAIN_ITERS=2000 LR=6e-4 MIN_LR=6e-5 LR_WARMUP_ITERS=100 EVAL_INTERVAL=200
#   SAVE_INTERVAL=200  RUN_DIR=runs/<launcher name> (logs/, tensorboard/ and the final hf/ go there)
#     CHECKPOINT_DIR=$RUN_DIR/checkpoints (--save and --load: a rerun resumes; on many nodes both must be on a
#     filesystem every node sees)
#   PROFILE=1: --profile (torch.profiler traces of steps 2-4, every rank, in $RUN_DIR/logs/traces, RUN_DIR's default
#     being runs/<launcher name>-profile; add
#     --profile-step-start/--profile-step-end/--profile-ranks as flags) -- then tools/analyze_traces.py on them.
#   DRY_RUN=1: print the torchrun/deepspeed command (one shell-quoted line) and exit 0 instead of running it.
# Extra flags given to a launcher are appended last, so they override: qwen3b_3d_8gpu.sh --train-iters 20

cd "$(dirname "${BASH_SOURCE[0]}")/.."  # the repo root, whatever the caller's cwd
# PROFILE=1: --profile, and the run's directory gets "-profile" (runs/<name>-profile): a profiled run, its steps
# slowed by the profiler, never replaces the plain run that it, or tools/compare_runs.py, would be compared with.
profile=() run_suffix=
if [ "${PROFILE:-0}" != 0 ]; then profile=(--profile) run_suffix=-profile; fi
# torchrun's own default for its ranks, which it announces in a banner when the variable is unset
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

# Each _*_job sets the array `job`: the entry point, the flags its family's launchers share, then the given ones
# (last wins).
_qwen_job() {
  : "${SHUTDOWN_TIMEOUT:=300}"  # a 3B checkpoint with its Adam state: ~43 GB from all ranks together
  job=(finetune_qwen.py)
  _model_flags "${PUBLISHED:-Qwen/Qwen2.5-3B}" qwen2.5-3b "${PUBLISHED:-Qwen/Qwen2.5-3B}"
  job+=(
    --bf16 --data-path "${DATA_PATH:-meta-math/MetaMathQA}"
    --seq-length "${SEQ_LENGTH:-4096}"
    --micro-batch-size "${MICRO_BATCH_SIZE:-1}" --global-batch-size "${GLOBAL_BATCH_SIZE:-64}"
    --train-iters "${TRAIN_ITERS:-1000}" --lr "${LR:-1e-5}" --min-lr "${MIN_LR:-1e-6}" --lr-decay-style cosine
    --lr-warmup-iters "${LR_WARMUP_ITERS:-30}" --weight-decay 0.1 --clip-grad 1.0
    --eval-interval "${EVAL_INTERVAL:-100}"
  )
  if [ "${PACK_SEQUENCES:-1}" = 1 ]; then job+=(--pack-sequences); fi  # (DPO: each pair its own two rows)
  # The output layer and loss in chunks: 1.17x transformers instead of 1.05x and 26 instead of 38 GiB on Qwen2.5-0.5B,
  # the same losses (one H200, bench/results/nvidia-h200_gpu_check.md). Reward models have no vocabulary output.
  if [ "${CE_FUSION:-1}" = 1 ]; then job+=(--cross-entropy-loss-fusion); fi
  if [ "${EVAL_GENERATE_SAMPLES:-0}" != 0 ]; then job+=(--eval-generate-samples "$EVAL_GENERATE_SAMPLES"); fi
  _run_dir_flags "$@"
}

# The defaults are the vit_huge_* launchers' (DeiT-style lr for batch 512).
_vit_job() {
  : "${SHUTDOWN_TIMEOUT:=180}"  # ViT-H/14 with its Adam state: ~9 GB
  job=(pretrain_vit.py)
  _model_flags google/vit-huge-patch14-224-in21k vit-huge-14
  job+=(
    --bf16
    --data-path "${DATA_PATH:-ethz/food101}" --num-classes "${NUM_CLASSES:-101}" --num-workers "${NUM_WORKERS:-6}"
    --micro-batch-size "${MICRO_BATCH_SIZE:-64}" --global-batch-size "${GLOBAL_BATCH_SIZE:-512}"
    --train-iters "${TRAIN_ITERS:-3000}" --lr "${LR:-5e-4}" --min-lr "${MIN_LR:-1e-5}" --lr-decay-style cosine
    --lr-warmup-iters "${LR_WARMUP_ITERS:-300}" --weight-decay "${WEIGHT_DECAY:-0.05}" --clip-grad 1.0
    --label-smoothing 0.1 --eval-interval "${EVAL_INTERVAL:-300}"
  )
  _run_dir_flags "$@"
}

# GPT-2 pretraining from scratch (nanoGPT's recipe: lr 6e-4 -> 6e-5 cosine, weight decay 0.1, 1024-token windows).
_gpt_job() {
  : "${SHUTDOWN_TIMEOUT:=120}"  # GPT-2 124M with its Adam state: ~2 GB
  local data_path  # DATA_PATH: text, a hub id, or Megatron prefixes with weights ("0.3 wiki_text_document 0.7 ...")
  read -r -a data_path <<< "${DATA_PATH:-karpathy/tiny_shakespeare}"
  job=(pretrain_gpt.py)
  _model_flags none gpt2 openai-community/gpt2
  job+=(
    --bf16 --data-path "${data_path[@]}"
    --seq-length "${SEQ_LENGTH:-1024}"
    --micro-batch-size "${MICRO_BATCH_SIZE:-8}" --global-batch-size "${GLOBAL_BATCH_SIZE:-64}"
    --train-iters "${TRAIN_ITERS:-2000}" --lr "${LR:-6e-4}" --min-lr "${MIN_LR:-6e-5}" --lr-decay-style cosine
    --lr-warmup-iters "${LR_WARMUP_ITERS:-100}" --weight-decay 0.1 --clip-grad 1.0
    --eval-interval "${EVAL_INTERVAL:-200}"
  )
  _run_dir_flags "$@"
}

# _model_flags <published model> <preset> [<tokenizer>]: --pretrained ${PRETRAINED:-published} (whose tokenizer
# the run then uses), or with PRETRAINED=none a random init of ${MODEL:-preset}; --tokenizer when TOKENIZER is set
# or nothing else gives one. A launcher sets PRETRAINED/MODEL defaults of its own before sourcing this file.
_model_flags() {
  local pretrained=${PRETRAINED:-$1}
  if [ "$pretrained" = none ]; then
    job+=(--model "${MODEL:-$2}")
  else
    job+=(--pretrained "$pretrained")
  fi
  if [ -n "${TOKENIZER:-}" ] || { [ "$pretrained" = none ] && [ -n "${3:-}" ]; }; then
    job+=(--tokenizer "${TOKENIZER:-$3}")
  fi
}

# Appends the checkpoint and log flags (everything under RUN_DIR by default), then the given flags.
_run_dir_flags() {
  local run_dir checkpoints
  run_dir=${RUN_DIR:-runs/$(basename "$0" .sh)$run_suffix}
  checkpoints=${CHECKPOINT_DIR:-$run_dir/checkpoints}
  job+=(
    --save "$checkpoints" --load "$checkpoints" --save-interval "${SAVE_INTERVAL:-200}"
    --log-dir "$run_dir/logs" --tensorboard-dir "$run_dir/tensorboard" --save-hf "$run_dir/hf" "${profile[@]}" "$@"
  )
}

# DRY_RUN=1: print the command as one shell-quoted line and exit 0; otherwise replace this shell with it.
_run() {
  if [ "${DRY_RUN:-0}" != 0 ]; then
    local line
    printf -v line '%q ' "$@"
    echo "${line% }"
    exit 0
  fi
  exec "$@"
}

_fail() {
  echo "$(basename "$0"): $*" >&2
  exit 2
}

# torchrun on this node (one call per node, each with its NODE_RANK): _torchrun <job function> <flags>. It runs as
# `python -m megatron_ext.launch` (torchrun's options, torchrun's agent): the flags are checked once before any rank
# starts, a failure is the first failing rank's one line (exit 2 for bad input, 1 otherwise) instead of torchrun's
# traceback, SIGTERM/SIGUSR1 reach every rank and it exits 0 when they all saved (megatron_ext/launch.py).
# SHUTDOWN_TIMEOUT: how long torchrun lets its ranks finish the step and save after a SIGTERM before it kills them
# (its own default is 30 s, too short for most checkpoints); each job sets a default sized for its model's save,
# and the ranks see it too (a start-up line warns when the last save took longer). Raise the scheduler's grace
# period with it (Kubernetes terminationGracePeriodSeconds; Slurm: sbatch --signal lead time).
_torchrun() {
  local job
  "$1" "${@:2}"
  export SHUTDOWN_TIMEOUT=${SHUTDOWN_TIMEOUT:-120}
  _run python -m megatron_ext.launch --nnodes "${NNODES:-1}" --node-rank "${NODE_RANK:-0}" --master-addr "${MASTER_ADDR:-127.0.0.1}" \
    --master-port "${MASTER_PORT:-29500}" --nproc-per-node "${GPUS_PER_NODE:?the launcher sets a default}" \
    --shutdown-timeout "$SHUTDOWN_TIMEOUT" "${job[@]}"
}

# _check_hostfile FILE NNODES GPUS_PER_NODE: the first host, or (status 1) what is wrong, read as DeepSpeed reads a
# hostfile (`host slots=N` lines; blank lines and # comments skipped): the first NNODES hosts are used, GPUS_PER_NODE
# GPUs of each.
_check_hostfile() {
  awk -v nnodes="$2" -v gpus="$3" '
    { sub(/^[ \t]+/, ""); sub(/[ \t\r]+$/, "") }
    /^#/ || $0 == "" || error { next }
    !/^[^ \t]+[ \t]+slots=[0-9]+/ { error = sprintf("line %d, \"%s\", is not \"<host> slots=<GPUs>\"", NR, $0); next }
    $1 in slots { error = sprintf("lists %s twice (line %d)", $1, NR); next }
    { slots[$1] = substr($2, 7) + 0; hosts[++count] = $1 }
    END {
      for (i = 1; i <= count && i <= nnodes && !error; i++)
        if (slots[hosts[i]] < gpus) error = sprintf("gives %s slots=%d, fewer than GPUS_PER_NODE=%d", hosts[i],
                                                    slots[hosts[i]], gpus)
      if (!error && count < nnodes) error = sprintf("lists %d host(s); NNODES=%d needs %d", count, nnodes, nnodes)
      if (error) { print error; exit 1 }
      print hosts[1]
    }' "$1"
}

# The deepspeed launcher: one call for all nodes; with NNODES > 1 it reaches the others through HOSTFILE over ssh.
_deepspeed() {
  local job nnodes=${NNODES:-1} master_addr=${MASTER_ADDR:-} hostfile=()
  : "${GPUS_PER_NODE:?the launcher sets a default}"
  if [ "$nnodes" != 1 ]; then
    [ -n "${HOSTFILE:-}" ] || _fail "NNODES=$nnodes needs HOSTFILE=<file with one 'host slots=GPUS' line per node>" \
      "(the deepspeed launcher starts every node from this one over ssh; see examples/hostfile.example)"
    [ -f "$HOSTFILE" ] && [ -r "$HOSTFILE" ] ||
      _fail "HOSTFILE=$HOSTFILE is not a readable file (relative paths are from the repo root)"
    local first  # rank 0 runs on the first host of the hostfile: the default MASTER_ADDR
    first=$(_check_hostfile "$HOSTFILE" "$nnodes" "$GPUS_PER_NODE") || _fail "HOSTFILE=$HOSTFILE $first"
    master_addr=${master_addr:-$first}
    hostfile=(--hostfile "$HOSTFILE")
  fi
  "$1" "${@:2}"
  _run deepspeed --num_nodes "$nnodes" --num_gpus "${GPUS_PER_NODE:?the launcher sets a default}" \
    --master_addr "${master_addr:-127.0.0.1}" --master_port "${MASTER_PORT:-29500}" ${hostfile[@]+"${hostfile[@]}"} \
    "${job[@]}"
}

# _step <output that marks it done> <command...>: one step of a recipe (math_recipe_cpu.sh, qwen_math_lora_1gpu.sh):
# run it, or print it under DRY_RUN=1, unless its output exists (a rerun goes on where it stopped)
_step() {
  local done=$1 line
  shift
  if [ "${DRY_RUN:-0}" != 0 ]; then
    printf -v line '%q ' "$@"
    echo "${line% }"
  elif [ -e "$done" ]; then
    echo "$(basename "$0"): $done exists, skipping: $*"
  else
    "$@"
  fi
}

launch() { _torchrun _qwen_job "$@"; }
launch_deepspeed() { _deepspeed _qwen_job "$@"; }
launch_vit() { _torchrun _vit_job "$@"; }
launch_vit_deepspeed() { _deepspeed _vit_job "$@"; }
launch_gpt() { _torchrun _gpt_job "$@"; }
