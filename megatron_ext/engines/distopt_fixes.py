"""megatron-core 0.16.1's distributed optimizer without apex/TE, made to save and load its checkpoints right.

Without apex/TE it runs torch's AdamW, whose per-parameter ``step`` megatron-core's checkpoint code does not expect
(loading fails, or every parameter shares one counter), and its 'fully_reshardable' save slices the state of every
parameter past a gradient buffer's first bucket from the wrong place. Each fix is proven by an exact resume in
``tests/training/test_finetune_e2e.py`` that fails without it.
"""

from __future__ import annotations

import torch

# On load it sets the inner state's ``step`` from the checkpoint's param groups, then copies every inner-state key
# from the loaded tensors, which hold no ``step``: KeyError. Copy what the checkpoint holds.
_LOAD_FIX = ("for key in dst_tensors:", "for key in [k for k in dst_tensors if k in tensors]:")
# The gathered state has each bucket's end padding stripped, the parameter offsets keep it (Megatron-LM #5077, fixed
# upstream 2026-05-31). A real model has dozens of buckets (40M elements each): a resumed run silently started from
# shifted Adam moments and weights (tiny Qwen with 4,096-element buckets: step 4's loss 6.888 instead of 6.429).
# The offsets, less the padding of the buckets before the parameter's:
_SAVE_FIX = (
    "state_ten = world_tensors[state_key][param_world_start:param_world_end]",
    "bucket = buffer.param_to_bucket[model_param]; shift = bucket.offset - sum("
    "b.numel_unpadded for b in buffer.buckets[:bucket.bucket_id]); "
    "state_ten = world_tensors[state_key][param_world_start - shift:param_world_end - shift]")
_installed = False


def install() -> None:
    """Patch megatron-core's DistributedOptimizer (once per process)."""
    global _installed
    if not _installed:
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

        from megatron_ext.platform.patching import replace_in_source

        replace_in_source(DistributedOptimizer, "_set_main_param_and_optimizer_states", [_LOAD_FIX])
        replace_in_source(DistributedOptimizer, "sharded_param_state_fully_reshardable", [_SAVE_FIX])
        _installed = True


def materialize_optimizer_state(optimizer) -> None:
    """Zero Adam state, as torch's AdamW would create it at its first step, for the distributed optimizer to load
    into: megatron-core reads every parameter's ``step`` while building the template, which a fresh optimizer does
    not have yet."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        if not isinstance(part, DistributedOptimizer):
            continue
        inner = part.optimizer
        for group in inner.param_groups:
            on_device = group.get("fused") or group.get("capturable")
            for param in group["params"]:
                if not inner.state[param]:
                    step = torch.zeros((), dtype=torch.float32, device=param.device if on_device else "cpu")
                    inner.state[param] = dict(step=step, exp_avg=torch.zeros_like(param),
                                              exp_avg_sq=torch.zeros_like(param))


def own_step_counters(optimizer) -> None:
    """After a load megatron-core gives every parameter the *same* ``step`` tensor, which torch's foreach/fused
    AdamW then increments once per parameter: one each."""
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        for param_state in part.optimizer.state.values():
            if "step" in param_state:
                param_state["step"] = param_state["step"].clone()
