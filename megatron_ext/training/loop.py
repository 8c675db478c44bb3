"""The one training loop: any engine (forward_backward + optimizer_step + state), any data source, any model family.

Per step it records loss, lr, grad norm, throughput, MFU, memory and the step's time split (data, forward, backward,
pipeline communication, gradient reduction, optimizer: ``regions``); it profiles a window of steps (``profiler``),
evaluates, saves (in the background with --async-save: ``checkpoint.writer``) and exits on the Megatron-LM
intervals, and on a preemption signal or time limit; a non-finite step stops it or is skipped, a failed collective
ends it with one line (``guard``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import time
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_ext.errors import TrainingStopped
from megatron_ext.observability import flops
from megatron_ext.observability.metrics import memory_stats
from megatron_ext.observability.profile_flags import ProfileSettings
from megatron_ext.observability.profiler import StepProfiler
from megatron_ext.observability.regions import StepRegions, region
from megatron_ext.checkpoint.writer import Checkpointer
from megatron_ext.objectives.base import print_rank0
from megatron_ext.training import replicas
from megatron_ext.training.guard import StepGuard, collective_failure
from megatron_ext.training.reliability_flags import ReliabilitySettings


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
    samples: str = "samples"  # what a sample is to the user; "images": throughput in images/s, not patches/s
    eval_interval: int = 0
    eval_iters: int = 0
    save: Optional[str] = None
    save_interval: Optional[int] = None
    async_save: bool = False  # write checkpoints in the background (--async-save)
    checkpoint_extra: Optional[dict] = None  # saved with checkpoints: mesh, model shape/dtype, HF config
    exit_interval: Optional[int] = None
    # Per-step statistics a model family adds (MoE router load and aux losses): called on every rank after the
    # optimizer step, as it may reduce across ranks; returns the entries for the record.
    step_metrics: Optional[Callable[[int], Dict[str, float]]] = None  # of the step's micro-batches (this rank's)
    # Metrics a run adds to each evaluation (--eval-generate-samples: math accuracy by generation): called on every
    # rank as ``eval_metrics(engine, step)``; returns the entries for the record.
    eval_metrics: Optional[Callable[..., Dict[str, float]]] = None
    profile: Optional[ProfileSettings] = None
    trace_metadata: Optional[dict] = None  # the megatron_ext record of each trace: mesh, coordinates, engine
    reliability: ReliabilitySettings = ReliabilitySettings()
    gc_interval: Optional[int] = 50  # --manual-gc-interval (0: never while training); None: Python's own GC


@contextlib.contextmanager
def manual_gc(interval: Optional[int]):
    """Python's automatic collector off for the block (``interval`` not None), after one collection and a freeze of
    what survives it (the model, the optimizer, the data: later collections do not walk them again); the loop then
    collects at the steps ``interval`` divides, the same on every rank. Restored after, also for a failing run."""
    if interval is None:
        yield
        return
    enabled = gc.isenabled()
    gc.collect()
    gc.freeze()
    gc.disable()
    try:
        yield
    finally:
        gc.unfreeze()
        if enabled:
            gc.enable()


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def evaluate(engine, data, eval_iters: int) -> Dict[str, Optional[float]]:
    """Mean per-token loss (``val_loss``) and the engine's other metrics (``val_top1``...) over the first
    ``eval_iters`` validation global batches (the same batches every time)."""
    totals: Dict[str, float] = {}
    count = 0
    with torch.no_grad():  # no graph; MoE routers record no load or aux loss for the next step's statistics
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
    with manual_gc(settings.gc_interval):
        return _train(engine, data, settings, logger, start_iteration)


def _train(engine, data, settings: LoopSettings, logger, start_iteration: int) -> List[dict]:
    device, world = engine.device, dist.get_world_size()
    regions = StepRegions(device)
    profiler = StepProfiler(settings.profile, device, regions, settings.trace_metadata or {}, start_iteration)
    reliability = settings.reliability
    history = []
    saver = Checkpointer(engine, background=settings.async_save, retain=reliability.save_retain)
    with StepGuard(reliability, device) as guard:
        try:
            for step in range(start_iteration + 1, settings.train_iters + 1):
                try:
                    record, verdict = _step(engine, data, settings, step, regions, profiler, guard, world)
                    record.update(saver.poll())  # commits a background save every rank has written
                except RuntimeError as error:
                    raise collective_failure(error, step, regions.failed_in, reliability) or error
                history.append(record)
                stop = _unsaved_stop(engine, step, verdict, record, reliability)  # before this step is saved
                if stop is not None:
                    logger.log(record)
                    saver.wait()  # an earlier step's save in flight is good: committed
                    raise stop
                reason = verdict.exit_reason(reliability)
                exiting = reason is not None or (settings.exit_interval is not None and step >= settings.exit_interval)
                final = exiting or step == settings.train_iters  # written before the run ends, even with --async-save
                if settings.save and (final or (settings.save_interval and step % settings.save_interval == 0)):
                    extra = dict(data=data.state_dict(), **(settings.checkpoint_extra or {}))
                    blocked = record.get("save_blocking_time", 0.0)  # a commit this step already waited for
                    record.update(saver.save(settings.save, step, extra, final=final))
                    record["save_blocking_time"] += blocked
                logger.log(record)
                if reason is not None:
                    saved = f"saved step {step} to --save {settings.save}" if settings.save else "nothing saved (no --save)"
                    print_rank0(f"megatron_ext: {reason}: {saved}; exiting (the same command with --load resumes)")
                if exiting:
                    break
            saver.wait()
        except BaseException:
            saver.abandon()  # a background write is never committed by a failing run
            raise
        finally:
            profiler.close()
    dist.barrier()
    return history


def _step(engine, data, settings: LoopSettings, step: int, regions, profiler, guard, world: int):
    """One optimizer step and its record, then the guard's verdict, which every rank shares."""
    device = engine.device
    with profiler.step(step), regions.active():
        _synchronize(device)
        start = time.perf_counter()
        with region("data"):
            microbatches = data.train_microbatches()
        loss = engine.forward_backward(microbatches)
        with region("optimizer"):
            stats = engine.optimizer_step()
        if settings.gc_interval and step % settings.gc_interval == 0:
            with region("gc"):
                gc.collect()
        _synchronize(device)
        step_time = time.perf_counter() - start
    parts = regions.seconds()
    batch = getattr(data, "last_global_batch", None)  # a batch-size ramp-up's step (else the fixed one)
    share = batch / settings.samples_per_step if batch else 1.0
    tokens_per_sec = settings.tokens_per_step * share / step_time
    record = dict(step=step, loss=loss, lr=stats["lr"], grad_norm=stats["grad_norm"],
                  tokens_per_sec=tokens_per_sec if settings.samples != "images" else None,
                  samples_per_sec=settings.samples_per_step * share / step_time,
                  mfu=flops.mfu(tokens_per_sec / world, settings.flops_per_token, settings.peak_flops),
                  step_time=step_time, **parts,
                  other_time=max(0.0, step_time - sum(parts.values())), skipped=stats["skipped"],
                  **memory_stats(device))
    record.update(getattr(engine, "last_metrics", {}) if loss is not None else {})  # e.g. training top-1
    if batch:
        record["global_batch_size"] = batch
    if step in profiler.window:  # left out of the summary's speeds, shaded in the plot
        record["profiled"] = True
    if settings.step_metrics is not None:
        record.update(settings.step_metrics(len(microbatches)))
    # fp16's loss scaler skips overflowing steps by design: only the loss counts as non-finite then
    # busy: the step less the waits for other ranks (exposed gradient reduction and pipeline exchanges), so the
    # slowest data-parallel replica or pipeline stage shows (the ranks of a TP or CP group wait inside each other's
    # forward and backward, so they read alike)
    busy = step_time - parts["grad_reduce_time"] - parts["pipeline_comm_time"]
    verdict = guard.agree(loss, None if stats.get("loss_scale_overflow") else stats["grad_norm"], busy)
    record.update(busy_time_max=verdict.busy_max, busy_time_min=verdict.busy_min, slowest_rank=verdict.slowest_rank)
    if verdict.nonfinite:
        record["nonfinite"] = True
        if settings.reliability.on_nan == "skip":
            print_rank0(f"megatron_ext: step {step}: {_nonfinite_what(verdict)}; update skipped (--on-nan skip)")
    mean = guard.spikes.check(loss)
    if mean is not None:
        record["loss_spike"] = True
        print(f"megatron_ext: loss spike at step {step}: {loss:.4f} > --loss-spike-factor "
              f"{settings.reliability.loss_spike_factor:g} x running mean {mean:.4f}", flush=True)
    if settings.eval_interval and (step % settings.eval_interval == 0 or step == settings.train_iters):
        record.update(evaluate(engine, data, settings.eval_iters))
        if settings.eval_metrics is not None:
            record.update(settings.eval_metrics(engine, step))
    return record, verdict


