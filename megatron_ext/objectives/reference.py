"""The reference model's log-probabilities, DPO's and KTO's: the starting weights' log-probability of every sample's
completions, from one forward-only pass before training (the objective's own step, recording instead of training),
cached beside the data cache and keyed by it and the starting model, then read by every step from the batches."""

from __future__ import annotations

import hashlib
import json
import os
import time
from typing import List

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

from megatron_ext.models.qwen.config import Adapters
from megatron_ext.objectives.base import loss_sums


def completion_logps(mask: torch.Tensor, per_token_loss: torch.Tensor):
    """Each row's summed log-probability over its completion and its completion's token count, whole rows under
    context parallelism (each CP rank holds part of every row; backward: each rank's part of the gradient)."""
    mask = mask.reshape(per_token_loss.shape).float()
    logps = -(per_token_loss.float() * mask).sum(-1)
    tokens = mask.sum(-1)
    if parallel_state.get_context_parallel_world_size() > 1:
        group = parallel_state.get_context_parallel_group()
        logps = reduce_from_tensor_model_parallel_region(logps, group)
        tokens = reduce_from_tensor_model_parallel_region(tokens, group)
    return logps, tokens


def record(collect: list, index: torch.Tensor, values: torch.Tensor, count: torch.Tensor):
    """A step's loss function during the reference pass: keep (sample indices, [b, width] log-probabilities) and
    return a zero loss."""
    collect.append((index, values.detach()))
    return loss_sums(values.sum() * 0, {}, count)


def reference_pass(engine, step, data, dataset, width: int = 2) -> torch.Tensor:
    """[N, width] log-probabilities of every sample's completions (a pair's two) under the engine's current
    (starting) weights, on every rank: one forward-only pass, the last pipeline stage's results shared with all."""
    step.collect = []
    try:
        for microbatches in data.every_pair(dataset):
            engine.forward_backward(microbatches, forward_only=True)
        found = step.collect
    finally:
        step.collect = None
    mine = None
    if found and parallel_state.get_tensor_model_parallel_rank() == 0 and \
            parallel_state.get_context_parallel_rank() == 0:
        mine = (torch.cat([i for i, _ in found]).cpu(), torch.cat([v for _, v in found]).float().cpu())
    everyone: List = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    table = torch.full((len(dataset), width), float("nan"))
    for part in everyone:
        if part is not None:
            table[part[0]] = part[1]
    return table


def cache_path(run, info: dict, model_meta: dict, **rows) -> str:
    """The reference table's file beside the data cache, keyed by the data cache (data, tokenizer, template,
    settings), the starting model and what else makes the rows (``rows``: LD-DPO's alpha, KTO's KL chunk)."""
    source, adapters, checkpoint = run.pretrained.source, run.section(Adapters), run.checkpoint
    identity = dict(pretrained=run.pretrained.pretrained, revision=getattr(source, "revision", None),
                    adapter=adapters.pretrained_adapter if adapters else None,
                    directory=getattr(source, "directory", None), seed=run.training.seed,
                    finetune=checkpoint.load if checkpoint.finetune else None,
                    model_shape=model_meta["model_shape"], params_dtype=model_meta["params_dtype"], **rows)
    data_cache = info["cache_path"]
    key = hashlib.sha256(json.dumps(dict(data=os.path.basename(data_cache), **identity), sort_keys=True,
                                    default=str).encode()).hexdigest()
    objective = os.path.basename(data_cache).split("-")[0]  # dpo or kto
    return os.path.join(os.path.dirname(data_cache), f"{objective}-reference-{key[:24]}.pt")


def prepare(data, path: str, table, what: str) -> str:
    """Set both splits' reference log-probabilities (from ``path``, or ``table(dataset)`` computed and written
    there); the line to print."""
    start = time.perf_counter()
    if os.path.exists(path):
        tables = torch.load(path, weights_only=True)
        how = "read from"
    else:
        tables = {name: table(getattr(data, name)) if len(getattr(data, name)) else torch.zeros(0, 2)
                  for name in ("train", "valid")}
        if dist.get_rank() == 0:
            from megatron_ext.data.cache import atomic_save

            atomic_save(tables, path)
        dist.barrier()
        how = "computed into"
    data.train.reference, data.valid.reference = tables["train"], tables["valid"]
    return f"megatron_ext: {what.format(len(data.train), len(data.valid))} {how} {path} in " \
        f"{time.perf_counter() - start:.1f}s"
