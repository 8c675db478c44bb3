"""LoRA on grouped experts (``models/grouped_experts.py``): each adapter factor of every local expert stacked like the
base weights, so an adapter is one grouped GEMM per factor (``torch._grouped_mm``), never a loop over experts.

Parameters, each ``[E, in, out]`` (the expert's factor transposed, as the weights), on the experts' module:
``lora_a1`` [E, H, r/etp], ``lora_b1`` [E, r, fc1/etp] (SwiGLU: [E, r, 2, F/etp], gate and up), ``lora_a2``
[E, F/etp, r], ``lora_b2`` [E, r, H/etp]. The experts' tokens are the same on every expert-TP rank (the dispatcher
gathers them) and their outputs partial sums (it reduce-scatters them), so under expert TP:
- fc1 (column-parallel): A split over r, its output all-gathered (backward: split), B's input gradient all-reduced;
- fc2 (row-parallel): A's output all-reduced (every rank holds part of F), B split over H, each rank adding its
  columns only (the dispatcher's sum puts them together); B's input gradient all-reduced.
Per expert they are SequentialMLP's ``local_experts.{e}.linear_fc{1,2}.lora_{a,b}.weight`` (``per_expert``), so the
mesh-independent initialisation, a one-process reference with ``LoRALinear`` on SequentialMLP, and the PEFT
conversion see the same names and shapes.
"""

from __future__ import annotations

from typing import Iterator, Tuple

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                    gather_from_tensor_model_parallel_region,
                                                    reduce_from_tensor_model_parallel_region)

from megatron_ext.models.grouped_gemm import ALIGN_BYTES, _GroupedLinear

NAMES = ("lora_a1", "lora_b1", "lora_a2", "lora_b2")


