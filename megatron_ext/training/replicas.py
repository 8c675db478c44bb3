"""Are the data-parallel replicas' weights still identical? (Megatron-LM's
``--check-weight-hash-across-dp-replicas-interval``.) After the same reduced gradients and the same optimizer step
they must be bit for bit; a difference is silent data corruption (a flipped bit in a GPU's memory or link) or a
nondeterministic reduction, and every later step would train diverging models. Each parameter's fingerprint is
taken where it lives (``fingerprints``: no host copy, where megatron-core's ``check_param_hashes_across_dp_replicas``
moves every weight to the host for SHA-1), gathered over the data-parallel group (expert parameters: the
expert-data-parallel group) and compared with its first rank's; every rank learns the verdict, and the message names
the ranks and parameters that differ."""

from __future__ import annotations

from typing import List, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_MODULUS = 65521  # position weights 1..65521 (a prime)
_CHUNK = 1 << 24


def fingerprints(params) -> torch.Tensor:
    """[len(params), 2] int64 on the parameters' device: each parameter's bit patterns (the raw bits, whatever the
    dtype) summed, and summed weighted by position (1 + index mod 65521), both wrapping mod 2^64. One flipped bit
    moves the first by ±2^k and the second by ±2^k x w, neither 0 mod 2^64 (k < 64 - 16, w < 2^16): always caught;
    a reordering or a difference in several places moves the weighted sum but for vanishing coincidences."""
    rows = []
    for p in params:
        flat = p.detach().reshape(-1).view(_BITS[p.element_size()])
        row = torch.zeros(2, dtype=torch.long, device=flat.device)
        for start in range(0, flat.numel(), _CHUNK):  # int64 temporaries of a chunk, not of a whole embedding
            bits = flat[start:start + _CHUNK].long()  # (an 8-byte dtype's: the parameter's own memory, read only)
            weights = torch.arange(start, start + bits.numel(), device=bits.device).remainder_(_MODULUS).add_(1)
            row += torch.stack([bits.sum(), weights.mul_(bits).sum()])
        rows.append(row)
    return torch.stack(rows)


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
        local = fingerprints([p for _, p in params]).to(engine.device)
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
