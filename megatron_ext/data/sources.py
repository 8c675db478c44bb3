"""Data sources for the loop: each step's micro-batches for this data-parallel rank, validation batches, and a
position that checkpoints carry. ``SFTData`` serves tokenized MetaMathQA; ``MockData`` synthetic tokens;
``MockImages`` synthetic labelled images."""

from __future__ import annotations

from typing import Dict, Iterator, List

import torch

from megatron_ext.data import sft, synthetic
from megatron_ext.data.sampler import GlobalBatchSampler, rank_microbatches

Batch = Dict[str, torch.Tensor]


class SFTData:
    def __init__(self, train, valid, *, global_batch_size: int, micro_batch_size: int, dp_rank: int, dp_size: int,
                 seed: int):
        self.train, self.valid = train, valid
        self.global_batch_size, self.micro_batch_size = global_batch_size, micro_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.sampler = GlobalBatchSampler(len(train), global_batch_size, seed)

    def _microbatches(self, dataset, indices) -> List[Batch]:
        return [sft.collate([dataset[i] for i in micro])
                for micro in rank_microbatches(indices, self.dp_rank, self.dp_size, self.micro_batch_size)]

    def train_microbatches(self) -> List[Batch]:
        return self._microbatches(self.train, self.sampler.next_global_batch())

    def valid_microbatches(self, iters: int) -> Iterator[List[Batch]]:
        """The same first ``iters`` global batches of the validation split every time (wrapping if it is small)."""
        for k in range(iters if len(self.valid) else 0):
            indices = [(k * self.global_batch_size + j) % len(self.valid) for j in range(self.global_batch_size)]
            yield self._microbatches(self.valid, indices)

    def state_dict(self) -> dict:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state)


class MockData:
    """Synthetic learnable sequences (--mock-data): benchmarks and smoke runs without a dataset."""

    def __init__(self, *, vocab_size: int, seq_length: int, global_batch_size: int, micro_batch_size: int,
                 dp_rank: int, dp_size: int, seed: int):
        self.kwargs = dict(seed=seed, global_batch_size=global_batch_size, micro_batch_size=micro_batch_size,
                           seq_length=seq_length, vocab_size=vocab_size)
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.step = 0

    def train_microbatches(self) -> List[Batch]:
        self.step += 1
        return synthetic.data_parallel_slice(synthetic.global_batch(self.step, **self.kwargs), self.dp_rank,
                                             self.dp_size)

    def valid_microbatches(self, iters: int) -> Iterator[List[Batch]]:
        for k in range(iters):
            yield synthetic.data_parallel_slice(synthetic.global_batch(-1 - k, **self.kwargs), self.dp_rank,
                                                self.dp_size)

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]


class MockImages(MockData):
    """Synthetic learnable images (``pretrain_vit.py --mock-data``): each class is a fixed random pattern, each image
    its class's pattern plus noise; deterministic per step, identical on every mesh."""

    def __init__(self, *, image_size: int, num_classes: int, channels: int = 3, global_batch_size: int,
                 micro_batch_size: int, dp_rank: int, dp_size: int, seed: int):
        self.seed, self.global_batch_size, self.micro_batch_size = seed, global_batch_size, micro_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.prototypes = torch.randn(num_classes, channels, image_size, image_size,
                                      generator=torch.Generator().manual_seed(seed))
        self.step = 0

    def _global_batch(self, step: int) -> List[Batch]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        labels = torch.randint(0, self.prototypes.shape[0], (self.global_batch_size,), generator=g)
        pixels = self.prototypes[labels] + torch.randn(self.global_batch_size, *self.prototypes.shape[1:],
                                                       generator=g)
        micro = self.micro_batch_size
        batches = [dict(pixels=pixels[i:i + micro], labels=labels[i:i + micro], loss_mask=torch.ones(micro))
                   for i in range(0, self.global_batch_size, micro)]
        mine = synthetic.data_parallel_slice(batches, self.dp_rank, self.dp_size)
        if torch.cuda.is_available():  # as the image loader's batches: asynchronous copies to the GPU
            mine = [{k: v.pin_memory() for k, v in batch.items()} for batch in mine]
        return mine

    def train_microbatches(self) -> List[Batch]:
        self.step += 1
        return self._global_batch(self.step)

    def valid_microbatches(self, iters: int) -> Iterator[List[Batch]]:
        for k in range(iters):
            yield self._global_batch(-1 - k)
