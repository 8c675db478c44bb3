"""What the loop checks after every step so that a long run survives its cluster: a preemption signal or the time
limit (save, exit 0 on every rank together), a non-finite loss or gradient (``--on-nan``) and loss spikes.

A signal reaches one process (Slurm's ``--signal``, a ``kill``); the handler only sets a flag, the step finishes,
and one small all-reduce per step makes every rank agree before anyone saves. The loss and the gradient norm are
already on the host once per step, so the checks add no device sync; the all-reduce carries their verdicts.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import os
import signal
import time
from typing import Optional

import psutil
import torch
import torch.distributed as dist

from megatron_ext import cli
from megatron_ext.errors import TrainingStopped
from megatron_ext.observability.regions import LABELS
from megatron_ext.config.reliability import Reliability

# What gloo and NCCL say when a peer hung (timeout) or died (connection closed) in the middle of a collective.
_COLLECTIVE_FAILURES = ("timed out", "timeout", "connection closed", "connection reset", "broken pipe", "nccl")


@dataclasses.dataclass
class Verdict:
    """What every rank agrees on after a step. Ranks: the lowest that saw it (None: nobody did)."""

    signal: Optional[str] = None
    signal_rank: Optional[int] = None
    time_up: bool = False
    nonfinite_loss_rank: Optional[int] = None
    nonfinite_grad: bool = False
    # The step's busy time (seconds not spent waiting for other ranks) at its longest and shortest, and where
    busy_max: float = 0.0
    busy_min: float = 0.0
    slowest_rank: int = 0

    @property
    def nonfinite(self) -> bool:
        return self.nonfinite_loss_rank is not None or self.nonfinite_grad

    def exit_reason(self, settings: Reliability) -> Optional[str]:
        if self.signal is not None:
            return f"{self.signal} received (rank {self.signal_rank})"
        if self.time_up:
            return f"--exit-duration-in-mins {settings.exit_duration_mins:g} reached"
        return None


class LossSpikes:
    """A loss above ``factor`` x the mean of the last ``window`` finite losses (after ``warmup`` of them)."""

    def __init__(self, factor: Optional[float], window: int = 20, warmup: int = 5):
        self.factor, self.warmup = factor, warmup
        self.recent = collections.deque(maxlen=window)

    def check(self, loss: Optional[float]) -> Optional[float]:
        """The running mean the loss exceeds, or None."""
        if self.factor is None or loss is None or not math.isfinite(loss):
            return None
        mean = sum(self.recent) / len(self.recent) if len(self.recent) >= self.warmup else None
        self.recent.append(loss)
        return mean if mean is not None and loss > self.factor * mean else None


class StepGuard:
    """Installs the exit-signal handlers for the life of the loop (``with``); ``agree`` after every step."""

    def __init__(self, settings: Reliability, device: torch.device):
        self.settings, self.device = settings, device
        self.received: Optional[str] = None
        self._previous = {}
        self.spikes = LossSpikes(settings.loss_spike_factor)
        # the job's clock: this process's start, which includes imports and initialisation, as a time limit does
        self.started = psutil.Process().create_time()

    def _handle(self, signum, frame) -> None:
        if self.received is None:
            self.received = signal.Signals(signum).name
            cli.say(f"megatron_ext: rank {dist.get_rank()} received {self.received}: finishing this step, then "
                    "saving and exiting")

    def __enter__(self) -> "StepGuard":
        for name in self.settings.exit_signals:
            self._previous[name] = signal.signal(getattr(signal, name), self._handle)
        if cli.HELD:  # a stop signal before the loop (under megatron_ext.launch): acted on after the first step
            name = cli.HELD.pop()
            if name in self.settings.exit_signals:
                self.received = name
            else:  # --exit-signals leaves it out: what it would have done then
                signal.signal(getattr(signal, name), signal.SIG_DFL)
                os.kill(os.getpid(), getattr(signal, name))
        return self

    def __exit__(self, *exc) -> None:
        for name, handler in self._previous.items():
            signal.signal(getattr(signal, name), handler)
        self._previous.clear()

    def agree(self, loss: Optional[float], grad_norm: Optional[float], busy: float = 0.0) -> Verdict:
        """One all-reduce (max) over the world: which signal, whether time is up, where the loss was not finite, and
        the longest and shortest ``busy`` (this rank's seconds of the step not spent waiting for others) with the
        rank of the longest: each is encoded as microseconds x world + a rank code, so MAX keeps the rank with it."""
        world, rank = dist.get_world_size(), dist.get_rank()
        micros = min(max(int(busy * 1e6), 0), _MICROS - 1)
        names = self.settings.exit_signals
        limit = self.settings.exit_duration_mins
        local = [names.index(self.received) + 1 if self.received in names else 0,
                 world - rank if self.received else 0,
                 int(limit is not None and (time.time() - self.started) / 60 >= limit),
                 world - rank if loss is not None and not math.isfinite(loss) else 0,
                 int(grad_norm is not None and not math.isfinite(grad_norm)),
                 micros * world + world - 1 - rank, (_MICROS - 1 - micros) * world]
        flags = torch.tensor(local, dtype=torch.int64, device=self.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        code, signal_rank, time_up, loss_rank, grad, longest, shortest = flags.tolist()
        return Verdict(signal=names[code - 1] if code else None, signal_rank=world - signal_rank if code else None,
                       time_up=bool(time_up), nonfinite_loss_rank=world - loss_rank if loss_rank else None,
                       nonfinite_grad=bool(grad), busy_max=longest // world / 1e6,
                       busy_min=(_MICROS - 1 - shortest // world) / 1e6, slowest_rank=world - 1 - longest % world)


_MICROS = 2 ** 40  # busy times are encoded below this many microseconds (12.7 days) times the world size


def collective_failure(error: BaseException, step: int, region: Optional[str],
                       settings: Reliability) -> Optional[TrainingStopped]:
    """The one line for a collective that failed (a peer hung past the timeout or died), or None for any other
    error. Every rank prints its own: the one that names a different step or region is the one to look at."""
    text = str(error).strip()
    if not isinstance(error, dist.DistError) and not any(m in text.lower() for m in _COLLECTIVE_FAILURES):
        return None
    first = text.splitlines()[0] if text else type(error).__name__
    where = f" in {LABELS[region].strip('# ')}" if region in LABELS else ""
    return TrainingStopped(
        f"rank {dist.get_rank()}: a collective failed at step {step}{where} ({first[:240]}); another rank hung or "
        f"died (its own line or log says which) or the network failed; collectives give up after "
        f"--distributed-timeout-minutes {settings.distributed_timeout_minutes:g}", every_rank=True)
