"""Hugging Face Qwen2/2.5 <-> megatron-core: the name table and its three special cases.

Fused QKV is laid out per KV group ([q heads of the group, k, v] for each group); SwiGLU's gate and up are fused
into ``linear_fc1`` ([gate; up]); vocabulary rows are padded for TP on import and removed on export. Tied models
have no ``lm_head.weight`` in HF and no ``output_layer.weight`` in megatron-core.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Tuple

import torch

from megatron_ext.convert.common import Rule, concrete_rules, with_dtype
from megatron_ext.models.shapes import ModelShape


@dataclasses.dataclass(frozen=True)
class Context:
    shape: ModelShape
    padded_vocab: int


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shape: ModelShape) -> torch.Tensor:
    """megatron-core's fused QKV: for each KV group, its query heads, then its key, then its value."""
    groups, d = shape.num_query_groups, shape.kv_channels
    per_group = shape.num_attention_heads // groups
    rest = q.shape[1:]
    return torch.cat([q.reshape(groups, per_group * d, *rest), k.reshape(groups, d, *rest),
                      v.reshape(groups, d, *rest)], dim=1).reshape(-1, *rest)


def split_qkv(qkv: torch.Tensor, shape: ModelShape) -> List[torch.Tensor]:
    groups, d = shape.num_query_groups, shape.kv_channels
    per_group = shape.num_attention_heads // groups
    rest = qkv.shape[1:]
    q, k, v = qkv.reshape(groups, (per_group + 2) * d, *rest).split([per_group * d, d, d], dim=1)
    return [t.reshape(-1, *rest) for t in (q, k, v)]


def _pad_vocab(tensors, ctx: Context) -> torch.Tensor:
    weight = tensors[0]
    return torch.cat([weight, weight.new_zeros(ctx.padded_vocab - weight.shape[0], *weight.shape[1:])])


def _unpad_vocab(weight, ctx: Context) -> List[torch.Tensor]:
    return [weight[:ctx.shape.vocab_size]]


def _qkv(names: str) -> Rule:
    kind = names.rsplit(".", 1)[1]
    return Rule(f"decoder.layers.{{i}}.self_attention.linear_qkv.{kind}",
                tuple(f"model.layers.{{i}}.self_attn.{p}_proj.{kind}" for p in "qkv"),
                fuse=lambda t, ctx: fuse_qkv(*t, ctx.shape), split=lambda t, ctx: split_qkv(t, ctx.shape))


RULES = [
    Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), _pad_vocab, _unpad_vocab),
    Rule("decoder.final_layernorm.weight", ("model.norm.weight",)),
    Rule("decoder.layers.{i}.input_layernorm.weight", ("model.layers.{i}.input_layernorm.weight",)),
    _qkv("qkv.weight"),
    _qkv("qkv.bias"),
    Rule("decoder.layers.{i}.self_attention.linear_proj.weight", ("model.layers.{i}.self_attn.o_proj.weight",)),
    Rule("decoder.layers.{i}.pre_mlp_layernorm.weight", ("model.layers.{i}.post_attention_layernorm.weight",)),
    Rule("decoder.layers.{i}.mlp.linear_fc1.weight",
         ("model.layers.{i}.mlp.gate_proj.weight", "model.layers.{i}.mlp.up_proj.weight"),
         fuse=lambda t, ctx: torch.cat(t), split=lambda t, ctx: t.chunk(2)),
    Rule("decoder.layers.{i}.mlp.linear_fc2.weight", ("model.layers.{i}.mlp.down_proj.weight",)),
]
UNTIED_OUTPUT = Rule("output_layer.weight", ("lm_head.weight",), _pad_vocab, _unpad_vocab)
VOCAB_DIVISIBLE_BY = 128  # finetune_qwen.py's --make-vocab-size-divisible-by default


def rules(shape: ModelShape, record: Optional[dict] = None) -> List[Rule]:
    return concrete_rules(RULES + ([] if shape.tie_word_embeddings else [UNTIED_OUTPUT]), shape.num_layers)


def source(shape: ModelShape, names, get) -> Tuple[List[Rule], dict]:
    """The rules naming a Hugging Face checkpoint's tensors, and what to record beside the shape (nothing)."""
    return rules(shape), {}


def context(shape: ModelShape) -> Context:
    from megatron_ext.models.qwen import padded_vocab_size

    return Context(shape, padded_vocab_size(shape.vocab_size, VOCAB_DIVISIBLE_BY, 1))


def ignorable(name: str, shape: ModelShape) -> bool:
    """HF tensors with no place in the model: some tied exports repeat ``lm_head.weight``; old ones keep RoPE's."""
    return (name == "lm_head.weight" and shape.tie_word_embeddings) or name.endswith("rotary_emb.inv_freq")


def hf_to_mcore(hf: Dict[str, torch.Tensor], shape: ModelShape) -> Dict[str, torch.Tensor]:
    """A full (TP=PP=1) megatron-core state dict from an in-memory Hugging Face one (tools/ stream instead)."""
    ctx = context(shape)
    return {rule.mcore: rule.to_mcore([hf[name] for name in rule.hf], ctx) for rule in rules(shape)}


def hf_config(shape: ModelShape, record: dict, dtype: torch.dtype) -> dict:
    """config.json for the exported model: the original HF config when the checkpoint records one (every value
    kept), else one built from the shape; the dtype is the exported one."""
    original = record.get("hf_config")
    if original is None:
        from transformers import Qwen2Config

        original = Qwen2Config(
            vocab_size=shape.vocab_size, hidden_size=shape.hidden_size, intermediate_size=shape.ffn_hidden_size,
            num_hidden_layers=shape.num_layers, num_attention_heads=shape.num_attention_heads,
            num_key_value_heads=shape.num_query_groups, max_position_embeddings=shape.max_position_embeddings,
            rope_theta=shape.rope_theta, rms_norm_eps=shape.rms_norm_eps,
            tie_word_embeddings=shape.tie_word_embeddings).to_dict()
    return with_dtype(original, dtype)
