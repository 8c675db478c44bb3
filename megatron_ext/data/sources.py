"""Data sources for the loop: each step's micro-batches for this data-parallel rank, validation batches, and a
position that checkpoints carry. ``SFTData`` serves tokenized MetaMathQA; ``MockData`` synthetic tokens;
``MockImages`` synthetic labelled images; ``TensorParallelBroadcast`` reads once per TP group and
``PipelinePlaceholder`` not at all on middle pipeline stages."""

from __future__ import annotations

from typing import Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron_ext.data import sft, synthetic
from megatron_ext.data.sampler import GlobalBatchSampler, rank_microbatches

Batch = Dict[str, torch.Tensor]


class SFTData:
    shuffle = True  # each epoch in a fresh order (KTO's: the data's order)

    def __init__(self, train, valid, *, global_batch_size: int, micro_batch_size: int, dp_rank: int, dp_size: int,
                 seed: int):
        self.train, self.valid = train, valid
        self.global_batch_size, self.micro_batch_size = global_batch_size, micro_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.sampler = GlobalBatchSampler(len(train), global_batch_size, seed, shuffle=self.shuffle)

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


class PreferenceData(SFTData):
    """DPO pairs (``data/preference.py``): each micro-batch's rows are its pairs' chosen then rejected sequences,
    with the reference log-probabilities the datasets carry once the reference pass set them (and LD-DPO's token
    weights with ``ld_alpha``)."""

    ld_alpha: Optional[float] = None

    def _collate(self, dataset, indices):
        """The collate of this global batch's micro-batches (what it needs of the whole batch, bound)."""
        from megatron_ext.data import preference

        scale = len(indices) / max(int(dataset.chosen_tokens[list(indices)].sum()), 1)  # of the global batch
        return lambda samples: preference.collate(samples, dataset.reference, scale, self.ld_alpha)

    def _microbatches(self, dataset, indices) -> List[Batch]:
        collate = self._collate(dataset, indices)
        return [collate([dataset[i] for i in micro])
                for micro in rank_microbatches(indices, self.dp_rank, self.dp_size, self.micro_batch_size)]

    def every_pair(self, dataset) -> Iterator[List[Batch]]:
        """Every pair of ``dataset`` once (the last global batch filled up from the first pairs), a global batch at
        a time: this rank's micro-batches, for the reference pass."""
        for begin in range(0, len(dataset), self.global_batch_size):
            yield self._microbatches(dataset, [(begin + j) % len(dataset) for j in range(self.global_batch_size)])


class UnpairedData(PreferenceData):
    """KTO's examples (``data/unpaired.py``) in the data's order, as TRL's sequential sampling reads them: each
    micro-batch is a chunk of consecutive examples and carries their rows and KL rows. Once ``kl_pass`` is set
    (``objectives/kto.py``), each global batch's KL estimate is computed from the KL rows (a forward-only pass)
    before the batch is served, and travels in it."""

    kl_pass = None
    shuffle = False

    def _collate(self, dataset, indices):
        from megatron_ext.data import unpaired

        n = len(indices)
        good = int(dataset.desirable[list(indices)].sum())
        scales = (n / good if good else 0.0, n / (n - good) if n > good else 0.0)  # of the global batch
        return lambda samples: unpaired.collate(samples, dataset.reference, *scales)

    def _microbatches(self, dataset, indices) -> List[Batch]:
        batches = super()._microbatches(dataset, indices)
        if self.kl_pass is not None:
            kl = self.kl_pass(batches)
            for batch in batches:
                batch["kl"].fill_(kl)
        return batches


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
    """Synthetic learnable images (``pretrain_vit.py --mock-data``): uint8, as the image loader ships them (the
    device normalises them, ``vit.device_pixels``); each image is its class's fixed random pattern plus one of a
    fixed bank of noise images; deterministic per step, identical on every mesh. A step is two gathers and an add,
    because it is part of the timed step: drawing fresh fp32 noise took 80 ms for ViT-H's batch of 64 (2 cores),
    a third of a GPU step."""

    NOISE_IMAGES = 32

    def __init__(self, *, image_size: int, num_classes: int, channels: int = 3, global_batch_size: int,
                 micro_batch_size: int, dp_rank: int, dp_size: int, seed: int):
        self.seed, self.global_batch_size, self.micro_batch_size = seed, global_batch_size, micro_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        g = torch.Generator().manual_seed(seed)
        size = (channels, image_size, image_size)  # pattern + noise < 256: no wrap-around
        self.prototypes = torch.randint(0, 192, (num_classes, *size), generator=g, dtype=torch.uint8)
        self.noise = torch.randint(0, 64, (self.NOISE_IMAGES, *size), generator=g, dtype=torch.uint8)
        self.step = 0

    def _global_batch(self, step: int) -> List[Batch]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        labels = torch.randint(0, self.prototypes.shape[0], (self.global_batch_size,), generator=g)
        noise = torch.randint(0, self.NOISE_IMAGES, (self.global_batch_size,), generator=g)
        micro = self.micro_batch_size
        starts = synthetic.data_parallel_slice(range(0, self.global_batch_size, micro), self.dp_rank, self.dp_size)
        mine = [dict(pixels=self.prototypes[labels[i:i + micro]] + self.noise[noise[i:i + micro]],
                     labels=labels[i:i + micro], loss_mask=torch.ones(micro)) for i in starts]
        if torch.cuda.is_available():  # as the image loader's batches: asynchronous copies to the GPU
            mine = [{k: v.pin_memory() for k, v in batch.items()} for batch in mine]
        return mine

    def train_microbatches(self) -> List[Batch]:
        self.step += 1
        return self._global_batch(self.step)

    def valid_microbatches(self, iters: int) -> Iterator[List[Batch]]:
        for k in range(iters):
            yield self._global_batch(-1 - k)


