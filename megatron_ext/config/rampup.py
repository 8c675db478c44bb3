"""Megatron-LM's batch-size ramp-up for pretraining (``pretrain_gpt.py --rampup-batch-size START INCREMENT SAMPLES``).

The global batch starts at START and grows by INCREMENT every SAMPLES / ((--global-batch-size - START) / INCREMENT)
consumed samples until it reaches --global-batch-size: megatron-core's ``RampupBatchsizeNumMicroBatchesCalculator``
decides each step's size from the samples consumed before it. The run's length and its learning-rate schedule count
samples (--train-samples, --lr-*-samples), as Megatron-LM requires, and the schedule advances by each step's own
batch; the step count is Megatron-LM's (``update_train_iters``). Each step's batch is whole micro-batches on every
data-parallel rank; the data (megatron-core's pretraining samples) is read in order, so a resume continues the ramp
from the checkpoint's consumed samples. Torch-free until a batch size is asked for.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import List, Optional

from megatron_ext.config import Section, option
from megatron_ext.errors import ConfigError
from megatron_ext.flag_types import positive_int


@dataclasses.dataclass(frozen=True)
class Rampup:
    start: int
    increment: int
    samples: int
    global_batch_size: int
    micro_batch_size: int
    dp: int

    @functools.cached_property
    def _calculator(self):
        from megatron.core.num_microbatches_calculator import RampupBatchsizeNumMicroBatchesCalculator

        return RampupBatchsizeNumMicroBatchesCalculator(
            self.global_batch_size, self.micro_batch_size, self.dp, decrease_batch_size_if_needed=False, rank=-1,
            start_global_batch_size=self.start, batch_size_increment=self.increment, ramup_samples=self.samples)

    def batch_at(self, consumed_samples: int) -> int:
        """The global batch of the step that starts after ``consumed_samples``."""
        self._calculator.update(consumed_samples, consistency_check=True)
        return self._calculator.get_current_global_batch_size()

    def sizes(self) -> List[int]:
        return list(range(self.start, self.global_batch_size + 1, self.increment))

    def train_iters(self, train_samples: int) -> int:
        """Megatron-LM's step count: the ramp's steps while at most SAMPLES are consumed, then whole global
        batches of what --train-samples leaves (a partial last batch is dropped)."""
        steps = consumed = 0
        while consumed <= self.samples and consumed <= train_samples:
            consumed += self.batch_at(consumed)
            steps += 1
        return steps + max(train_samples - consumed, 0) // self.global_batch_size


@dataclasses.dataclass
class RampupFlags(Section):
    GROUP = "training"
    rampup_batch_size: Optional[List[int]] = option(
        None, type=positive_int, nargs=3, metavar=("START", "INCREMENT", "SAMPLES"),
        help="Megatron-LM's batch-size ramp-up: start at START, grow by INCREMENT until --global-batch-size over the "
             "first SAMPLES samples (needs --train-samples)")

    def check(self, run) -> None:
        """The ramp-up, checked in one line per mistake; it sets the run's step count (Megatron-LM's) and the
        schedule's batch per step."""
        run.rampup = _ramp(self, run)
        if run.rampup:
            run.training.train_iters = run.rampup.train_iters(run.training.train_samples)
            run.optimizer.rampup = run.rampup


def _ramp(flags: RampupFlags, run) -> Optional[Rampup]:
    if not flags.rampup_batch_size:
        return None
    start, increment, samples = flags.rampup_batch_size
    training, mesh = run.training, run.mesh
    flag = f"--rampup-batch-size {start} {increment} {samples}"
    gbs, per_step = training.global_batch_size, training.micro_batch_size * mesh.dp
    if training.train_samples is None:
        raise ConfigError(f"{flag} counts samples: give the run's length as --train-samples (and the schedule's as "
                          "--lr-*-samples), as Megatron-LM does")
    if run.engine.engine == "deepspeed":
        raise ConfigError(f"{flag} does not go with --engine deepspeed (its gradient accumulation steps are fixed "
                          "in its config); use --engine megatron or fsdp")
    if start >= gbs or (gbs - start) % increment:
        raise ConfigError(f"{flag}: START must be below --global-batch-size {gbs} and reach it in steps of "
                          f"INCREMENT (here {gbs} - {start} is not a multiple of {increment})")
    ramp = Rampup(start, increment, samples, gbs, training.micro_batch_size, mesh.dp)
    odd = [size for size in ramp.sizes() if size % per_step]
    if odd:
        raise ConfigError(f"{flag}: the batch size {odd[0]} on the way is not a multiple of --micro-batch-size "
                          f"{training.micro_batch_size} x DP {mesh.dp} = {per_step}; choose START and INCREMENT that "
                          "are")
    if mesh.vpp and start // per_step < mesh.pp:
        raise ConfigError(f"{flag}: the interleaved schedule needs at least --pipeline-model-parallel-size "
                          f"{mesh.pp} micro-batches per step, START gives {start // per_step}; raise START")
    return ramp
