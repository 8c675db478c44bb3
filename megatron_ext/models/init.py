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


def local_shape(param: torch.nn.Parameter) -> torch.Size:
    """This rank's (TP) shape, of a ZeRO-3 partitioned parameter too (DeepSpeed keeps it in ``ds_shape``)."""
    return torch.Size(getattr(param, "ds_shape", param.shape))


def full_shape(param: torch.nn.Parameter) -> torch.Size:
    """The TP-whole shape."""
    if not getattr(param, "tensor_model_parallel", False):
        return local_shape(param)
    shape = list(local_shape(param))
    shape[param.partition_dim] *= tp_world_size(param)
    return torch.Size(shape)


@torch.no_grad()
def initial_value(global_name: str, name: str, param: torch.nn.Parameter, chunk, seed: int,
                  device: torch.device) -> torch.Tensor:
    """This TP rank's initial value of one parameter (``param`` gives its shape and TP layout; it may live on the
    meta device): megatron's scheme, normal(0, std) with std/sqrt(2L) on residual outputs, zero biases, unit norms,
    drawn in full from a generator seeded by (seed, global name), then sliced."""
    if name.endswith("bias"):
        return torch.zeros(local_shape(param), device=device)
    if "layernorm" in name:
        return torch.ones(local_shape(param), device=device)
    config = unwrap(chunk).config
    std = config.init_method_std
    if global_name.endswith(_SCALED):
        std /= math.sqrt(2.0 * config.num_layers)
    generator = torch.Generator(device=device).manual_seed(seed + zlib.crc32(global_name.encode()))
    full = torch.empty(full_shape(param), device=device, dtype=torch.float32)
    full.normal_(0.0, std, generator=generator)
    return local_shard(full, name, param, chunk)


@torch.no_grad()
def init_mesh_independent(chunks, seed: int, value=None) -> None:
    """Every parameter of ``chunks`` to its ``initial_value``, or to ``value(global name, name, param, chunk)``
    (published weights: ``convert/pretrained.values``)."""
    for chunk in chunks:
        for global_name, name, param in global_named_parameters(chunk):
            param.copy_(value(global_name, name, param, chunk) if value else
                        initial_value(global_name, name, param, chunk, seed, param.device))