class TensorParallelBroadcast:
    """Megatron-LM's ``broadcast_data`` for a source with fixed micro-batch shapes (``spec``: key -> (shape,
    dtype)): the first rank of each tensor-parallel group reads (for images: decodes) the micro-batches and
    broadcasts them to its group, already on the device. The other ranks build the same source for its metadata
    and never read it, so TP ranks do not decode every image TP times."""

    def __init__(self, source, spec: Dict[str, Tuple[tuple, torch.dtype]], per_step: int, *, device, group,
                 src: int, reader: bool):
        self.source, self.spec, self.per_step = source, spec, per_step
        self.device, self.group, self.src, self.reader = device, group, src, reader

    def _share(self, batches: Optional[List[Batch]]) -> List[Batch]:
        shared = []
        for i in range(self.per_step):
            batch = {}
            for key, (shape, dtype) in self.spec.items():
                tensor = (batches[i][key].to(self.device, non_blocking=True) if self.reader
                          else torch.empty(shape, dtype=dtype, device=self.device))
                dist.broadcast(tensor, self.src, group=self.group)
                batch[key] = tensor
            shared.append(batch)
        return shared

    def train_microbatches(self) -> List[Batch]:
        return self._share(self.source.train_microbatches() if self.reader else None)

    def valid_microbatches(self, iters: int) -> Iterator[List[Batch]]:
        if self.reader:
            for batches in self.source.valid_microbatches(iters):
                yield self._share(batches)
        else:
            for _ in range(iters if self.source.valid_size else 0):
                yield self._share(None)

    def __getattr__(self, name):  # num_classes, state_dict, load_state_dict, ...: the source's
        return getattr(self.source, name)


class PipelinePlaceholder:
    """A middle pipeline stage's data: it runs on the previous stage's activations and computes no loss, so it gets
    the source's shapes (reused zero tensors) instead of decoded images; everything else is the source's."""

    def __init__(self, source, spec: Dict[str, Tuple[tuple, torch.dtype]], per_step: int):
        self.source, self.per_step = source, per_step
        self.batch = {key: torch.zeros(shape, dtype=dtype) for key, (shape, dtype) in spec.items()}

    def train_microbatches(self) -> List[Batch]:
        return [self.batch] * self.per_step

    def valid_microbatches(self, iters: int) -> Iterator[List[Batch]]:
        for _ in range(iters if self.source.valid_size else 0):
            yield [self.batch] * self.per_step

    def __getattr__(self, name):
        return getattr(self.source, name)


def image_source(run, device):
    """``pretrain_vit.py``'s data: synthetic images (``--mock-data``) or ``--data-path`` through the image loader,
    read once per TP group, and not at all on middle pipeline stages."""
    flags, training, shape, mesh = run.data, run.training, run.shape, run.mesh
    from megatron.core import parallel_state

    from megatron_ext.data.images import build_image_data

    batching = dict(global_batch_size=training.global_batch_size, micro_batch_size=training.micro_batch_size,
                    dp_rank=parallel_state.get_data_parallel_rank(), dp_size=mesh.dp, seed=training.seed)
    if flags.mock_data:
        return MockImages(image_size=shape.image_size, num_classes=run.model.num_classes or 10,
                          channels=shape.num_channels, **batching)
    data = build_image_data(flags.data_path, image_size=shape.image_size, image_column=flags.image_column,
                            label_column=flags.label_column, data_split=flags.data_split, num_workers=flags.num_workers,
                            bad_images=flags.bad_images, num_classes=run.model.num_classes, **batching)
    if not (parallel_state.is_pipeline_first_stage(ignore_virtual=True)
            or parallel_state.is_pipeline_last_stage(ignore_virtual=True)):
        return PipelinePlaceholder(data, data.batch_spec, data.micro_per_step)
    if mesh.tp == 1:
        return data
    return TensorParallelBroadcast(data, data.batch_spec, data.micro_per_step, device=device,
                                   reader=parallel_state.get_tensor_model_parallel_rank() == 0,
                                   group=parallel_state.get_tensor_model_parallel_group(),
                                   src=parallel_state.get_tensor_model_parallel_src_rank())
