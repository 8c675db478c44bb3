"""Routed experts as two grouped GEMMs (``torch._grouped_mm``) instead of ``SequentialMLP``'s Python loop of three
GEMMs per expert, forward and backward: megatron-core's own grouped experts need TransformerEngine or the
grouped_gemm package (``../shared/notes/research/mcore_data_async_groupedmm.md`` §3).

Weights are megatron-core ``GroupedMLP``'s: ``weight1`` [H, E·fc1] holds each local expert's [H, fc1] contiguously
(fc1 = [gate_r; up_r] transposed for SwiGLU under expert TP), ``weight2`` [E·F, H] each expert's [F, H]; its
``sharded_state_dict`` is reused, so checkpoints carry SequentialMLP's keys and global shapes, optimizer state
included (the distributed optimizer saves 'fully_reshardable', unflattened): the two load into each other under any
EP size. ``per_expert`` gives SequentialMLP's per-expert tensors as views, so initialisation, conversion,
``--pretrained`` and export see one layout.

``torch._grouped_mm`` wants 16-byte aligned rows: H and the expert FFN size per expert-TP rank multiples of 8
(bf16) or 4 (fp32). Token groups need no padding. Without gradient-accumulation fusion the weight gradient is the
parameter's ``.grad``; with it, it is added to the DDP's fp32 ``main_grad`` in the backward.
"""

from __future__ import annotations

from typing import Iterator, Optional, Tuple

import torch
import torch.nn.functional as F
from megatron.core.fusions.fused_bias_swiglu import weighted_bias_swiglu_impl
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.utils import divide
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.experts import GroupedMLP

from megatron_ext.models import lora_experts
from megatron_ext.models.grouped_gemm import ALIGN_BYTES, _GroupedLinear

def unsupported(hidden: int, ffn_per_rank: int, dtype: torch.dtype, device: torch.device) -> Optional[str]:
    """Why grouped experts cannot run these shapes in ``dtype`` on ``device`` (one probe GEMM), or None."""
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no torch._grouped_mm"
    multiple = ALIGN_BYTES // torch.empty((), dtype=dtype).element_size()
    for what, size in (("hidden size", hidden), ("expert FFN size per expert-TP rank", ffn_per_rank)):
        if size % multiple:
            return (f"the {what} {size} is not a multiple of {multiple}, which torch._grouped_mm needs in "
                    f"{str(dtype).replace('torch.', '')}")
    try:  # forward and backward of two experts on 16 x 16 tiles: the layouts training will use
        n = 16
        x = torch.randn(2 * n, n, dtype=dtype, device=device, requires_grad=True)
        weight = torch.nn.Parameter(torch.randn(n, 2 * n, dtype=dtype, device=device))
        offs = torch.tensor([n, 2 * n], dtype=torch.int32, device=device)
        out = _GroupedLinear.apply(x, weight, offs, (2, n, n), False)
        out.backward(torch.ones_like(out))
    except (RuntimeError, NotImplementedError) as e:
        return f"torch._grouped_mm does not run {str(dtype).replace('torch.', '')} on {device.type} " \
               f"({str(e).splitlines()[0]})"
    return None