def add(experts, target: str, rank: int, scale: float) -> None:
    """Adapters on the experts' fc1 or fc2 (``target``), trainable, values drawn later (``lora._init_adapters``)."""
    from megatron_ext.errors import ConfigError

    config, etp = experts.config, experts.tp_group.size()
    if rank % etp or config.hidden_size % etp:
        raise ConfigError(f"--lora-rank {rank} and the hidden size {config.hidden_size} must be divisible by "
                          f"--expert-tensor-parallel-size {etp} for LoRA on the experts")
    multiple = ALIGN_BYTES // experts.weight1.element_size()
    if (rank // etp) % multiple:
        raise ConfigError(f"--lora-rank {rank}: LoRA on the grouped experts needs a rank per expert-TP rank that is "
                          f"a multiple of {multiple} in {str(experts.weight1.dtype).replace('torch.', '')} "
                          f"(torch._grouped_mm's 16-byte rows); use --lora-rank {multiple * etp} or more")
    e, h, ffn, fc1 = experts.num_local_experts, config.hidden_size, experts.ffn, experts.fc1
    device, dtype = experts.weight1.device, experts.weight1.dtype
    shapes = {"fc1": {"lora_a1": ((e, h, rank // etp), 2),
                      "lora_b1": ((e, rank, 2, ffn) if config.gated_linear_unit else (e, rank, fc1), -1)},
              "fc2": {"lora_a2": ((e, ffn, rank), 1), "lora_b2": ((e, rank, h // etp), 2)}}[target]
    for name, (shape, dim) in shapes.items():
        param = torch.nn.Parameter(torch.zeros(shape, device=device, dtype=dtype))
        set_tensor_model_parallel_attributes(param, True, dim % len(shape), 1)
        param.allreduce = experts.weight1.allreduce  # expert-parallel exactly when the experts are
        experts.register_parameter(name, param)
    experts.lora_scale = scale


def layouts(experts) -> Iterator[Tuple[str, str, Tuple[int, int, int], int]]:
    """``TorchGroupedMLP.layouts`` of the adapters present: (parameter, per-expert name, [E, in, out], partition
    dim of each expert's [out, in] factor)."""
    for name, layer, dim in (("lora_a1", "linear_fc1.lora_a.weight", 0), ("lora_b1", "linear_fc1.lora_b.weight", 0),
                             ("lora_a2", "linear_fc2.lora_a.weight", 1), ("lora_b2", "linear_fc2.lora_b.weight", 0)):
        param = experts._parameters.get(name)
        if param is not None:
            yield name, layer, _view_shape(param), dim


def _view_shape(param: torch.Tensor) -> Tuple[int, int, int]:
    return param.shape[0], param.shape[1], param[0, 0].numel()


def _gemm(experts, x: torch.Tensor, name: str, offs, empty) -> torch.Tensor:
    param = getattr(experts, name)
    return _GroupedLinear.apply(x, param, offs, _view_shape(param), experts.gradient_accumulation_fusion, empty)


def fc1_delta(experts, tokens: torch.Tensor, offs, empty) -> torch.Tensor:
    """scale * B A x for every expert's tokens (this rank's fc1 columns)."""
    a, group = _gemm(experts, tokens, "lora_a1", offs, empty), experts.tp_group
    if group.size() > 1:
        a = copy_to_tensor_model_parallel_region(gather_from_tensor_model_parallel_region(a, group), group)
    return experts.lora_scale * _gemm(experts, a, "lora_b1", offs, empty)


def fc2_delta(experts, hidden: torch.Tensor, offs, empty) -> torch.Tensor:
    """scale * B A h, as this rank's part of the sum the dispatcher takes over expert TP."""
    a, group = _gemm(experts, hidden, "lora_a2", offs, empty), experts.tp_group
    if group.size() > 1:
        a = copy_to_tensor_model_parallel_region(reduce_from_tensor_model_parallel_region(a, group), group)
    delta = _gemm(experts, a, "lora_b2", offs, empty)
    if group.size() > 1:  # this rank's columns of H in place, zeros elsewhere
        width, rank = delta.shape[-1], group.rank()
        delta = F.pad(delta, (rank * width, (group.size() - 1 - rank) * width))
    return experts.lora_scale * delta


def sharded_state(experts, prefix: str, sharded_offsets) -> dict:
    """The adapters as dist-checkpoint tensors with global shapes ([E_global, in, out], expert TP axis whole), so a
    checkpoint resumes under another EP or expert-TP size; the parameters themselves, so the distributed optimizer
    finds their state."""
    from megatron.core.dist_checkpointing import ShardedTensor

    n, ep, etp = len(sharded_offsets), experts.ep_group, experts.tp_group
    state = {}
    for name, layer, _, _ in layouts(experts):
        param = getattr(experts, name)
        key = f"{prefix}experts.{layer}"  # (GroupedMLP's naming: under its parameter's name in the dict)
        state[f"{prefix}{name}"] = ShardedTensor.from_rank_offsets(
            key, param, *sharded_offsets, (n, ep.rank(), ep.size()), (n + param.partition_dim, etp.rank(), etp.size()),
            replica_id=(0, 0, experts.dp_group.rank()), prepend_axis_num=n)
    return state


@torch.no_grad()
def merge(experts) -> None:
    """Fold the adapters into weight1/weight2 and drop them (collective over expert TP): W [in, out] += s A B."""
    from megatron_ext.models.sharding import all_gather_tp

    if experts.lora_scale is None:
        return
    e, h, group = experts.num_local_experts, experts.config.hidden_size, experts.tp_group
    whole = lambda t: torch.cat(all_gather_tp(t, group), dim=-1) if group.size() > 1 else t  # noqa: E731
    for weight, shape, a, b, gathered in ((experts.weight1, (e, h, experts.fc1), "lora_a1", "lora_b1", "a"),
                                          (experts.weight2, (e, experts.ffn, h), "lora_a2", "lora_b2", "b")):
        if a not in experts._parameters:
            continue
        fa, fb = (getattr(experts, n).float() for n in (a, b))
        fa, fb = (whole(fa), fb) if gathered == "a" else (fa, whole(fb))
        w = weight.view(shape)
        w.copy_((w.float() + experts.lora_scale * torch.bmm(fa, fb.reshape(e, fb.shape[1], -1))).to(w.dtype))
        del experts._parameters[a], experts._parameters[b]
    experts.lora_scale = None
