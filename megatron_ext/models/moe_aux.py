"""The load-balancing loss of Qwen2-MoE and Qwen3-MoE as transformers defines it (``load_balancing_loss_func``):
one loss over every MoE layer's routing together (``--moe-aux-loss-scope model``),

    aux = E * sum_e F_e * P_e,   F_e = C_e / (L T),   P_e = (sum over layers and tokens of p(e)) / (L T),

C_e the top-k assignments to expert e over all L MoE layers and the T valid tokens of the micro-batch, p the softmax
over all experts. megatron-core's loss (``layer``, the default) is E/k * sum_e f_e p_e of each layer, summed over
layers: a factor k apart, and without the cross-layer terms.

Its gradient for layer l's probability sums is coeff * E * C_e / (L T)^2: it needs every layer's counts, which exist
only once the micro-batch's forward is over. So each MoE layer records its counts when its router runs (also in the
no-grad first pass of full recomputation), and attaches its probability sums with an autograd function whose
backward reads the completed record. Micro-batches run one at a time without pipeline parallelism, which is what
this needs (``moe_flags`` refuses PP > 1 and capacity dropping). Sequence and context slices count globally over
the tp x cp group and scale as megatron-core's own loss does (``models/moe.py``), so every layout is one process's.
"""

from __future__ import annotations

from typing import Dict

import torch
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe.router import TopKRouter

SCOPE_ATTR = "moe_aux_loss_scope"  # set on megatron-core's TransformerConfig by models/qwen/model.py


def model_scope(config) -> bool:
    """Whether a model of ``config`` trains with this loss (``--moe-aux-loss-scope model``)."""
    return getattr(config, SCOPE_ATTR, "layer") == "model"


def moe_layer_count(config) -> int:
    """How many layers are MoE layers (megatron-core's ``moe_layer_freq``: an explicit 0/1 list, or every layer)."""
    return sum(config.moe_layer_freq) if isinstance(config.moe_layer_freq, list) else config.num_layers


class _Record:
    """One micro-batch's routing: global counts [E] by layer number, the global valid-token count, and the tokens
    in its loss (``set_loss_tokens``)."""

    def __init__(self):
        self.counts: Dict[int, torch.Tensor] = {}
        self.tokens = self.loss_tokens = None


_RECORDS: Dict[int, _Record] = {}  # by id(config): one model per config


def _record(router: TopKRouter) -> _Record:
    return _RECORDS.setdefault(id(router.config), _Record())


def _count(router: TopKRouter, inputs, output) -> None:
    """Forward hook (model-scope routers only): this layer's assignments over the tp x cp group (padding is never
    routed)."""
    if not (router.training and router.get_aux_loss_coeff("aux_loss")):
        return
    counts, _, total = moe_utils.get_tokens_per_expert_and_token_count(
        routing_map=output[1], reduce_group=router.tp_cp_group, topk=router.topk, with_padding_mask=True)
    record = _record(router)
    record.counts[router.layer_number] = counts.detach().float()
    record.tokens = total


class _Attach(torch.autograd.Function):
    """Identity on the router's probabilities; in backward, the gradient of ``coeff * aux`` for this layer's
    probability sums, once every layer's counts are known."""

    @staticmethod
    def forward(ctx, probs, prob_sums, router):
        ctx.router = router
        ctx.save_for_backward(prob_sums.detach())
        return probs

    @staticmethod
    def backward(ctx, grad_probs):
        router, record, (prob_sums,) = ctx.router, _record(ctx.router), ctx.saved_tensors
        config = router.config
        layers = moe_layer_count(config)
        experts, coeff = config.num_moe_experts, router.get_aux_loss_coeff("aux_loss")
        counts = torch.stack(list(record.counts.values())).sum(0)
        d_aux = experts * counts / (layers * record.tokens) ** 2  # d aux / d (this layer's probability sums)
        # This layer's share of the loss (the shares add up to it over layers and the tp x cp slices), logged
        # where megatron-core logs its per-layer loss.
        moe_utils.save_to_aux_losses_tracker("load_balancing_loss", (d_aux * prob_sums).sum(), router.layer_number,
                                             config.num_layers, reduce_group=router.tp_cp_group)
        scale = moe_utils.MoEAuxLossAutoScaler.main_loss_backward_scale
        scale = 1.0 if scale is None else scale
        # The engine divides every gradient by the tokens in the loss (per-token loss): weighted by the micro-batch's
        # own, the loss of a micro-batch is transformers' mean token loss + coeff * aux.
        return grad_probs, (coeff * d_aux * record.loss_tokens * scale).to(prob_sums.dtype), None


def set_loss_tokens(model: torch.nn.Module, loss_mask: torch.Tensor) -> None:
    """Called by the engine's forward step with the micro-batch's loss mask (this context-parallel slice of it)."""
    config = model.config
    if not model_scope(config):
        return
    from megatron.core import parallel_state

    tokens = loss_mask.sum().float()
    if parallel_state.get_context_parallel_world_size() > 1:
        torch.distributed.all_reduce(tokens, group=parallel_state.get_context_parallel_group())
    _RECORDS.setdefault(id(config), _Record()).loss_tokens = tokens


def apply(router: TopKRouter, probs: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """``TopKRouter._apply_aux_loss`` for the model scope: ``scores`` are the softmax over all experts with padding
    rows zeroed (megatron-core's ``compute_routing_scores_for_aux_loss``)."""
    return _Attach.apply(probs, scores.float().sum(0), router)


_installed = False


def install() -> None:
    """Route ``TopKRouter._apply_aux_loss`` to ``apply`` for model-scope configs (after models/moe.py's fixes)."""
    global _installed
    if _installed:
        return
    layer_scope = TopKRouter._apply_aux_loss

    def apply_aux_loss(self, probs, scores_for_aux_loss, routing_map, with_padding_mask: bool = False):
        if not model_scope(self.config) or not self.get_aux_loss_coeff("aux_loss"):
            return layer_scope(self, probs, scores_for_aux_loss, routing_map, with_padding_mask)
        return apply(self, probs, scores_for_aux_loss)

    TopKRouter._apply_aux_loss = apply_aux_loss
    _installed = True


def hook(router: TopKRouter) -> None:
    router.register_forward_hook(_count)
