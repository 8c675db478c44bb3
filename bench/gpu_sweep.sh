#!/usr/bin/env bash
# The single-GPU speed sweep of issue 9 (bench/README.md): each lever one at a time against the default, the
# DeepSpeed engine beside the megatron engine, transformers as the peer, Qwen2.5 0.5B / 1.5B / 3B, bf16, seq 4096,
# global batch 16; Qwen1.5-MoE-A2.7B (4 layers) beside transformers' Qwen2-MoE; then ViT-H/14 and ViT-B/16
# (bench_vit.py, bf16, 224 px, 1000 classes) beside transformers; then GPT-2 124M (bench_gpt.py, bf16, seq 1024,
# global batch 32 at micro-batch 16 and 8) beside transformers' GPT2LMHeadModel.
# One process per run (a clean allocator and peak); JSON per run in OUT, then one table of the Qwen and GPT-2 runs.
#   OUT=bench/results/h100 bash bench/gpu_sweep.sh            # everything (about 20 minutes on one H100)
#   MODELS="qwen2.5-1.5b" ONLY="default wgrad_off" bash bench/gpu_sweep.sh
#   MODELS="vit-huge-14 vit-base-16" bash bench/gpu_sweep.sh  # the ViT runs only (a few minutes)
#   MODELS=gpt2 bash bench/gpu_sweep.sh                        # the GPT-2 runs only (a minute or two)
# DRY_RUN=1 prints the commands.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/gpu}
MODELS=${MODELS:-"qwen2.5-0.5b qwen2.5-1.5b qwen2.5-3b qwen1.5-moe-a2.7b vit-huge-14 vit-base-16 gpt2"}
PY=${PYTHON:-python}
STEPS=${STEPS:-12}
mkdir -p "$OUT"

# Micro-batch and recompute per model: the largest that fitted 80 GB in the first H100 runs (gpu-facts.md). 3B needs
# recompute; transformers' only kind is full (gradient checkpointing), so the side-by-side row uses full and
# megatron-core's selective recompute gets its own row. ViT: the batches of gpu-facts.md's transformers anchors.
declare -A MBS=([qwen2.5-0.5b]=4 [qwen2.5-1.5b]=2 [qwen2.5-3b]=1 [qwen1.5-moe-a2.7b]=1 [vit-huge-14]=64
                [vit-base-16]=128)
declare -A RECOMPUTE=([qwen2.5-0.5b]="" [qwen2.5-1.5b]="" [qwen2.5-3b]="--recompute-granularity full")

_go() {  # name, model, command...: echo it and run it unless ONLY leaves the name out or DRY_RUN is set
  local name=$1 model=$2; shift 2
  if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then return; fi
  echo "+ $*"
  [ -n "${DRY_RUN:-}" ] || "$@" || echo "FAILED: $name $model (exit $?)"
}

run() {  # name, model, flags...
  _go "$1" "$2" "$PY" bench/bench_qwen.py --model "$2" --bf16 --seq-length 4096 --global-batch-size 16 \
    --bench-steps "$STEPS" --warmup-steps 3 --bench-out "$OUT/${2}_${1}.json" "${@:3}"
}

run_vit() {  # name, model, flags...: bench_vit.py beside transformers
  _go "$1" "$2" "$PY" bench/bench_vit.py --model "$2" --bf16 --num-classes 1000 --bench-steps "$STEPS" \
    --warmup-steps 3 --bench-out "$OUT/${2}_${1}.json" "${@:3}"
}

run_gpt() {  # name, model, flags...: bench_gpt.py beside transformers' GPT2LMHeadModel (32 x 1024 tokens a step)
  _go "$1" "$2" "$PY" bench/bench_gpt.py --model "$2" --bf16 --seq-length 1024 --global-batch-size 32 \
    --bench-steps "$STEPS" --warmup-steps 3 --bench-out "$OUT/${2}_${1}.json" "${@:3}"
}

for model in $MODELS; do
  if [[ $model == gpt2* ]]; then  # micro-batch 16 (2 micro-batches a step) and 8 (4), both beside transformers
    run_gpt default "$model" --micro-batch-size 16
    run_gpt mbs8 "$model" --micro-batch-size 8
    continue
  fi
  mbs=${MBS[$model]}
  if [[ $model == vit-* ]]; then
    run_vit default "$model" --micro-batch-size "$mbs"
    run_vit recompute "$model" --micro-batch-size "$mbs" --recompute-granularity full  # both sides checkpoint
    for stage in 2 3; do  # per-rank memory of ZeRO on one GPU (2 GPUs: bench/README.md)
      run_vit "zero$stage" "$model" --micro-batch-size "$mbs" --engine deepspeed --zero-stage "$stage" \
        --baseline none
    done
    continue
  fi
  if [[ $model == *-moe-* ]]; then  # 4 of its 24 layers fit one GPU with Adam; beside Qwen2MoeForCausalLM
    moe=(--num-layers 4 --micro-batch-size "$mbs" --recompute-granularity full --moe-aux-loss-coeff 1e-3)
    run default "$model" "${moe[@]}" --baseline hf
    run sequential "$model" "${moe[@]}" --no-moe-grouped-gemm  # megatron-core's expert loop, for the ratio
    run packed "$model" "${moe[@]}" --pack-sequences --data-path examples/data/metamathqa_sample.jsonl \
      --tokenizer examples/tokenizers/tiny-qwen
    continue
  fi
  # shellcheck disable=SC2206
  rc=(${RECOMPUTE[$model]})
  run default "$model" --micro-batch-size "$mbs" "${rc[@]}" --baseline hf
  [ "$mbs" = 1 ] || run mbs1 "$model" --micro-batch-size 1 "${rc[@]}" --baseline hf
  [ -z "${rc[*]}" ] || run selective "$model" --micro-batch-size "$mbs" --recompute-granularity selective
  run wgrad_off "$model" --micro-batch-size "$mbs" "${rc[@]}" --no-gradient-accumulation-fusion
  run ce_fusion "$model" --micro-batch-size "$mbs" "${rc[@]}" --cross-entropy-loss-fusion
  # Real SFT shape: packed MetaMathQA rows (documents of ~150 tokens), per-document attention and RoPE.
  run packed "$model" --micro-batch-size "$mbs" "${rc[@]}" --pack-sequences \
    --data-path examples/data/metamathqa_sample.jsonl --tokenizer examples/tokenizers/tiny-qwen
  for stage in 1 2 3; do
    run "zero$stage" "$model" --micro-batch-size "$mbs" "${rc[@]}" --engine deepspeed --zero-stage "$stage"
  done
done
if [ -z "${DRY_RUN:-}" ] && { compgen -G "$OUT/qwen*.json" || compgen -G "$OUT/gpt2*.json"; } > /dev/null; then
  "$PY" bench/table.py "$OUT" --out "$OUT/table.md"
fi
