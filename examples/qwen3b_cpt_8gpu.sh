#!/usr/bin/env bash
# Qwen2.5-3B continued pretraining on math web text (OpenWebMath), before SFT: pretrain_gpt.py from the published
# weights, TP2 + SP x DP4 with the distributed optimizer, 8 GPUs per node (DP = NNODES x 4). 64 x 4096 tokens per
# step under Megatron-LM's WSD schedule: warm-up, 3e-5 held, the last 200 steps annealed to 3e-6. The corpus goes
# into the cache at the first run; for the whole of it, preprocess once with every core instead:
#   python tools/preprocess_data.py --input open-web-math/open-web-math --output-prefix data/owm --json-keys text \
#       --tokenizer-model Qwen/Qwen2.5-3B --append-eod --workers 32
#   DATA_PATH=data/owm_text_document bash examples/qwen3b_cpt_8gpu.sh
# Then SFT from the export: PRETRAINED=runs/qwen3b_cpt_8gpu/hf bash examples/qwen3b_4d_8gpu.sh.
# Environment and pass-through flags: examples/_launch.sh.
set -euo pipefail
: "${GPUS_PER_NODE:=8}" "${PRETRAINED:=Qwen/Qwen2.5-3B}" "${SHUTDOWN_TIMEOUT:=300}"
: "${DATA_PATH:=open-web-math/open-web-math}" "${SEQ_LENGTH:=4096}" "${GLOBAL_BATCH_SIZE:=64}" "${MICRO_BATCH_SIZE:=2}"
: "${TRAIN_ITERS:=2000}" "${LR:=3e-5}" "${MIN_LR:=3e-6}" "${LR_WARMUP_ITERS:=50}" "${EVAL_INTERVAL:=100}"
export PRETRAINED SHUTDOWN_TIMEOUT DATA_PATH SEQ_LENGTH GLOBAL_BATCH_SIZE MICRO_BATCH_SIZE TRAIN_ITERS LR MIN_LR \
  LR_WARMUP_ITERS EVAL_INTERVAL
source "$(dirname "$0")/_launch.sh"
launch_gpt --tensor-model-parallel-size 2 --sequence-parallel --use-distributed-optimizer \
  --lr-decay-style WSD --lr-wsd-decay-iters 200 --lr-wsd-decay-style linear "$@"
