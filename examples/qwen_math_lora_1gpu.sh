#!/usr/bin/env bash
# The math recipe on one GPU in one command: evaluate the published Qwen/Qwen2.5-1.5B (PRETRAINED) on GSM8K's test
# set (openai/gsm8k, 1,319 problems, greedy, the chat prompt training uses), fine-tune it on MetaMathQA with
# examples/qwen3b_lora_1gpu.sh (LoRA r=16 on every attention and MLP linear, lr 2e-4, 64 packed sequences of 4096
# tokens a step; FULL=1: every weight, examples/qwen3b_1d_ddp_2gpu.sh on this GPU, lr 1e-5), evaluate the merged
# export on the same problems, and write $RUN_DIR/report.json (before and after: accuracy and sample count; the 95%
# interval of the difference), report.md and report.png (accuracies, the loss curve, the problems that flipped).
# Each step is skipped when its output exists, and the fine-tune resumes from its checkpoints: a rerun goes on where
# it stopped. Not yet run on a GPU (examples/math_recipe_cpu.sh is the same steps on CPU, tested as written).
# Environment: PRETRAINED, RUN_DIR (runs/qwen_math_lora_1gpu), TRAIN_ITERS (1000), EVAL_DATA (openai/gsm8k, or a
# .jsonl with question/answer), EVAL_SAMPLES (the first N problems; default all), EVAL_BATCH_SIZE (64), FULL=1,
# DRY_RUN=1 (print each step's command), and the fine-tune launcher's (examples/_launch.sh). Extra flags go to the
# fine-tune.
set -euo pipefail
source "$(dirname "$0")/_launch.sh"  # the repo root as cwd, _step
[ "${DRY_RUN:-0}" != 0 ] || bash scripts/setup_venv.sh
export PATH="$PWD/.venv/bin:$PATH"
export PRETRAINED=${PRETRAINED:-Qwen/Qwen2.5-1.5B} RUN_DIR=${RUN_DIR:-runs/qwen_math_lora_1gpu}
eval_data=(--data "${EVAL_DATA:-openai/gsm8k}")
[ -n "${EVAL_DATA:-}" ] || eval_data+=(--data-config main --split test)
[ -z "${EVAL_SAMPLES:-}" ] || eval_data+=(--max-samples "$EVAL_SAMPLES")
evaluate=(python tools/eval_math.py "${eval_data[@]}" --batch-size "${EVAL_BATCH_SIZE:-64}" --max-new-tokens 512)
finetune=(bash examples/qwen3b_lora_1gpu.sh)
[ "${FULL:-0}" = 0 ] || finetune=(env GPUS_PER_NODE="${GPUS_PER_NODE:-1}" bash examples/qwen3b_1d_ddp_2gpu.sh)

_step "$RUN_DIR/eval_before/summary.json" "${evaluate[@]}" --model "$PRETRAINED" --output "$RUN_DIR/eval_before"
if [ "${DRY_RUN:-0}" != 0 ]; then
  "${finetune[@]}" "$@"  # the launcher prints its own torchrun line
else
  _step "$RUN_DIR/hf/config.json" "${finetune[@]}" "$@"
fi
_step "$RUN_DIR/eval_after/summary.json" "${evaluate[@]}" --model "$RUN_DIR/hf" --output "$RUN_DIR/eval_after"
_step "" python tools/math_report.py --before "$RUN_DIR/eval_before" --after "$RUN_DIR/eval_after" \
  --metrics "$RUN_DIR/logs/metrics.jsonl" --out "$RUN_DIR"
