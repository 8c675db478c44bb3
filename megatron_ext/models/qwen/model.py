"""Qwen2/2.5 and Qwen3 on megatron-core ``GPTModel``: RMSNorm, SwiGLU, RoPE, GQA, tied or untied output; bias on
QKV only (Qwen2) or RMSNorm on each head's query and key (Qwen3, megatron-core's ``qk_layernorm``); Qwen2-MoE and
Qwen3-MoE when the shape has experts (``models/moe.py``)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.moe.router import TopKRouter

from megatron_ext.mesh import Mesh
from megatron_ext.models import moe, moe_aux, reward
from megatron_ext.models.linear_cross_entropy import fuse_output_layer_and_loss
from megatron_ext.models.moe_flags import MoESettings
from megatron_ext.models.qwen.shape import ModelShape
from megatron_ext.models.spec import Recompute, config_kwargs, decoder_block_spec


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Vocabulary rows padded to a multiple of ``divisible_by``, so TP shards are equal. Unlike Megatron-LM
    (``divisible_by * tp``) the size does not change with TP when ``tp`` divides ``divisible_by`` (any power of
    two up to 128 by default): one checkpoint then loads under every mesh. Other TP sizes fall back to
    ``divisible_by * tp``."""
    def round_up(multiple: int) -> int:
        return -(-vocab_size // multiple) * multiple

    padded = round_up(divisible_by)
    return padded if padded % tp == 0 else round_up(divisible_by * tp)


def mask_padded_vocab(model: GPTModel, vocab_size: int) -> GPTModel:
    """The output layer's padding rows (the vocabulary padded for TP) give the lowest logit, so they never enter
    the softmax: a loaded model's loss is its source's under any TP size."""
    if not model.post_process or model.vocab_size <= vocab_size:
        return model

    def hook(module, inputs, output):
        from megatron.core import parallel_state

        logits, bias = output
        width = logits.shape[-1]
        start = parallel_state.get_tensor_model_parallel_rank() * width
        if start + width <= vocab_size:
            return output
        padding = torch.arange(start, start + width, device=logits.device) >= vocab_size
        return logits.masked_fill(padding, torch.finfo(logits.dtype).min), bias

    model.output_layer.register_forward_hook(hook)
    return model


def transformer_config(shape: ModelShape, mesh: Mesh, *, params_dtype: torch.dtype = torch.float32,
                       on_gpu: bool = False, recompute: Recompute = Recompute(),
                       initialize: bool = True, cross_entropy_fusion: bool = False,
                       moe_settings: Optional[MoESettings] = None) -> TransformerConfig:
    """The megatron-core config of a Qwen model under ``mesh``; ``recompute``: activation recomputation
    (``models/spec.Recompute``).
    ``initialize=False`` allocates without drawing weights (conversion overwrites every tensor).
    ``cross_entropy_fusion``: the output layer and the cross entropy in chunks of tokens (``build_qwen``,
    ``models/linear_cross_entropy.py``), never the whole logits.
    ``moe_settings``: the router's training settings for an MoE shape (defaults: no aux loss, alltoall)."""
    config = TransformerConfig(
        normalization="RMSNorm", layernorm_epsilon=shape.rms_norm_eps, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, add_qkv_bias=shape.qkv_bias, qk_layernorm=shape.qk_norm,
        # the fused bias kernels need CUDA (and go through torch.compile): off on CPU
        bias_activation_fusion=on_gpu, bias_dropout_fusion=on_gpu,
        cross_entropy_loss_fusion=cross_entropy_fusion, cross_entropy_fusion_impl="native",
        **config_kwargs(shape, mesh, params_dtype, recompute, initialize, on_gpu),
        **moe.config_kwargs(shape, moe_settings, mesh.etp, params_dtype, on_gpu))
    if moe_settings is not None:  # which load-balancing loss the routers attach (models/moe_aux.py)
        setattr(config, moe_aux.SCOPE_ATTR, moe_settings.aux_loss_scope)
    return config


def build_qwen(config: TransformerConfig, shape: ModelShape, *, vocab_size: int, pre_process: bool = True,
               post_process: bool = True, vp_stage: Optional[int] = None,
               transformer_impl: str = "local") -> GPTModel:
    """One pipeline chunk of a Qwen model (the whole model when PP=1); a reward model (``shape.head`` "score")
    has a score head instead of the output layer (``models/reward.py``)."""
    score = shape.head == "score"
    model = GPTModel(
        config=config,
        transformer_layer_spec=decoder_block_spec(config, transformer_impl, vp_stage=vp_stage),
        vocab_size=vocab_size,
        max_sequence_length=shape.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=shape.tie_word_embeddings and not score,
        position_embedding_type="rope",
        rotary_base=shape.rope_theta,
        vp_stage=vp_stage,
    )
    if score:
        reward.attach(model)
    else:
        mask_padded_vocab(model, shape.vocab_size)
        fuse_output_layer_and_loss(model, shape.vocab_size)
    if moe_aux.model_scope(config):
        for module in model.modules():
            if isinstance(module, TopKRouter):
                moe_aux.hook(module)
    return model
