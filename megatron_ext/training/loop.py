"""The one training loop: any engine (forward_backward + optimizer_step + state), any data source, any model family.

Per step it records loss, lr, grad norm, throughput, MFU, memory and the step's time split (data, forward, backward,
pipeline communication, gradient reduction, optimizer: ``regions``); it profiles a window of steps (``profiler``),
evaluates, saves and exits on the Megatron-LM intervals.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_ext.observability import flops
from megatron_ext.observability.metrics import memory_stats
from megatron_ext.observability.profile_flags import ProfileSettings
from megatron_ext.observability.profiler import StepProfiler
from megatron_ext.observability.regions import StepRegions, region


def is_logging_rank() -> bool:
    """The rank that holds the loss: last pipeline stage, first TP, CP and DP rank."""
    return (parallel_state.is_pipeline_last_stage(ignore_virtual=True)
            and parallel_state.get_tensor_model_parallel_rank() == 0
            and parallel_state.get_context_parallel_rank() == 0
            and parallel_state.get_data_parallel_rank() == 0)


@dataclasses.dataclass
class LoopSettings:
    train_iters: int
    tokens_per_step: int  # global batch x sequence length: what the hardware processes
    samples_per_step: int
    flops_per_token: float
    peak_flops: Optional[float]  # per device, FLOP/s; None = MFU unknown (CPU without --peak-tflops)
    eval_interval: int = 0
    eval_iters: int = 0
    save: Optional[str] = None
    save_interval: Optional[int] = None
    checkpoint_extra: Optional[dict] = None  # saved with checkpoints: mesh, model shape/dtype, HF config
    exit_interval: Optional[int] = None
    # Per-step statistics a model family adds (MoE router load and aux losses): called on every rank after the
    # optimizer step, as it may reduce across ranks; returns the entries for the record.
    step_metrics: Optional[Callable[[], Dict[str, float]]] = None
    profile: Optional[ProfileSettings] = None
    trace_metadata: Optional[dict] = None  # the megatron_ext record of each trace: mesh, coordinates, engine


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def evaluate(engine, data, eval_iters: int) -> Dict[str, Optional[float]]:
    """Mean per-token loss (``val_loss``) and the engine's other metrics (``val_top1``...) over the first
    ``eval_iters`` validation global batches (the same batches every time)."""
    totals: Dict[str, float] = {}
    count = 0
    for microbatches in data.valid_microbatches(eval_iters):
        loss = engine.forward_backward(microbatches, forward_only=True)
        if loss is not None:
            count += 1
            for name, value in dict(loss=loss, **getattr(engine, "last_metrics", {})).items():
                totals[name] = totals.get(name, 0.0) + value
    if not count:
        return {"val_loss": None}
    return {f"val_{name}": value / count for name, value in totals.items()}


def train(engine, data, settings: LoopSettings, logger, start_iteration: int = 0) -> List[dict]:
    """Run optimizer steps ``start_iteration+1 .. train_iters``; returns this rank's records."""
    device, world = engine.device, dist.get_world_size()
    regions = StepRegions(device)
    profiler = StepProfiler(settings.profile, device, regions, settings.trace_metadata or {}, start_iteration)
    history = []
    try:
        for step in range(start_iteration + 1, settings.train_iters + 1):
            with profiler.step(step), regions.active():
                _synchronize(device)
                start = time.perf_counter()
                with region("data"):
                    microbatches = data.train_microbatches()
                loss = engine.forward_backward(microbatches)
                with region("optimizer"):
                    stats = engine.optimizer_step()
                _synchronize(device)
                step_time = time.perf_counter() - start
            parts = regions.seconds()
            tokens_per_sec = settings.tokens_per_step / step_time
            record = dict(step=step, loss=loss, lr=stats["lr"], grad_norm=stats["grad_norm"],
                          tokens_per_sec=tokens_per_sec, samples_per_sec=settings.samples_per_step / step_time,
                          mfu=flops.mfu(tokens_per_sec / world, settings.flops_per_token, settings.peak_flops),
                          step_time=step_time, **parts,
                          other_time=max(0.0, step_time - sum(parts.values())), skipped=stats["skipped"],
                          **memory_stats(device))
            record.update(getattr(engine, "last_metrics", {}) if loss is not None else {})  # e.g. training top-1
            if settings.step_metrics is not None:
                record.update(settings.step_metrics())
            if settings.eval_interval and step % settings.eval_interval == 0:
                record.update(evaluate(engine, data, settings.eval_iters))
            history.append(record)
            logger.log(record)
            exiting = settings.exit_interval is not None and step >= settings.exit_interval
            if settings.save and (exiting or step == settings.train_iters
                                  or (settings.save_interval and step % settings.save_interval == 0)):
                extra = dict(data=data.state_dict(), **(settings.checkpoint_extra or {}))
                engine.save_checkpoint(settings.save, step, extra)
            if exiting:
                break
    finally:
        profiler.close()
    dist.barrier()
    return history
