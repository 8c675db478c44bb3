"""Initialisation that does not depend on the mesh: every parameter is drawn in full from its own seeded
generator, then sliced to this rank's shard. Any TP/PP/DP layout starts from identical weights, so runs on
different meshes are comparable step for step (megatron-core's default init depends on the pipeline layout).
"""

from __future__ import annotations

import math
import zlib

import torch
from megatron_ext.models.sharding import global_named_parameters, local_shard, tp_world_size, unwrap

# Residual-branch outputs: attention's projection, every MLP's fc2 (dense, routed experts, shared expert).
_SCALED = ("self_attention.linear_proj.weight", "linear_fc2.weight")


def full_shape(param: torch.nn.Parameter) -> torch.Size:
    if not getattr(param, "tensor_model_parallel", False):
        return param.shape
    shape = list(param.shape)
    shape[param.partition_dim] *= tp_world_size(param)
    return torch.Size(shape)


@torch.no_grad()
def init_mesh_independent(chunks, seed: int) -> None:
    """Megatron's scheme (normal(0, std); std/sqrt(2L) on residual outputs; zero biases; unit norms), drawn per
    parameter from a generator seeded by (seed, global name)."""
    for chunk in chunks:
        config = unwrap(chunk).config
        for global_name, name, param in global_named_parameters(chunk):
            if name.endswith("bias"):
                param.zero_()
            elif "layernorm" in name:
                param.fill_(1.0)
            else:
                std = config.init_method_std
                if global_name.endswith(_SCALED):
                    std /= math.sqrt(2.0 * config.num_layers)
                generator = torch.Generator(device=param.device).manual_seed(seed + zlib.crc32(global_name.encode()))
                full = torch.empty(full_shape(param), device=param.device, dtype=torch.float32)
                full.normal_(0.0, std, generator=generator)
                param.copy_(local_shard(full, name, param, chunk))
