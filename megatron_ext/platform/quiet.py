"""Known, harmless library noise, filtered in one place as megatron_ext is imported (before megatron-core and
DeepSpeed are): what is left on screen is ours, or a warning nobody here has seen yet. Where the filtered message
matters to a user, the run says it in one line of its own (``training/run.py``: the TE/apex fallbacks on a GPU)."""

from __future__ import annotations

import logging
import os
import warnings

# (category, message regex): megatron-core's import-time notices that optional TE/apex kernels are absent (torch
# stand-ins run instead: platform/kernels.py), and its deprecation of the cuda_graph_scope default it sets itself.
WARNINGS = (
    (UserWarning, r".*(Transformer Engine|Apex|apex).*(not installed|Falling back).*"),
    (UserWarning, r"full scope is deprecated"),
    # torch 2.13 renamed the collectives megatron-core's MoE dispatcher and DDP call (each call warned, mid-run)
    (FutureWarning, r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated"),
    # ... and deprecated the torch.distributed.checkpoint calls megatron-core's loader makes (every resume warned)
    (FutureWarning, r"`load_state_dict` is deprecated and will be removed"),
    (FutureWarning, r"Please use DTensor instead and we are deprecating ShardedTensor"),
)
# DeepSpeed's logger, when it picks the CPU accelerator because no GPU is there (the expected case on CPU ranks).
DEEPSPEED_LINES = ("Setting accelerator to CPU",)


class _DropKnown(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not any(line in record.getMessage() for line in DEEPSPEED_LINES)


# Kineto (torch.profiler) prints "USDT: ... profiler_start/stop" on every rank at each --profile window: its USDT
# level sits above ERROR, so only the level past all of them hides it (its own errors too); a user's setting wins.
KINETO_LOG_LEVEL = "6"


def install() -> None:
    os.environ.setdefault("KINETO_LOG_LEVEL", KINETO_LOG_LEVEL)
    for category, message in WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
    logger = logging.getLogger("DeepSpeed")
    if not any(isinstance(f, _DropKnown) for f in logger.filters):
        logger.addFilter(_DropKnown())


def transformers_loading() -> None:
    """transformers' weight-loading progress bar and its report of the tensors a model leaves out (a backbone's
    pooler under ViTModel(add_pooling_layer=False)): for a tool whose own output says what was loaded."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
