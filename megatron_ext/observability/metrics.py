"""Per-step memory and wall-clock measurements that mean the same thing on GPU and CPU."""

from __future__ import annotations

import resource
import sys
import time

import psutil
import torch


def memory_stats(device: torch.device) -> dict:
    """``mem_allocated``, ``mem_reserved``, ``mem_peak`` in bytes.

    GPU: the CUDA caching allocator (tensors, cache including tensors, peak of tensors since start). CPU has no
    allocator cache to tell apart, so allocated and reserved are both the process RSS and the peak is the maximum RSS.
    """
    if device.type == "cuda":
        return dict(mem_allocated=torch.cuda.memory_allocated(device),
                    mem_reserved=torch.cuda.memory_reserved(device),
                    mem_peak=torch.cuda.max_memory_allocated(device))
    rss = psutil.Process().memory_info().rss
    max_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    max_rss_bytes = max_rss if sys.platform == "darwin" else max_rss * 1024  # Linux reports KiB, macOS bytes
    return dict(mem_allocated=rss, mem_reserved=rss, mem_peak=max(rss, max_rss_bytes))


def device_memory_capacity(device: torch.device):
    """Bytes the device can hold (GPU total memory); None on CPU, where the host's memory is shared with all."""
    return torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None


def suggest_micro_batch_size(mem_peak, capacity, micro_batch_size: int, num_microbatches: int,
                             headroom: float = 0.9):
    """The largest micro-batch that surely fits, keeping the global batch: activations grow linearly with the
    micro-batch and model states do not, so peak(k x m) <= k x peak(m). k is the largest power of two with
    k x peak <= headroom x capacity that divides the micro-batches per step. None when nothing larger fits (or
    the capacity is unknown); bigger micro-batches mean fewer, larger kernels on a GPU."""
    if not mem_peak or not capacity:
        return None
    k = 1
    while num_microbatches % (2 * k) == 0 and 2 * k * mem_peak <= headroom * capacity:
        k *= 2
    return micro_batch_size * k if k > 1 else None


class StepTimer:
    """Wall-clock laps that first wait for queued CUDA work, so a lap measures the kernels, not their launch."""

    def __init__(self, device: torch.device):
        self._device = device
        self.start()

    def _now(self) -> float:
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
        return time.perf_counter()

    def start(self) -> None:
        """Begin a new interval (e.g. at the top of a step)."""
        self._last = self._now()

    def lap(self) -> float:
        """Seconds since ``start`` or the previous ``lap``; the next lap counts from here."""
        now = self._now()
        elapsed, self._last = now - self._last, now
        return elapsed
