"""Layer specs for megatron-core's ``TransformerBlock``: our SDPA attention and torch norms, or TE's when asked.

The local spec is megatron-core's own local GPT spec with two parts swapped: core attention (``SDPAttention``) and
the norm (``TorchNorm``, which, unlike megatron-core's ``WrappedTorchNorm``, supports sequence parallelism).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_layer import (TransformerLayer, TransformerLayerSubmodules,
                                                         get_transformer_layer_offset)

from megatron_ext.models import moe, rope
from megatron_ext.models.attention import SDPAttention
from megatron_ext.models.moe import mlp_spec as moe_mlp_spec


def params_dtype(run) -> torch.dtype:
    """The dtype parameters are built in: fp32 under --engine fsdp, whose master weights FSDP casts for compute."""
    return run.training.params_dtype(run.engine.engine)


def config_kwargs(shape, mesh, params_dtype: torch.dtype, recompute: "Recompute", initialize: bool,
                  on_gpu: bool) -> dict:
    """The ``TransformerConfig`` fields every family shares: its sizes, the mesh, the dtype, no dropout, per-token loss
    (``calculate_per_token_loss``), the fusions torch runs without TE/apex off; the rest is each family's."""
    return dict(num_layers=shape.num_layers, hidden_size=shape.hidden_size, ffn_hidden_size=shape.ffn_hidden_size,
                num_attention_heads=shape.num_attention_heads, num_query_groups=shape.num_query_groups,
                kv_channels=shape.kv_channels, hidden_dropout=0.0, attention_dropout=0.0, **mesh.megatron_sizes(),
                sequence_parallel=mesh.sequence_parallel, params_dtype=params_dtype,
                bf16=params_dtype == torch.bfloat16, fp16=params_dtype == torch.float16, pipeline_dtype=params_dtype,
                use_cpu_initialization=not on_gpu, apply_rope_fusion=False, masked_softmax_fusion=False,
                gradient_accumulation_fusion=False, persist_layer_norm=False, calculate_per_token_loss=True,
                perform_initialization=initialize, **recompute.config_fields())


@dataclasses.dataclass(frozen=True)
class Recompute:
    """Activation recomputation, Megatron-LM's flags: ``granularity`` None, "selective" (core attention recomputed in
    backward) or "full"; with "full", ``method`` "uniform" keeps only the input of every group of ``num_layers``
    layers and recomputes the group (DeepSpeed's activation-checkpoint interval), "block" recomputes the first
    ``num_layers`` layers of each pipeline chunk and keeps the others' activations: memory left over buys speed."""

    granularity: Optional[str] = None
    method: str = "uniform"
    num_layers: int = 1

    @classmethod
    def of(cls, training) -> "Recompute":
        """From the run's Training section (config/training.py)."""
        return cls(training.recompute_granularity, training.recompute_method or "uniform",
                   training.recompute_num_layers)

    def config_fields(self) -> dict:
        """The three ``TransformerConfig`` fields."""
        full = self.granularity == "full"
        return dict(recompute_granularity=self.granularity, recompute_method=self.method if full else None,
                    recompute_num_layers=self.num_layers if full else None)


class TorchNorm(torch.nn.Module):
    """LayerNorm or RMSNorm (``config.normalization``) from torch, with sequence-parallel weights tagged.

    With sequence parallelism each TP rank normalises a different slice of the sequence, so the weight gradients
    are partial sums: the ``sequence_parallel`` tag makes megatron-core all-reduce them over TP.
    """

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **unused):
        if config.normalization == "RMSNorm":
            norm = torch.nn.RMSNorm(hidden_size, eps=eps, dtype=config.params_dtype)
        elif config.normalization == "LayerNorm":
            norm = torch.nn.LayerNorm(hidden_size, eps=eps, dtype=config.params_dtype)
        else:
            raise ValueError(f"TorchNorm: unsupported normalization {config.normalization!r}")
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm


