"""The parts of a training step, timed every step and labelled in traces while the profiler records.

Engines mark their parts with ``region("forward")`` and friends (or wrap library functions with ``timed``); the
loop activates a ``StepRegions`` for the training step and reads the seconds per part after its device sync. Times
are exclusive: a region nested in another (DeepSpeed's gradient all-reduce inside its backward) is taken out of
the outer one, so the parts add up to at most the step. On GPU each boundary is a CUDA event on the current
stream, read once per step after the synchronisation the loop already does: no host sync per micro-batch, and a
communication region measures the time the compute stream waited for it, i.e. the *exposed* communication.
"""

from __future__ import annotations

import contextlib
import functools
import time
from typing import Callable, Dict, List, Optional

import torch

LABELS = {
    "data": "## Data ##",
    "forward": "## Forward ##",
    "backward": "## Backward ##",
    "pipeline_comm": "## Pipeline Communication ##",
    "grad_reduce": "## Gradient Reduction ##",
    "optimizer": "## Optimizer Step ##",
    "gc": "## Garbage Collection ##",
}

_active: Optional["StepRegions"] = None


class StepRegions:
    """Collects the regions entered while active. ``labelled``: also a ``record_function`` per region (set while
    torch.profiler records; a label costs a little even when nothing records, so it is off otherwise)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.labelled = False
        self._spans: List[list] = []  # [name, start, end, parent index or None]
        self._stack: List[int] = []
        self._events: List = []  # CUDA events already read, recorded again next step (no allocation per mark)
        self.failed_in: Optional[str] = None  # the innermost region an exception left (names a hung collective)

    def _mark(self):
        if self.cuda:
            event = self._events.pop() if self._events else torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    @contextlib.contextmanager
    def region(self, name: str):
        label = torch.profiler.record_function(LABELS[name]) if self.labelled else contextlib.nullcontext()
        with label:
            index = len(self._spans)
            self._spans.append([name, self._mark(), None, self._stack[-1] if self._stack else None])
            self._stack.append(index)
            try:
                yield
            except BaseException:
                self.failed_in = self.failed_in or name
                raise
            finally:
                self._stack.pop()
                self._spans[index][2] = self._mark()

    @contextlib.contextmanager
    def active(self):
        """Make this the target of ``region`` (module level) for the block: one training step."""
        global _active
        previous, _active = _active, self
        try:
            yield self
        finally:
            _active = previous

    def seconds(self) -> Dict[str, float]:
        """Exclusive seconds per region since the last call, keyed ``<name>_time``. Call after the device sync."""
        own = []
        for name, start, end, _ in self._spans:
            own.append(start.elapsed_time(end) / 1e3 if self.cuda else end - start)
        for index, (_, _, _, parent) in enumerate(self._spans):
            if parent is not None:
                own[parent] -= own[index]
        totals = {f"{name}_time": 0.0 for name in LABELS}
        for (name, *_), value in zip(self._spans, own):
            totals[f"{name}_time"] += value
        if self.cuda:
            self._events.extend(event for _, start, end, _ in self._spans for event in (start, end))
        self._spans.clear()
        return totals


def region(name: str):
    """The named part of the step, when a step is being measured; nothing otherwise (evaluation, benchmarks)."""
    return _active.region(name) if _active is not None else contextlib.nullcontext()


def timed(name: str, fn: Callable) -> Callable:
    """``fn`` inside ``region(name)``; idempotent, so library functions can be wrapped in place once."""
    if getattr(fn, "_megatron_ext_region", None) == name:
        return fn

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with region(name):
            return fn(*args, **kwargs)

    wrapper._megatron_ext_region = name
    return wrapper
