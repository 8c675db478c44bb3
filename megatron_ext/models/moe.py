"""Mixture-of-Experts layers from megatron-core without TransformerEngine: ``MoELayer`` with our grouped experts
(``models/grouped_experts.py``: torch._grouped_mm where it runs) or ``SequentialMLP`` (megatron-core's
``GroupedMLP`` needs the grouped_gemm package, TE's grouped linear needs TE), a top-k router in fp32 that never
routes padding, Qwen2-MoE's gated shared expert; and the per-step router statistics every MoE run logs."""

from __future__ import annotations

import math
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.shared_experts import SharedExpertMLP
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_ext.errors import ConfigError
from megatron_ext.models import grouped_experts, moe_aux
from megatron_ext.models.moe_flags import MoESettings
from megatron_ext.models.qwen.shape import ModelShape


def mlp_spec(grouped: bool) -> ModuleSpec:
    """megatron-core's MoE layer with the local (non-TE) experts, grouped or sequential; the shared expert is built
    only when the config gives it a size."""
    linears = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    experts = ModuleSpec(module=grouped_experts.TorchGroupedMLP) if grouped else \
        ModuleSpec(module=SequentialMLP, submodules=linears)
    return ModuleSpec(module=MoELayer, submodules=MoESubmodules(
        experts=experts, shared_experts=ModuleSpec(module=SharedExpertMLP, submodules=linears)))


def use_grouped_gemm(shape: ModelShape, settings: MoESettings, etp: int, dtype: torch.dtype, on_gpu: bool) -> bool:
    """Grouped experts unless ``--no-moe-grouped-gemm``, or where torch._grouped_mm cannot run this shape, dtype
    and device: then ``--moe-grouped-gemm`` is refused and the default falls back to SequentialMLP, saying so."""
    if settings.grouped_gemm is False:
        return False
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    reason = grouped_experts.unsupported(shape.hidden_size, shape.moe.ffn_hidden_size // etp, dtype, device)
    if reason is None:
        return True
    if settings.grouped_gemm:
        raise ConfigError(f"--moe-grouped-gemm: {reason}; drop the flag to run the experts one by one")
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"MoE experts run one by one (SequentialMLP): {reason}", flush=True)
    return False


def config_kwargs(shape: ModelShape, settings: Optional[MoESettings], etp: int = 1,
                  dtype: torch.dtype = torch.float32, on_gpu: bool = False) -> dict:
    """The ``TransformerConfig`` fields of an MoE shape (empty for a dense one); ``moe_grouped_gemm`` says which
    experts the layer spec builds."""
    moe = shape.moe
    if moe is None:
        return {}
    settings = settings or MoESettings()
    return dict(
        num_moe_experts=moe.num_experts,
        moe_router_topk=moe.topk,
        moe_ffn_hidden_size=moe.ffn_hidden_size,
        moe_shared_expert_intermediate_size=moe.shared_expert_size,
        moe_shared_expert_gate=moe.shared_expert_size is not None,  # Qwen2-MoE: sigmoid(x . w) * shared(x)
        moe_router_pre_softmax=not moe.norm_topk_prob,  # softmax over all experts, top-k, no renormalisation
        moe_layer_freq=list(moe.pattern(shape.num_layers)),
        moe_router_dtype="fp32",
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=settings.aux_loss_coeff,
        moe_z_loss_coeff=settings.z_loss_coeff,
        moe_token_dispatcher_type=settings.dispatcher or "alltoall",
        moe_expert_capacity_factor=settings.capacity_factor,
        moe_grouped_gemm=use_grouped_gemm(shape, settings, etp, dtype, on_gpu),
    )


_MOVE_TO_HOST = moe_utils.maybe_move_tensor_to_cpu


def _split_sizes_to_host(tensor, as_numpy: bool = False, record_stream: bool = False):
    """megatron-core's helper converts only CUDA tensors to numpy; the all-to-all split sizes must be host
    numbers on CPU ranks too."""
    out = _MOVE_TO_HOST(tensor, as_numpy=as_numpy, record_stream=record_stream)
    return out.numpy() if as_numpy and torch.is_tensor(out) else out


