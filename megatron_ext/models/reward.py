"""A reward model's head on megatron-core's ``GPTModel``: one scalar per token from the final hidden state, as
transformers' ``*ForSequenceClassification`` with one label (``score``, no bias), read at each sequence's last token
by the loss (``objectives/reward.py``). It takes the output layer's place, so the model returns [b, s, 1].

The weight is whole on every TP rank: each computes the same scores from the whole sequence (sequence parallelism
gathers it first, and in backward each rank keeps its own part of the identical gradients, not their sum)."""

from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

SCORE = "output_layer.weight"  # its name in checkpoints (Hugging Face: ``score.weight``)


class ScoreHead(torch.nn.Module):
    trains_whole = True  # under LoRA too (PEFT's modules_to_save=["score"], TRL's reward-model recipe)

    def __init__(self, config):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(1, config.hidden_size, dtype=config.params_dtype))
        self.sequence_parallel = config.sequence_parallel

    def forward(self, hidden: torch.Tensor, weight=None, runtime_gather_output=None):
        """GPTModel's call of its output layer: [s, b, h] (this rank's part under SP) -> ([s, b, 1], None)."""
        if self.sequence_parallel:
            hidden = gather_from_sequence_parallel_region(
                hidden, tensor_parallel_output_grad=False, group=parallel_state.get_tensor_model_parallel_group())
        return hidden @ self.weight.t().to(hidden.dtype), None


def attach(model) -> None:
    """Put a score head in a post-processing chunk's output layer's place."""
    if getattr(model, "post_process", False):
        model.output_layer = ScoreHead(model.config)
