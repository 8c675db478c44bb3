#!/usr/bin/env bash
# The math recipe on CPU in one command, under 2 minutes on 2 cores: evaluate a model, fine-tune it (LoRA r=16 on every
# linear; FULL=1: every weight), export, evaluate the export on the same problems, and report the difference:
# $RUN_DIR/report.json (before and after: accuracy and sample count; the 95% interval of the difference), report.md
# and report.png (accuracies, the loss curve, the problems that flipped).
# The problems are the GSM8K look-alike (tools/make_gsm8k_lookalike.py, seeded): 10 test problems, trained on as
# MetaMathQA rows. The model stands in for a published one: a tiny Qwen2-architecture model first trained (all
# weights) on 300 other look-alike problems, so it knows the format but none of the 10 answers (accuracy about 0).
# A tiny model memorises, it does not learn arithmetic: after the fine-tune it answers these 10 (at least 0.9), which
# checks the pipeline, not the method. Each step is skipped when its output exists (a rerun goes on where it
# stopped). Environment: RUN_DIR (runs/math_recipe_cpu), GPUS_PER_NODE (CPU ranks, 2), MASTER_PORT (29534),
# SHUTDOWN_TIMEOUT (60), TRAIN_ITERS (300; the stand-in's: BASE_ITERS, 300), FULL=1, DRY_RUN=1 (print each step's command). Extra flags go to the fine-tune.
set -euo pipefail
source "$(dirname "$0")/_launch.sh"  # the repo root as cwd, _step
[ "${DRY_RUN:-0}" != 0 ] || bash scripts/setup_venv.sh
export PATH="$PWD/.venv/bin:$PATH" OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
: "${RUN_DIR:=runs/math_recipe_cpu}" "${GPUS_PER_NODE:=2}" "${MASTER_PORT:=29534}" "${TRAIN_ITERS:=300}" "${BASE_ITERS:=300}"
data=$RUN_DIR/data
tokenizer=examples/tokenizers/tiny-qwen
# 160 tokens hold every look-alike row with its chat template (none truncated; 256 was 40% padding)
train=(--data-split 100,0 --seq-length 160 --micro-batch-size 5 --global-batch-size 10 --lr-warmup-iters 10
       --lr-decay-style cosine --eval-interval 0 --data-cache-dir "$data/cache")
lora=(--lora-rank 16 --lora-alpha 32 --lora-targets qkv,proj,fc1,fc2 --lr 1e-2)
[ "${FULL:-0}" = 0 ] || lora=(--lr 3e-3)

ranks=(python -m megatron_ext.launch --nproc-per-node "$GPUS_PER_NODE" --master-port "$MASTER_PORT" --shutdown-timeout "${SHUTDOWN_TIMEOUT:-60}")

_step "$data/base.jsonl" python tools/make_gsm8k_lookalike.py --num-records 300 --seed 2 \
  --out "$data/base_gsm8k.jsonl" --metamath-out "$data/base.jsonl"
_step "$data/train.jsonl" python tools/make_gsm8k_lookalike.py --num-records 10 --seed 1 \
  --out "$data/test.jsonl" --metamath-out "$data/train.jsonl"
_step "$RUN_DIR/base/config.json" "${ranks[@]}" finetune_qwen.py --model tiny --tokenizer "$tokenizer" \
  --data-path "$data/base.jsonl" "${train[@]}" --train-iters "$BASE_ITERS" --lr 3e-3 --log-dir "$RUN_DIR/base_logs" \
  --save-hf "$RUN_DIR/base"
_step "$RUN_DIR/eval_before/summary.json" python tools/eval_math.py --model "$RUN_DIR/base" --data "$data/test.jsonl" \
  --output "$RUN_DIR/eval_before" --max-new-tokens 160 --batch-size 10
_step "$RUN_DIR/hf/config.json" "${ranks[@]}" finetune_qwen.py --pretrained "$RUN_DIR/base" \
  --data-path "$data/train.jsonl" "${train[@]}" --train-iters "$TRAIN_ITERS" "${lora[@]}" \
  --log-dir "$RUN_DIR/logs" --save-hf "$RUN_DIR/hf" "$@"
_step "$RUN_DIR/eval_after/summary.json" python tools/eval_math.py --model "$RUN_DIR/hf" --data "$data/test.jsonl" \
  --output "$RUN_DIR/eval_after" --max-new-tokens 160 --batch-size 10
_step "" python tools/math_report.py --before "$RUN_DIR/eval_before" --after "$RUN_DIR/eval_after" \
  --metrics "$RUN_DIR/logs/metrics.jsonl" --out "$RUN_DIR"