class TorchGroupedMLP(MegatronModule):
    """The routed experts of one MoE layer (megatron-core's expert contract: built with ``num_local_experts``,
    called on tokens already permuted by expert, ``(output, None)``)."""

    lora_scale = None  # alpha / r once LoRA adapters are added (models/lora_experts.py)

    def __init__(self, num_local_experts: int, config, submodules=None, pg_collection=None):
        super().__init__(config=config)
        self.num_local_experts = num_local_experts
        self.ep_group, self.tp_group, self.dp_group = pg_collection.ep, pg_collection.expt_tp, pg_collection.expt_dp
        self.ffn = divide(config.moe_ffn_hidden_size, self.tp_group.size())
        self.fc1 = self.ffn * (2 if config.gated_linear_unit else 1)
        self.gradient_accumulation_fusion = False  # the megatron engine turns it on once DDP made main_grad
        device = torch.device("cpu") if config.use_cpu_initialization else torch.cuda.current_device()
        h, e = config.hidden_size, num_local_experts
        self.weight1 = torch.nn.Parameter(torch.empty(h, e * self.fc1, dtype=config.params_dtype, device=device))
        self.weight2 = torch.nn.Parameter(torch.empty(e * self.ffn, h, dtype=config.params_dtype, device=device))
        for weight, dim in ((self.weight1, 1), (self.weight2, 0)):
            set_tensor_model_parallel_attributes(weight, True, dim, 1)
            weight.allreduce = config.expert_model_parallel_size == 1  # as GroupedMLP and SequentialMLP's linears
        if config.perform_initialization:
            with torch.no_grad():
                for _, view in self.per_expert():
                    (config.init_method if view.partition_dim == 0 else config.output_layer_init_method)(view)
        self.register_load_state_dict_post_hook(_ignore_extra_state)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """GroupedMLP's (SequentialMLP-compatible keys and global shapes) for the weights, which reads every entry
        of the module's state dict as weight1 or weight2: adapters are kept out of it and added after."""
        adapters = {k: self._parameters.pop(k) for k in lora_experts.NAMES if k in self._parameters}
        try:
            state = GroupedMLP.sharded_state_dict(self, prefix, sharded_offsets, metadata)
        finally:
            self._parameters.update(adapters)
        state.update(lora_experts.sharded_state(self, prefix, sharded_offsets))
        return state

    def layouts(self) -> Iterator[Tuple[str, str, Tuple[int, int, int], int]]:
        """(parameter, SequentialMLP's linear weight it stands for, its [E, in, out] view, the partition dim of each
        expert's [out, in] weight) of the weights and of the adapters present."""
        h, e = self.config.hidden_size, self.num_local_experts
        yield "weight1", "linear_fc1.weight", (e, h, self.fc1), 0
        yield "weight2", "linear_fc2.weight", (e, self.ffn, h), 1
        yield from lora_experts.layouts(self)

    def per_expert(self, which: Optional[str] = None,
                   data: Optional[torch.Tensor] = None) -> Iterator[Tuple[str, torch.Tensor]]:
        """(SequentialMLP's name, view) of each local expert's fc1 and fc2 weight (and adapters), or only of
        ``which`` ("weight1", "lora_a1", ...), with the tensor-parallel attributes of the linear layer it stands for;
        views of ``data`` (a tensor shaped like that parameter, e.g. an FSDP parameter gathered whole) instead."""
        e = self.num_local_experts
        for name, layer, shape, dim in self.layouts():
            if which is not None and which != name:
                continue
            param = getattr(self, name)
            source = param if data is None else data
            stacked = source.view(shape).transpose(1, 2)  # [E, out, in]: each expert's nn.Linear weight
            grads = param.main_grad.view(shape).transpose(1, 2) if data is None and hasattr(param, "main_grad") \
                else None
            for i in range(e):
                view = stacked[i]
                view.tensor_model_parallel, view.partition_dim, view.partition_stride = True, dim, 1
                view.allreduce = getattr(param, "allreduce", True)
                if grads is not None:
                    view.main_grad = grads[i]
                yield f"local_experts.{i}.{layer}", view

    def forward(self, tokens: torch.Tensor, tokens_per_expert: torch.Tensor, probs: torch.Tensor):
        config = self.config
        if config.moe_apply_probs_on_input:
            tokens, probs = (probs.unsqueeze(-1) * tokens).to(tokens.dtype), torch.ones_like(probs)
        offs = torch.cumsum(tokens_per_expert, 0).to(torch.int32).to(tokens.device, non_blocking=True)
        empty = (tokens_per_expert == 0).to(tokens.device, non_blocking=True)  # once for both GEMMs' backward
        h, e, fuse = config.hidden_size, self.num_local_experts, self.gradient_accumulation_fusion
        hidden = _GroupedLinear.apply(tokens, self.weight1, offs, (e, h, self.fc1), fuse, empty)
        if self.lora_scale is not None and hasattr(self, "lora_a1"):
            hidden = hidden + lora_experts.fc1_delta(self, tokens, offs, empty)
        if config.bias_activation_fusion and config.gated_linear_unit and config.activation_func is F.silu:
            hidden = weighted_bias_swiglu_impl(hidden, None, probs.unsqueeze(-1))
        else:
            if config.gated_linear_unit:
                gate, up = torch.chunk(hidden, 2, dim=-1)
                hidden = config.activation_func(gate) * up
            else:
                hidden = config.activation_func(hidden)
            hidden = (hidden * probs.unsqueeze(-1)).to(tokens.dtype)
        out = _GroupedLinear.apply(hidden, self.weight2, offs, (e, self.ffn, h), fuse, empty)
        if self.lora_scale is not None and hasattr(self, "lora_a2"):
            out = out + lora_experts.fc2_delta(self, hidden, offs, empty)
        return out, None

    def backward_dw(self):
        """Nothing deferred: weight gradients are computed in the backward."""


def _ignore_extra_state(module, incompatible_keys) -> None:
    """SequentialMLP's linears carry ``_extra_state`` (TE compatibility); ``sharded_state_dict`` lists them so the
    two checkpoint alike, and loading must not call them unexpected."""
    for key in [k for k in incompatible_keys.unexpected_keys if "_extra_state" in k]:
        incompatible_keys.unexpected_keys.remove(key)