# megatron-core 0.16.1 scales the load-balancing and z-loss by the *local* token count under per-token loss
# normalisation, so with TP (SP) or CP > 1 their gradients shrink by tp x cp (Megatron-LM issue #1652, fixed by
# PR #5047): the moe_* layouts of tests/training/test_parity_megatron.py fail without this. Counted over the tp x cp
# group, as the fix does; with padding the ranks' valid counts differ, so the aux loss takes the group's valid
# count (the tokens its statistics cover), not local x group size.
_LOSS_SCALE_FIXES = (
    ("_apply_aux_loss",
     [("valid_token_count=local_num_tokens,",
       "valid_token_count=total_num_tokens / self.tp_cp_group.size(),")]),
    ("attach_and_log_load_balancing_loss",
     [("num_tokens = valid_token_count if valid_token_count is not None else activation.shape[0]",
       "num_tokens = (valid_token_count if valid_token_count is not None else activation.shape[0]) "
       "* self.tp_cp_group.size()")]),
    ("apply_z_loss",
     [("num_tokens = (~padding_mask).sum() if padding_mask is not None else logits.shape[0]",
       "num_tokens = ((~padding_mask).sum() if padding_mask is not None else logits.shape[0]) "
       "* self.tp_cp_group.size()")]),
)
# megatron-core 0.16.1 keeps padding (padding_mask: True = padding) out of the aux and z-loss but still routes it:
# it takes expert capacity and compute and shows in the load. Its probabilities and routes are dropped here.
_NEVER_ROUTE_PADDING = (
    "routing",
    [("# Apply token dropping to probs and routing_map.",
      "if padding_mask is not None:  # megatron_ext: padding is never routed\n"
      "        probs = probs * ~padding_mask.unsqueeze(-1)\n"
      "        routing_map = routing_map & ~padding_mask.unsqueeze(-1)\n"
      "    # Apply token dropping to probs and routing_map.")])
_SORT_CHUNKS = moe_utils.sort_chunks_by_idxs


def _sort_chunks(input, split_sizes, sorted_idxs, probs=None, fused=False):
    """megatron-core sorts the all-to-all's chunks by local expert, forward and back, even where they are in that
    order already (one expert-parallel and expert-TP rank): a host read of the sizes, a split into every expert's
    chunk and a copy of every routed token and its probability. There the same tensors are returned."""
    if sorted_idxs.device.type == "cpu" and sorted_idxs.equal(torch.arange(sorted_idxs.numel())):
        return input, probs
    return _SORT_CHUNKS(input, split_sizes, sorted_idxs, probs=probs, fused=fused)


_installed = False


def install() -> None:
    """Make megatron-core 0.16.1's MoE code right and runnable without TransformerEngine (idempotent):
    ``moe_utils`` uses ``te_general_gemm`` unconditionally though it is only imported with TE (fixed upstream in
    core 0.17); the router's loss scale fix, padding that is never routed and no identity chunk sort, above."""
    global _installed
    if _installed:
        return
    from megatron.core.transformer.moe import token_dispatcher

    from megatron_ext.platform.patching import replace_in_source

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    token_dispatcher.maybe_move_tensor_to_cpu = _split_sizes_to_host
    token_dispatcher.sort_chunks_by_idxs = _sort_chunks
    for method, replacements in (*_LOSS_SCALE_FIXES, _NEVER_ROUTE_PADDING):
        replace_in_source(TopKRouter, method, replacements)
    moe_aux.install()
    _installed = True


def stage_padding_mask(padding_mask: torch.Tensor, chunk) -> torch.Tensor:
    """[b, s] (True = padding) as this pipeline stage's MoE layers take it: megatron-core's GPTModel cuts it for
    sequence parallelism on the first stage only, so later stages get it cut here."""
    if chunk.pre_process or not chunk.config.sequence_parallel:
        return padding_mask
    from megatron.core.tensor_parallel import scatter_to_sequence_parallel_region

    return scatter_to_sequence_parallel_region(padding_mask.transpose(0, 1).contiguous()).transpose(0, 1).contiguous()


