"""The one interface between a run and what it trains for: ``training/run.py`` calls only this, never asks which.

``step_func(device, data_iterator, model) -> (output, loss_func)``: megatron-core's forward-step contract, run by every
engine; ``loss_func(output) -> (loss sum, count, {"loss_sum_and_tokens": [sum, count], metric sums})``.
``rows_per_sample``: sequences a sample puts in a micro-batch (a pair: 2; the pipeline buffers' shape, tokens counted).
``flops_scale``: model FLOPs per trained token over the family's (KTO's KL rows: 4/3). ``new_head``: parameters a
fine-tune starts at zero when the starting weights lack them. ``data(batches) -> (source, info with "vocab_size")``,
unless the entry script brings the family's own. ``before_training(engine, data, model_meta)``: what it computes from
the starting weights before a checkpoint is resumed (a reference); a line to print, or None. ``config``: its section.
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch
import torch.distributed as dist


def print_rank0(message: str) -> None:
    if dist.get_rank() == 0:
        print(message, flush=True)


def loss_sums(losses: torch.Tensor, metrics: dict, count: torch.Tensor, weight=1):
    """A loss function's (loss sum, count, sums) from per-sample losses and metrics, each x ``weight``."""
    loss_sum = (losses * weight).sum()
    sums = {"loss_sum_and_tokens": torch.stack([loss_sum.detach(), count])}
    sums.update({name: (value * weight).sum() for name, value in metrics.items()})
    return loss_sum, count.to(torch.int), sums


class Objective:
    rows_per_sample: int = 1
    flops_scale: float = 1.0
    new_head: Tuple[str, ...] = ()
    step_func: Callable

    def __init__(self, run):
        self.run, self.config, self.info = run, run.objective, {}

    def data(self, batches: dict):
        raise NotImplementedError(f"{type(self).__name__}: its entry script builds the data")

    def before_training(self, engine, data, model_meta: dict) -> Optional[str]:
        return None


class FamilyStep(Objective):
    """A family's own loss (GPT-2's next tokens, ViT's classes); the entry script builds the data."""

    def __init__(self, step_func: Callable, new_head: Tuple[str, ...] = ()):
        self.step_func, self.new_head, self.info = step_func, tuple(new_head), {}
