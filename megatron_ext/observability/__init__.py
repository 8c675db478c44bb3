"""Observability for every training run: model FLOPs and MFU, memory and timing, and the metric sinks."""

from megatron_ext.observability.flops import mfu, peak_flops, training_flops_per_token
from megatron_ext.observability.loggers import MetricsLogger, summarize
from megatron_ext.observability.metrics import StepTimer, memory_stats

__all__ = ["MetricsLogger", "StepTimer", "memory_stats", "mfu", "peak_flops", "summarize",
           "training_flops_per_token"]
