"""Are the data-parallel replicas' weights still identical? (Megatron-LM's
``--check-weight-hash-across-dp-replicas-interval``.) After the same reduced gradients and the same optimizer step
they must be bit for bit; a difference is silent data corruption (a flipped bit in a GPU's memory or link) or a
nondeterministic reduction, and every later step would train diverging models. Each parameter's SHA-1 is taken on
the host (as megatron-core's ``check_param_hashes_across_dp_replicas``), gathered over the data-parallel group
(expert parameters: the expert-data-parallel group) and compared with its first rank's; every rank learns the
verdict, and the message names the ranks and parameters that differ."""

from __future__ import annotations

import hashlib
from typing import List, Optional

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state


def _hashes(params, device) -> torch.Tensor:
    return torch.stack([torch.from_numpy(np.frombuffer(hashlib.sha1(
        p.detach().float().cpu().numpy().tobytes()).digest(), dtype=np.uint8).copy()) for p in params]).to(device)


def differences(engine) -> Optional[str]:
    """None when every replica holds the same weights; else what differs (the same text on every rank)."""
    getattr(engine, "finish_param_sync", lambda: None)()  # the distributed optimizer's all-gather, if in flight
    named = [(n, p) for chunk in engine.model for n, p in chunk.named_parameters()]
    mine: List[str] = []
    for expert, group in ((False, parallel_state.get_data_parallel_group(with_context_parallel=True)),
                          (True, parallel_state.get_expert_data_parallel_group())):
        params = [(n, p) for n, p in named if (not getattr(p, "allreduce", True)) == expert]
        if not params or dist.get_world_size(group) == 1:
            continue
        local = _hashes([p for _, p in params], engine.device)
        gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, local, group=group)
        mine += [name for (name, _), same in zip(params, (local == gathered[0]).all(dim=1).tolist()) if not same]
    flag = torch.tensor([float(bool(mine))], device=engine.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if not flag.item():
        return None
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    ranks = [rank for rank, names in enumerate(everyone) if names]
    names = sorted({name for names in everyone for name in names})
    return (f"{len(names)} parameter(s) differ from their data-parallel group's first rank on rank(s) "
            f"{', '.join(map(str, ranks))} ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})")
