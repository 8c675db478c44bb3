"""Which samples each training step uses: deterministic, and resumable from one number.

Every rank computes the same global batch from (seed, epoch, consumed_samples), so the only state a checkpoint needs
is ``consumed_samples``; the epoch follows from it. As in Megatron, each epoch is a fresh permutation and its last
incomplete global batch is dropped, so every step sees exactly ``global_batch_size`` distinct samples. Without
``shuffle`` every epoch reads the data in order (KTO's batches, as TRL's sequential sampling reads them).
"""

from __future__ import annotations

from typing import List, Sequence

import numpy as np

from megatron_ext.errors import ConfigError


class GlobalBatchSampler:
    def __init__(self, dataset_size: int, global_batch_size: int, seed: int, shuffle: bool = True):
        if dataset_size < global_batch_size:
            raise ConfigError(f"the data set has {dataset_size} samples, fewer than --global-batch-size "
                              f"{global_batch_size}; use more data or a smaller global batch")
        self.dataset_size, self.global_batch_size, self.seed = dataset_size, global_batch_size, seed
        self.shuffle = shuffle
        self.samples_per_epoch = dataset_size - dataset_size % global_batch_size
        self.consumed_samples = 0
        self._epoch, self._order = None, None

    @property
    def epoch(self) -> int:
        return self.consumed_samples // self.samples_per_epoch

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            self._epoch, self._order = epoch, (np.random.default_rng([self.seed, epoch]).permutation(self.dataset_size)
                                               if self.shuffle else np.arange(self.dataset_size))
        return self._order

    def next_global_batch(self) -> List[int]:
        """The sample indices of the next step, in order; advances ``consumed_samples``."""
        start = self.consumed_samples % self.samples_per_epoch
        batch = self._permutation(self.epoch)[start:start + self.global_batch_size].tolist()
        self.consumed_samples += self.global_batch_size
        return batch

    def state_dict(self) -> dict:
        return {"consumed_samples": self.consumed_samples}

    def load_state_dict(self, state: dict) -> None:
        self.consumed_samples = int(state["consumed_samples"])


def rank_microbatches(indices: Sequence[int], dp_rank: int, dp_size: int, micro_batch_size: int) -> List[List[int]]:
    """This data-parallel rank's contiguous share of a global batch, cut into micro-batches."""
    per_rank = len(indices) // dp_size
    if per_rank * dp_size != len(indices) or per_rank % micro_batch_size:
        raise ValueError(f"a global batch of {len(indices)} does not split into {dp_size} ranks x micro-batches of "
                         f"{micro_batch_size}")
    share = list(indices[dp_rank * per_rank:(dp_rank + 1) * per_rank])
    return [share[i:i + micro_batch_size] for i in range(0, per_rank, micro_batch_size)]