def _nonfinite_what(verdict) -> str:
    where = f"non-finite loss on rank {verdict.nonfinite_loss_rank}" if verdict.nonfinite_loss_rank is not None \
        else "non-finite gradient norm"
    return where + (" and gradient norm" if verdict.nonfinite_loss_rank is not None and verdict.nonfinite_grad
                    else "")


def _unsaved_stop(engine, step: int, verdict, record: dict,
                  reliability: ReliabilitySettings) -> Optional[TrainingStopped]:
    """Why this step must end the run without being saved: a non-finite loss or gradient (--on-nan stop), or data-
    parallel replicas whose weights differ (--check-weight-hash-across-dp-replicas-interval); None to go on."""
    if verdict.nonfinite and reliability.on_nan == "stop":
        return TrainingStopped(
            f"step {step}: {_nonfinite_what(verdict)} (loss {record['loss']}, grad norm {record['grad_norm']}); "
            "stopped without applying or saving it (--on-nan stop): resume from the last checkpoint with --load, "
            "perhaps with a lower --lr, or pass --on-nan skip to drop such steps")
    every = reliability.weight_hash_interval
    differ = replicas.differences(engine) if every and step % every == 0 else None
    if differ:
        return TrainingStopped(
            f"step {step}: the data-parallel replicas' weights differ after the same update: {differ}; stopped "
            "without saving it (--check-weight-hash-across-dp-replicas-interval): a flipped bit or a "
            "nondeterministic reduction; resume from the last checkpoint with --load")
    return None
