"""Profiling, Megatron-LM's flag names: which steps and ranks torch.profiler records, and where traces go
(observability/profiler.py records them)."""

from __future__ import annotations

import dataclasses
import os
from typing import Optional, Tuple

from megatron_ext.config import Section, option
from megatron_ext.errors import ConfigError
from megatron_ext.flag_types import nonneg_int, positive_int


@dataclasses.dataclass
class Profiling(Section):
    """Record steps ``step_start .. step_end - 1`` on ``ranks`` (None: all) into ``directory``."""

    GROUP = "profiling (torch.profiler traces per rank; tools/analyze_traces.py reads them)"
    enabled: bool = option(False, flags=("--profile",), help="record a Chrome trace of steps --profile-step-start .. "
                                                             "--profile-step-end - 1 on --profile-ranks")
    step_start: int = option(2, flags=("--profile-step-start",), type=positive_int,
                             help="first recorded step (default 2: one warm-up)")
    step_end: Optional[int] = option(None, flags=("--profile-step-end",), type=positive_int,
                                     help="first step no longer recorded (default: start + 3, three steps)")
    ranks: Optional[Tuple[int, ...]] = option(None, flags=("--profile-ranks",), type=nonneg_int, nargs="+",
                                              help="global ranks to record (default all)")
    directory: Optional[str] = option(None, flags=("--profile-dir",),
                                      help="rank{r}_trace.json.gz go here (default <log-dir>/traces)")
    memory: bool = option(False, flags=("--profile-memory",),
                          help="allocations in the trace and, on GPU, a CUDA memory snapshot per rank "
                               "(pytorch.org/memory_viz)")
    record_shapes: bool = option(False, help="operator input shapes in the trace")
    with_stack: bool = option(False, help="Python stacks in the trace (large, slow to analyse)")

    def records(self, rank: int) -> bool:
        return self.enabled and (self.ranks is None or rank in self.ranks)

    def check(self, run) -> None:
        """Resolves the window, the ranks and the directory; one line for any that cannot be."""
        others = [flag for flag, value in (("--profile-dir", self.directory), ("--profile-ranks", self.ranks),
                                           ("--profile-memory", self.memory), ("--record-shapes", self.record_shapes),
                                           ("--with-stack", self.with_stack)) if value]
        if not self.enabled:
            if others:
                raise ConfigError(f"{others[0]} needs --profile")
            return
        start, train_iters, world = self.step_start, run.training.train_iters, run.mesh.world
        end = start + 3 if self.step_end is None else self.step_end
        if start < 1:
            raise ConfigError(f"--profile-step-start must be >= 1 (steps count from 1), got {start}")
        if start > train_iters:
            raise ConfigError(f"--profile-step-start {start} is after the last step (--train-iters {train_iters})")
        if end <= start:
            raise ConfigError(f"--profile-step-end ({end}) must be greater than --profile-step-start ({start}): "
                              "steps start .. end-1 are recorded")
        if self.ranks is not None:
            bad = [r for r in self.ranks if not 0 <= r < world]
            if bad:
                raise ConfigError(f"--profile-ranks {bad[0]} is not a rank of this world of {world} (0 .. "
                                  f"{world - 1})")
            self.ranks = tuple(sorted(set(self.ranks)))
        log_dir = run.logging.log_dir
        self.directory = self.directory or (os.path.join(log_dir, "traces") if log_dir else None)
        if self.directory is None:
            raise ConfigError("--profile needs --profile-dir DIR or --log-dir DIR (traces then go to DIR/traces)")
        if os.path.exists(self.directory) and not os.path.isdir(self.directory):
            raise ConfigError(f"--profile-dir {self.directory} is a file; give a directory")
        self.step_end = min(end, train_iters + 1)
