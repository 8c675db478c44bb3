"""The one interface between a run and what it trains for: ``training/run.py`` calls only this, never asks which.

An objective has
  ``step_func(device, data_iterator, model) -> (output, loss_func)``: megatron-core's forward-step contract, which
      every engine runs; ``loss_func(output) -> (loss sum, count, {"loss_sum_and_tokens": [sum, count], metric sums})``
      (``engines/megatron.reduce_loss_and_metrics``: "max:"/"min:" keys are global extremes);
  ``rows_per_sample``: sequences one sample puts in a micro-batch (a preference pair: 2), which shapes the pipeline's
      buffers and the tokens a step counts;
  ``flops_scale``: model FLOPs per trained token relative to the family's forward and backward (KTO's KL rows: 4/3);
  ``new_head``: parameters a fine-tune starts at zero when the starting weights lack them (a reward model's score);
  ``data(batches) -> (data source, info)``: its data (``info["vocab_size"]``: the tokenizer's), where the entry
      script does not bring the family's own;
  ``before_training(engine, data, model_meta)``: what it computes from the starting weights, before a checkpoint is
      resumed (DPO's and KTO's reference log-probabilities); the line to print, or None.
Its options are its section (``objectives/config.py``), ``self.config``.
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch.distributed as dist


def print_rank0(message: str) -> None:
    if dist.get_rank() == 0:
        print(message, flush=True)


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
    """A model family's own loss (GPT-2's next tokens, ViT's classes): its step and new head; the entry script
    builds the data."""

    def __init__(self, step_func: Callable, new_head: Tuple[str, ...] = ()):
        self.step_func, self.new_head, self.info = step_func, tuple(new_head), {}
