"""GPT-2 on megatron-core ``GPTModel``: LayerNorm, the tanh-approximated GELU, learned absolute positions, biases
everywhere, output layer tied to the embedding, vocabulary padded for TP; our local spec (SDPA attention, torch
norms), so TP, SP, PP and VPP come from megatron-core without TransformerEngine."""

from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer import TransformerConfig

from megatron_ext.mesh import Mesh
from megatron_ext.models.linear_cross_entropy import fuse_output_layer_and_loss
from megatron_ext.models.qwen.model import mask_padded_vocab
from megatron_ext.models.gpt2.shape import GPT2Shape
from megatron_ext.models.spec import Recompute, config_kwargs, decoder_block_spec

# GPT-2's "gelu_new". megatron-core fuses only F.gelu itself (its fused kernel is this tanh form, but F.gelu
# unfused is the erf one), so the bias-GELU fusion stays off and both devices compute the same function.
gelu_tanh = functools.partial(F.gelu, approximate="tanh")


def transformer_config(shape: GPT2Shape, mesh: Mesh, *, params_dtype: torch.dtype = torch.float32,
                       on_gpu: bool = False, recompute: Recompute = Recompute(),
                       initialize: bool = True, cross_entropy_fusion: bool = False) -> TransformerConfig:
    """megatron-core's config of a GPT-2 under ``mesh``; ``recompute``: as ``models/spec.Recompute``."""
    return TransformerConfig(
        normalization="LayerNorm", layernorm_epsilon=shape.layer_norm_eps, gated_linear_unit=False,
        activation_func=gelu_tanh, add_bias_linear=True, add_qkv_bias=True, bias_activation_fusion=False,
        bias_dropout_fusion=on_gpu, cross_entropy_loss_fusion=cross_entropy_fusion, cross_entropy_fusion_impl="native",
        **config_kwargs(shape, mesh, params_dtype, recompute, initialize, on_gpu))


def build_gpt2(config: TransformerConfig, shape: GPT2Shape, *, vocab_size: int, pre_process: bool = True,
               post_process: bool = True, vp_stage: Optional[int] = None) -> GPTModel:
    """One pipeline chunk of a GPT-2 (the whole model when PP=1); ``vocab_size`` padded."""
    model = GPTModel(config=config, transformer_layer_spec=decoder_block_spec(config, "local", vp_stage=vp_stage),
                     vocab_size=vocab_size, max_sequence_length=shape.max_position_embeddings,
                     pre_process=pre_process, post_process=post_process, share_embeddings_and_output_weights=True,
                     position_embedding_type="learned_absolute", vp_stage=vp_stage)
    return fuse_output_layer_and_loss(mask_padded_vocab(model, shape.vocab_size), shape.vocab_size)
