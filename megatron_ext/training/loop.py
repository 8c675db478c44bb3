"""The one training loop: any engine (forward_backward + optimizer_step), any model family, per-step metrics."""

from __future__ import annotations

import json
import os
import time
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state


def is_logging_rank() -> bool:
    """The rank that holds the loss: last pipeline stage, first TP and DP rank."""
    return (parallel_state.is_pipeline_last_stage(ignore_virtual=True)
            and parallel_state.get_tensor_model_parallel_rank() == 0
            and parallel_state.get_data_parallel_rank() == 0)


def train(engine, microbatches_for_step: Callable[[int], List[Dict[str, torch.Tensor]]], *, train_iters: int,
          tokens_per_step: int, log_dir: Optional[str] = None) -> List[dict]:
    """Run ``train_iters`` optimizer steps; print one line and write one JSON object per step on the logging rank."""
    logging = is_logging_rank()
    sink = None
    if logging and log_dir:
        os.makedirs(log_dir, exist_ok=True)
        sink = open(os.path.join(log_dir, "metrics.jsonl"), "w")
    history = []
    for step in range(1, train_iters + 1):
        batches = microbatches_for_step(step)
        start = time.perf_counter()
        loss = engine.forward_backward(batches)
        after_backward = time.perf_counter()
        stats = engine.optimizer_step()
        end = time.perf_counter()
        record = dict(step=step, loss=loss, lr=stats["lr"], grad_norm=stats["grad_norm"], step_time=end - start,
                      fwd_bwd_time=after_backward - start, optimizer_time=end - after_backward,
                      tokens_per_sec=tokens_per_step / (end - start))
        history.append(record)
        if logging:
            print(f"step {step:4d}/{train_iters} | loss {loss:.4f} | grad norm {stats['grad_norm']:.3f} | "
                  f"lr {stats['lr']:.2e} | {record['step_time'] * 1e3:.0f} ms | "
                  f"{record['tokens_per_sec']:.0f} tok/s", flush=True)
            if sink:
                sink.write(json.dumps(record) + "\n")
                sink.flush()
    if sink:
        sink.close()
    dist.barrier()
    return history