class RouterStats:
    """Per-step router statistics: load-balancing and z-loss (megatron-core's tracker), tokens per expert and
    dropped tokens. Counts accumulate on the device in forward hooks; ``__call__`` (every rank, once per step)
    reduces everything with one all-reduce and reads it back once."""

    def __init__(self, chunks: List[torch.nn.Module], num_layers: int, num_microbatches: int):
        self.routers = [m for chunk in chunks for m in chunk.modules() if isinstance(m, TopKRouter)]
        self.num_layers, self.num_microbatches = num_layers, num_microbatches
        config = chunks[0].config
        self.num_experts, self.topk = config.num_moe_experts, config.moe_router_topk
        self.moe_layers = moe_aux.moe_layer_count(config)
        self.capacity = config.moe_expert_capacity_factor is not None
        # Qwen's loss is one over every layer (each layer logs its share): summed over layers, not averaged
        self.model_scope = moe_aux.model_scope(config)
        device = next(chunks[0].parameters()).device
        # Rows: one per layer (1-based layer_number - 1); columns: tokens per expert, then tokens routed.
        self.counts = torch.zeros(num_layers, self.num_experts + 1, device=device, dtype=torch.float64)
        for router in self.routers:
            router.register_forward_hook(self._count)
        moe_utils.clear_aux_losses_tracker()  # megatron-core's tracker is global: nothing from before counts

    def _count(self, router, inputs, output) -> None:
        if not torch.is_grad_enabled():  # evaluation, or the no-grad first pass of activation recomputation
            return
        routing_map, padding = output[1], inputs[1] if len(inputs) > 1 else None  # router(hidden, padding_mask)
        row = self.counts[router.layer_number - 1]
        row[:-1] += routing_map.sum(dim=0)
        row[-1] += routing_map.shape[0] - (padding.sum() if padding is not None else 0)

    def __call__(self, num_microbatches: Optional[int] = None) -> Dict[str, float]:
        """The step's statistics; ``num_microbatches``: this rank's micro-batches in it (a batch-size ramp-up's),
        else the run's."""
        tracker = moe_utils.get_moe_layer_wise_logging_tracker()
        losses = [tracker[name]["values"].double() if name in tracker else self.counts.new_zeros(self.num_layers)
                  for name in ("load_balancing_loss", "z_loss")]
        totals = torch.cat([self.counts.reshape(-1), *losses])
        dist.all_reduce(totals)
        moe_utils.clear_aux_losses_tracker()
        self.counts.zero_()
        values = totals.tolist()
        return self.summarise(values, num_microbatches)

    def summarise(self, values: List[float], num_microbatches: Optional[int] = None) -> Dict[str, float]:
        num_microbatches = num_microbatches or self.num_microbatches
        width = self.num_experts + 1
        rows = [values[i * width:(i + 1) * width] for i in range(self.num_layers)]
        aux, z = values[len(rows) * width:][:self.num_layers], values[len(rows) * width + self.num_layers:]
        rows = [r for r in rows if r[-1] > 0]
        if not rows:
            return {}
        # Every token of a micro-batch is routed once per MoE layer on one rank per tensor/context slice; the
        # data-parallel replicas route different tokens; megatron-core logs the load-balancing loss summed over
        # the tp x cp slices and averaged over DP, the z-loss per rank.
        from megatron.core import parallel_state

        dp = parallel_state.get_data_parallel_world_size()
        holders = dist.get_world_size() // parallel_state.get_pipeline_model_parallel_world_size()
        scale = 1.0 / (num_microbatches * len(rows))  # a mean over micro-batches and MoE layers
        aux_scale = 1.0 / num_microbatches if self.model_scope else scale
        loads = []  # per layer: tokens per expert over the balanced share
        for r in rows:
            ideal = sum(r[:-1]) / self.num_experts
            loads.append([c / ideal if ideal else 0.0 for c in r[:-1]])
        flat = [x for layer in loads for x in layer]
        cv = [math.sqrt(sum((x - 1.0) ** 2 for x in layer) / len(layer)) for layer in loads]
        stats = {"moe_aux_loss": sum(aux) / dp * aux_scale, "moe_load_min": min(flat), "moe_load_max": max(flat),
                 "moe_load_cv": sum(cv) / len(cv)}
        if any(z):
            stats["moe_z_loss"] = sum(z) / holders * scale
        if self.capacity:
            routed = sum(sum(r[:-1]) for r in rows)
            stats["moe_dropped"] = 1.0 - routed / (self.topk * sum(r[-1] for r in rows))
        return stats
