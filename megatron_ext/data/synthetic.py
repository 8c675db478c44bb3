"""Synthetic token batches (until MetaMathQA SFT lands): learnable, deterministic, identical on every mesh.

Each sequence counts upward from a random start with a random stride (mod vocab), so a model can learn it and the
loss visibly falls within a few dozen steps.
"""

from __future__ import annotations

from typing import Dict, List

import torch


def global_batch(step: int, *, seed: int, global_batch_size: int, micro_batch_size: int, seq_length: int,
                 vocab_size: int) -> List[Dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    start = torch.randint(0, vocab_size, (global_batch_size, 1), generator=g)
    stride = torch.randint(1, 8, (global_batch_size, 1), generator=g)
    tokens = (start + stride * torch.arange(seq_length + 1)) % vocab_size
    positions = torch.arange(seq_length).expand(micro_batch_size, seq_length)
    return [dict(tokens=tokens[i:i + micro_batch_size, :-1], labels=tokens[i:i + micro_batch_size, 1:],
                 loss_mask=torch.ones(micro_batch_size, seq_length), position_ids=positions)
            for i in range(0, global_batch_size, micro_batch_size)]


def data_parallel_slice(microbatches: List, dp_rank: int, dp_size: int) -> List:
    """This DP rank's contiguous share of a global batch's micro-batches."""
    per_rank = len(microbatches) // dp_size
    return microbatches[dp_rank * per_rank:(dp_rank + 1) * per_rank]