class QKNorm(torch.nn.Module):
    """Qwen3's RMSNorm over each head's query or key. TP splits the heads, so each rank's weight gradient is a partial
    sum: ``tp_partial_grad`` says so to the engines without megatron-core's name rule (``models/sharding.py``)."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **unused):
        norm = TorchNorm(config, hidden_size, eps)
        for param in norm.parameters():
            param.tp_partial_grad = True
        return norm


def local_layer_spec(attn_mask_type: AttnMaskType = AttnMaskType.causal, moe: bool = False,
                     grouped_experts: bool = False, qk_norm: bool = False) -> ModuleSpec:
    """Pre-norm layer: causal for language models, ``AttnMaskType.no_mask`` for vision encoders; ``moe``: the MLP
    is megatron-core's MoE layer (``models/moe.py``), with ``grouped_experts`` or SequentialMLP; ``qk_norm``: each
    head's query and key normalised (Qwen3; megatron-core all-reduces their gradients over TP by name)."""
    # Checkpoint keys as TE's fused layernorm-linear names them, so checkpoints move between the specs; an MoE
    # layer's norm is a module of its own in TE's spec too (``pre_mlp_layernorm``), so its key stays.
    keys_map = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_"}
    if not moe:
        keys_map["pre_mlp_layernorm."] = "mlp.linear_fc1.layer_norm_"
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=TorchNorm,
            self_attention=ModuleSpec(
                module=SelfAttention,
                params={"attn_mask_type": attn_mask_type},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=ColumnParallelLinear, core_attention=SDPAttention, linear_proj=RowParallelLinear,
                    q_layernorm=QKNorm if qk_norm else IdentityOp, k_layernorm=QKNorm if qk_norm else IdentityOp),
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=TorchNorm,
            mlp=moe_mlp_spec(grouped_experts) if moe else ModuleSpec(
                module=MLP, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)),
            mlp_bda=get_bias_dropout_add,
            sharded_state_dict_keys_map=keys_map,
        ),
    )


def decoder_block_spec(config, transformer_impl: str = "local", vp_stage=None) -> TransformerBlockSubmodules:
    """The block spec for this pipeline rank (and virtual stage)."""
    rope.install()
    if transformer_impl == "transformer_engine":
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        return get_gpt_decoder_block_spec(config, use_transformer_engine=True, vp_stage=vp_stage)
    num_layers = get_num_layers_to_build(config, vp_stage=vp_stage)
    qk_norm = config.qk_layernorm
    if not config.num_moe_experts:
        return TransformerBlockSubmodules(layer_specs=[local_layer_spec(qk_norm=qk_norm)] * num_layers,
                                          layer_norm=TorchNorm)
    moe.install()
    # This stage's slice of the explicit 0/1 MoE pattern, as megatron-core's get_gpt_decoder_block_spec slices it.
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    pattern = config.moe_layer_freq[offset:offset + num_layers]
    specs = [local_layer_spec(moe=bool(p), grouped_experts=config.moe_grouped_gemm, qk_norm=qk_norm) for p in pattern]
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=TorchNorm)


def compile_layers(chunks, backend: str = "inductor") -> int:
    """``--compile-layers``: ``torch.compile`` each dense ``TransformerLayer`` in place (torchtitan's per-block
    compile; ``nn.Module.compile`` leaves parameter names, so checkpoints, unchanged). MoE layers stay eager: their
    routing has data-dependent shapes. Returns how many layers it compiled."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    ignored = getattr(torch._dynamo.config, "ignore_logging_functions", None)
    if ignored is not None:  # megatron-core's tp_group deprecation warning would break every layer's graph twice
        import warnings

        ignored.add(warnings.warn)
    layers = [m for c in chunks for m in c.modules() if isinstance(m, TransformerLayer) and not isinstance(
        getattr(m, "mlp", None), MoELayer)]
    for layer in layers:
        layer.compile(backend=backend)
    return len(layers)
