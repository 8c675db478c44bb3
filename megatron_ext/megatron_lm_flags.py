"""Megatron-LM flags that megatron_ext does not take, and what a script ported from Megatron-LM should do instead:
an unknown flag is answered in one line with the reason and the fix (or the nearest flag of ours, for a typo),
not argparse's bare "unrecognized arguments". Torch-free."""

from __future__ import annotations

import difflib
from typing import Iterable, Optional

_SHAPE = "the model's shape comes from --model (a preset), --hf-config or --pretrained; drop it"
_KERNELS = "megatron_ext picks its kernels (docs/performance.md); drop it"
_INSTEAD = [
    (("--overlap-grad-reduce",), "the megatron engine always overlaps the gradient reduction; drop it"),
    (("--overlap-param-gather",),
     "the parameter all-gather overlaps the forward whenever --use-distributed-optimizer is on; drop it"),
    (("--use-mcore-models", "--use-legacy-models"), "megatron-core models are the only kind; drop it"),
    (("--use-flash-attn",), "attention is torch SDPA, which picks the flash and cuDNN kernels itself; drop it"),
    (("--attention-softmax-in-fp32", "--accumulate-allreduce-grads-in-fp32"),
     "that is always so (fp32 softmax in SDPA, fp32 gradient buffers); drop it"),
    (("--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-swiglu-fusion", "--no-bias-dropout-fusion",
      "--no-rope-fusion", "--no-persist-layer-norm"), _KERNELS),
    (("--hidden-size", "--num-attention-heads", "--ffn-hidden-size", "--num-query-groups", "--group-query-attention",
      "--max-position-embeddings", "--swiglu", "--normalization", "--norm-epsilon", "--disable-bias-linear",
      "--add-qkv-bias", "--untie-embeddings-and-output-weights", "--position-embedding-type", "--rotary-base",
      "--vocab-size", "--kv-channels", "--qk-layernorm"), _SHAPE),
    (("--tokenizer-type", "--tokenizer-model", "--vocab-file", "--merge-file"),
     "the tokenizer comes from --pretrained or --tokenizer (a Hugging Face id or directory)"),
    (("--ckpt-format", "--use-dist-ckpt"), "checkpoints are always megatron-core's distributed format; drop it"),
    (("--use-torch-fsdp2",), "use --engine fsdp"),
    (("--deepspeed",), "use --engine deepspeed (--zero-stage, --deepspeed-config)"),
    (("--recompute-activations",), "use --recompute-granularity selective"),
    (("--rampup-batch-size",), "batch-size ramp-up is pretrain_gpt.py's (pretraining); fine-tuning keeps "
                               "--global-batch-size fixed"),
    (("--no-load-optim", "--no-load-rng"), "use --finetune to take the weights alone"),
    (("--pretrained-checkpoint",), "use --pretrained (a Hugging Face id or directory, or one of our checkpoints)"),
    (("--dataloader-type",), "a deterministic global-batch sampler draws the samples; drop it"),
    (("--use-cpu-initialization", "--init-method-std"),
     "random weights are drawn with megatron-core's std (0.02) from --seed and each parameter's global name, the "
     "same on any mesh (or come from --pretrained); drop it"),
    (("--use-checkpoint-opt_param-scheduler",), "a resumed run continues the checkpoint's schedule when its flags "
     "agree, and says which differ when not; drop it"),
    (("--optimizer",), "every engine runs AdamW (--adam-beta1, --adam-beta2, --adam-eps); drop it"),
    (("--log-interval", "--log-throughput", "--log-timers-to-tensorboard", "--tensorboard-log-interval"),
     "every step's loss, throughput, MFU, memory and time split are logged; drop it"),
]
INSTEAD = {flag: why for flags, why in _INSTEAD for flag in flags}


def explain_unknown(message: str, known: Iterable[str]) -> Optional[str]:
    """argparse's "unrecognized arguments: ..." as one line about its first flag, or None (nothing to add)."""
    prefix = "unrecognized arguments: "
    if not message.startswith(prefix):
        return None
    flags = [t.split("=", 1)[0] for t in message[len(prefix):].split() if t.startswith("--")]
    if not flags:
        return None
    flag, more = flags[0], f" (and {len(flags) - 1} more unknown flags)" if len(flags) > 1 else ""
    if flag in INSTEAD:
        return f"{flag} is a Megatron-LM flag megatron_ext does not take: {INSTEAD[flag]}{more}"
    near = difflib.get_close_matches(flag, [k for k in known if k.startswith("--")], n=1, cutoff=0.8)
    if near:
        return f"unrecognized flag {flag}; did you mean {near[0]}?{more}"
    return None
