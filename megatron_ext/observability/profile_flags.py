"""Profiling flags, Megatron-LM's names: which steps and ranks torch.profiler records, and where traces go.
Torch-free, like ``arguments``: every check runs before any process group exists."""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Optional, Tuple

from megatron_ext.errors import ConfigError
from megatron_ext.flag_types import nonneg_int, positive_int


@dataclasses.dataclass(frozen=True)
class ProfileSettings:
    """Record steps ``step_start .. step_end - 1`` on ``ranks`` (None: all) into ``directory``."""

    directory: str
    step_start: int = 2
    step_end: int = 5
    ranks: Optional[Tuple[int, ...]] = None
    memory: bool = False
    record_shapes: bool = False
    with_stack: bool = False

    def records(self, rank: int) -> bool:
        return self.ranks is None or rank in self.ranks


def add_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("profiling (torch.profiler traces per rank; tools/analyze_traces.py reads them)")
    g.add_argument("--profile", action="store_true", help="record a Chrome trace of steps --profile-step-start .. "
                                                          "--profile-step-end - 1 on --profile-ranks")
    g.add_argument("--profile-step-start", type=positive_int, default=2,
                   help="first recorded step (default 2: one warm-up)")
    g.add_argument("--profile-step-end", type=positive_int, default=None,
                   help="first step no longer recorded (default: start + 3, three steps)")
    g.add_argument("--profile-ranks", type=nonneg_int, nargs="+", default=None,
                   help="global ranks to record (default all)")
    g.add_argument("--profile-dir", default=None, help="rank{r}_trace.json.gz go here (default <log-dir>/traces)")
    g.add_argument("--profile-memory", action="store_true",
                   help="allocations in the trace and, on GPU, a CUDA memory snapshot per rank "
                        "(pytorch.org/memory_viz)")
    g.add_argument("--record-shapes", action="store_true", help="operator input shapes in the trace")
    g.add_argument("--with-stack", action="store_true", help="Python stacks in the trace (large, slow to analyse)")


def settings_from_args(args: argparse.Namespace, world_size: int) -> Optional[ProfileSettings]:
    """None without --profile; ConfigError (one line, with the fix) for a window or ranks that cannot be."""
    others = [flag for flag, value in (("--profile-dir", args.profile_dir), ("--profile-ranks", args.profile_ranks),
                                       ("--profile-memory", args.profile_memory),
                                       ("--record-shapes", args.record_shapes), ("--with-stack", args.with_stack))
              if value]
    if not args.profile:
        if others:
            raise ConfigError(f"{others[0]} needs --profile")
        return None
    start = args.profile_step_start
    end = start + 3 if args.profile_step_end is None else args.profile_step_end
    if start < 1:
        raise ConfigError(f"--profile-step-start must be >= 1 (steps count from 1), got {start}")
    if start > args.train_iters:
        raise ConfigError(f"--profile-step-start {start} is after the last step (--train-iters {args.train_iters})")
    if end <= start:
        raise ConfigError(f"--profile-step-end ({end}) must be greater than --profile-step-start ({start}): "
                          "steps start .. end-1 are recorded")
    ranks = None
    if args.profile_ranks is not None:
        bad = [r for r in args.profile_ranks if not 0 <= r < world_size]
        if bad:
            raise ConfigError(f"--profile-ranks {bad[0]} is not a rank of this world of {world_size} (0 .. "
                              f"{world_size - 1})")
        ranks = tuple(sorted(set(args.profile_ranks)))
    directory = args.profile_dir or (os.path.join(args.log_dir, "traces") if args.log_dir else None)
    if directory is None:
        raise ConfigError("--profile needs --profile-dir DIR or --log-dir DIR (traces then go to DIR/traces)")
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise ConfigError(f"--profile-dir {directory} is a file; give a directory")
    return ProfileSettings(directory=directory, step_start=start, step_end=min(end, args.train_iters + 1),
                           ranks=ranks, memory=args.profile_memory, record_shapes=args.record_shapes,
                           with_stack=args.with_stack)
