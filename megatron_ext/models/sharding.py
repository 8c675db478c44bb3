"""Move tensors between the full (single-process) model and this rank's shards, by megatron-core's own tags.

megatron-core marks tensor-parallel parameters with ``tensor_model_parallel`` and ``partition_dim``; layers carry
their global ``layer_number``. Two layouts are not a plain ``chunk``: SwiGLU's fused ``linear_fc1`` holds
``[gate_r; up_r]`` on TP rank ``r``, and with PP the last stage holds its own copy of tied word embeddings.
MoE experts (``allreduce=False``) are split over expert-parallel ranks (local expert i of EP rank r is global
expert r * E_local + i) and over the expert-TP group instead of TP.
"""

from __future__ import annotations

import re
from typing import Dict, Iterator, List, Tuple

import torch
import torch.distributed as dist
from megatron.core import parallel_state

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_LOCAL_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")


def is_expert(param: torch.nn.Parameter) -> bool:
    return not getattr(param, "allreduce", True)


def tp_group(param: torch.nn.Parameter):
    return (parallel_state.get_expert_tensor_parallel_group() if is_expert(param)
            else parallel_state.get_tensor_model_parallel_group())


def tp_world_size(param: torch.nn.Parameter) -> int:
    """How many ranks split ``param`` if it is tensor-parallel: TP, or expert TP for experts."""
    return dist.get_world_size(tp_group(param))


def tp_partial_grad(param: torch.nn.Parameter, config) -> bool:
    """Whether TP ranks hold partial sums of ``param``'s gradient, to be summed over TP (megatron-core's
    ``finalize_model_grads`` does it by name; DeepSpeed and FSDP need telling): the replicated norms under sequence
    parallelism (each rank normalises its own slice of the sequence) and Qwen3's query/key norms (each rank its own
    heads)."""
    return bool((config.sequence_parallel and getattr(param, "sequence_parallel", False))
                or getattr(param, "tp_partial_grad", False)) and param.requires_grad


def unwrap(module: torch.nn.Module) -> torch.nn.Module:
    while hasattr(module, "module"):
        module = module.module
    return module


def global_named_parameters(chunk: torch.nn.Module) -> Iterator[Tuple[str, str, torch.nn.Parameter]]:
    """(global name, local name, parameter) for one model chunk; global names are those of the PP=1 model.
    Grouped experts appear as SequentialMLP's per-expert weights (views of the stacked ones)."""
    chunk = unwrap(chunk)
    layers = chunk.decoder.layers if hasattr(chunk, "decoder") else []
    for name, param in chunk.named_parameters():
        for piece, tensor in parameter_pieces(chunk, name, param):
            yield _global_name(chunk, layers, piece, tensor), piece, tensor


def parameter_pieces(model: torch.nn.Module, name: str, tensor: torch.Tensor) -> Iterator[Tuple[str, torch.Tensor]]:
    """(name, tensor) of a parameter as the name-based machinery sees it: itself, or for grouped experts each
    expert's weight ("...experts.weight1" -> "...experts.local_experts.{i}.linear_fc1.weight"), as views of
    ``tensor`` (the parameter, or a tensor of its shape such as an FSDP parameter gathered whole)."""
    owner, _, attr = name.rpartition(".")
    module = model.get_submodule(owner) if owner else model
    if not hasattr(module, "per_expert"):
        yield name, tensor
        return
    for sub, view in module.per_expert(attr, data=None if tensor is getattr(module, attr) else tensor):
        yield f"{owner}.{sub}", view


def _global_name(chunk, layers, name: str, param: torch.Tensor) -> str:
    match = _LAYER.match(name)
    if match:
        global_name = f"decoder.layers.{layers[int(match[1])].layer_number - 1}.{name[match.end():]}"
    elif name == "output_layer.weight" and getattr(chunk, "share_embeddings_and_output_weights", False):
        global_name = "embedding.word_embeddings.weight"  # last stage's copy of the tied embedding
    else:
        global_name = name
    expert = _LOCAL_EXPERT.search(global_name)
    if expert and is_expert(param):
        per_rank = chunk.config.num_moe_experts // parallel_state.get_expert_model_parallel_world_size()
        index = parallel_state.get_expert_model_parallel_rank() * per_rank + int(expert[1])
        global_name = f"{global_name[:expert.start()]}.local_experts.{index}.{global_name[expert.end():]}"
    return global_name


def _is_gated_fc1(name: str, param: torch.nn.Parameter, chunk: torch.nn.Module) -> bool:
    # LoRA's A of fc1 is split over its rank, not over fc1's outputs: a plain chunk.
    return ("linear_fc1" in name and "lora_a" not in name and unwrap(chunk).config.gated_linear_unit
            and param.partition_dim == 0)


def local_shard(full: torch.Tensor, name: str, param: torch.nn.Parameter, chunk: torch.nn.Module) -> torch.Tensor:
    """This TP rank's slice of ``full`` for ``param`` (identity for replicated parameters)."""
    if not getattr(param, "tensor_model_parallel", False):
        return full
    group = tp_group(param)
    tp, rank, dim = dist.get_world_size(group), dist.get_rank(group), param.partition_dim
    if _is_gated_fc1(name, param, chunk):
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp, dim=0)[rank], up.chunk(tp, dim=0)[rank]], dim=0)
    return full.chunk(tp, dim=dim)[rank]


def all_gather_tp(tensor: torch.Tensor, group=None) -> List[torch.Tensor]:
    """Every TP rank's ``tensor``, in TP-rank order (collective on the TP group, or ``group``)."""
    group = group or parallel_state.get_tensor_model_parallel_group()
    shards = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(shards, tensor.contiguous(), group=group)
    return shards


def gather_full(shard: torch.Tensor, name: str, param: torch.nn.Parameter, chunk: torch.nn.Module) -> torch.Tensor:
    """Inverse of ``local_shard``: all-gather over TP (collective on the TP or expert-TP group)."""
    if not getattr(param, "tensor_model_parallel", False):
        return shard
    shards = all_gather_tp(shard, tp_group(param))
    if _is_gated_fc1(name, param, chunk):
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(shards, dim=param.partition_dim)


def plain_name(name: str) -> str:
    """A parameter's name as the model without adapters has it (``linear_qkv.base.weight`` -> ``linear_qkv.weight``):
    the name its state dict, its initial value and its Hugging Face rule go by."""
    return name.replace(".base.", ".")


def load_full_state(chunks, full_state: Dict[str, torch.Tensor]) -> None:
    """Copy a full (PP=1, TP=1) parameter dict, by plain names, into this rank's model chunks."""
    with torch.no_grad():
        for chunk in chunks:
            for global_name, name, param in global_named_parameters(chunk):
                param.copy_(local_shard(full_state[plain_name(global_name)], name, param, chunk))


@torch.no_grad()
def write_shard(param: torch.Tensor, value: torch.Tensor) -> None:
    """This rank's rows of ``value`` (the parameter whole over DP) into an FSDP (DTensor) parameter."""
    shards = value.chunk(param.device_mesh.size(), dim=0)  # fully_shard's Shard(0) is torch.chunk's split
    rank = param.device_mesh.get_local_rank()
    shard = shards[rank] if rank < len(shards) else value[:0]
    param.to_local()[:shard.shape[0]].copy_(shard)
