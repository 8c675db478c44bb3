"""torch.profiler around a window of training steps, one Chrome trace per recorded rank.

The profiler exists only for ranks that record, and only from the step before the window (Kineto's warm-up, so
start-up cost stays out of the first recorded step) to the window's end; every other step costs one ``if``. Each
recorded step is a ``ProfilerStep#N`` range (N = the training step; HTA derives iterations from these) holding
``## Training Step N ##`` and the labelled parts of ``regions``. The trace carries ``distributedInfo`` (which HTA
reads the rank from; torch writes it when a process group exists) and a ``megatron_ext`` record: mesh, coordinates,
engine, device, the steps.
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Optional

import torch
import torch.distributed as dist

from megatron_ext.config.profiling import Profiling
from megatron_ext.observability.regions import StepRegions


def trace_path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"rank{rank}_trace.json.gz")


class StepProfiler:
    """``with profiler.step(n):`` around each training step; ``close()`` at the end (a run that stops inside
    the window still writes what it recorded)."""

    def __init__(self, settings: Optional[Profiling], device: torch.device, regions: StepRegions,
                 metadata: dict, start_iteration: int = 0):
        self.settings, self.device, self.regions = settings, device, regions
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.metadata = dict(metadata, rank=self.rank, device=device.type,
                             world_size=dist.get_world_size() if dist.is_initialized() else 1)
        self._profiler = None
        self._recording = False
        self.path: Optional[str] = None
        self.enabled = settings is not None and settings.records(self.rank)
        # The steps the profiler slows, on every rank (one profiled rank holds up the rest): marked in the records
        self.window = (range(settings.step_start, settings.step_end)
                       if settings is not None and start_iteration < settings.step_start else range(0))
        if self.enabled and start_iteration >= settings.step_start:
            self.enabled = False
            if self.rank == 0:
                print(f"megatron_ext: --profile-step-start {settings.step_start} is not after the resumed step "
                      f"{start_iteration}; nothing is recorded (move the window)", flush=True)

    def _create(self) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        options = {}
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            # CUDA synchronisation events let HTA's critical-path analysis see where the host waited.
            options["experimental_config"] = torch._C._profiler._ExperimentalConfig(enable_cuda_sync_events=True)
        s = self.settings
        self._profiler = torch.profiler.profile(activities=activities, record_shapes=s.record_shapes,
                                                with_stack=s.with_stack, profile_memory=s.memory, **options)
        self._profiler.prepare_trace()  # Kineto warm-up: nothing of this step is kept

    def _start(self) -> None:
        if self._profiler is None:
            self._create()
        self._profiler.start_trace()
        meta = dict(self.metadata, steps=[self.settings.step_start, self.settings.step_end - 1])
        self._profiler.add_metadata_json("megatron_ext", json.dumps(meta))
        if not dist.is_initialized():
            self._profiler.add_metadata_json("distributedInfo", json.dumps({"rank": 0, "world_size": 1}))
        if self.settings.memory and self.device.type == "cuda":
            torch.cuda.memory._record_memory_history(max_entries=100_000, stacks="python")
        self._recording = self.regions.labelled = True

    def _stop(self) -> None:
        self._recording = self.regions.labelled = False
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._profiler.stop_trace()
        os.makedirs(self.settings.directory, exist_ok=True)
        self.path = trace_path(self.settings.directory, self.rank)
        self._profiler.export_chrome_trace(self.path)
        if self.settings.memory and self.device.type == "cuda":
            torch.cuda.memory._dump_snapshot(
                os.path.join(self.settings.directory, f"rank{self.rank}_memory_snapshot.pickle"))
            torch.cuda.memory._record_memory_history(enabled=None)
        self._profiler = None
        self.enabled = False
        if self.rank == 0 or (self.settings.ranks and self.rank == self.settings.ranks[0]):
            print(f"megatron_ext: trace of steps {self.settings.step_start}..{self.settings.step_end - 1} in "
                  f"{self.settings.directory}/ (rank{{r}}_trace.json.gz; tools/analyze_traces.py reads them)",
                  flush=True)

    @contextlib.contextmanager
    def step(self, step: int):
        if not self.enabled:
            yield
            return
        s = self.settings
        if step == s.step_start - 1:
            self._create()
        elif step == s.step_start:
            self._start()
        if not self._recording:
            yield
            return
        with torch.profiler.record_function(f"ProfilerStep#{step}"), \
                torch.profiler.record_function(f"## Training Step {step} ##"):
            yield
        if step == s.step_end - 1:
            self._stop()

    def close(self) -> None:
        """Write what was recorded if the run ended inside the window (--exit-interval, --train-iters)."""
        if self._recording:
            self._stop()
        self._profiler = None
