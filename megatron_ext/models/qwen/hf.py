"""Hugging Face Qwen2/2.5, Qwen3 and their MoE models <-> megatron-core (``model.py``): the name table and its three special cases.

Fused QKV is laid out per KV group ([q heads of the group, k, v] for each group); SwiGLU's gate and up are fused
into ``linear_fc1`` ([gate; up]); vocabulary rows are padded for TP on import and removed on export. Tied models
have no ``lm_head.weight`` in HF and no ``output_layer.weight`` in megatron-core.

Qwen2-MoE (``Qwen2MoeForCausalLM``): MoE layers (the shape's layer pattern; HF ``decoder_sparse_step`` and
``mlp_only_layers``) take the router, per-expert and shared-expert rules, the others the dense MLP rules. Names are
the on-disk safetensors ones, one tensor per expert (``mlp.experts.{e}.gate_proj.weight``; transformers 5 fuses
them in memory only); the converted model is single-process, so local expert ``e`` is global expert ``e`` and
megatron-core's dist-checkpoint places it on its expert-parallel rank at load.

Qwen3 (``Qwen3ForCausalLM``, ``Qwen3MoeForCausalLM``) is the same table without the QKV bias and with each head's
query and key norms (``q_norm``, ``k_norm`` -> ``q_layernorm``, ``k_layernorm``); Qwen3-MoE has no shared expert.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, List, Optional, Tuple

from megatron_ext.errors import ConfigError
from megatron_ext.models.hf_rules import Rule, concrete_rules, with_dtype
from megatron_ext.models.qwen.shape import ModelShape, shape_from_hf_dict

if TYPE_CHECKING:  # torch-free at import: the flags read the family registry before torch loads
    import torch


@dataclasses.dataclass(frozen=True)
class Context:
    shape: ModelShape
    padded_vocab: int


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shape: ModelShape) -> torch.Tensor:
    """megatron-core's fused QKV: for each KV group, its query heads, then its key, then its value."""
    import torch

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
    import torch

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
    Rule("decoder.layers.{i}.self_attention.linear_proj.weight", ("model.layers.{i}.self_attn.o_proj.weight",)),
    Rule("decoder.layers.{i}.pre_mlp_layernorm.weight", ("model.layers.{i}.post_attention_layernorm.weight",)),
]
QKV_BIAS = [_qkv("qkv.bias")]
QK_NORM = [Rule(f"decoder.layers.{{i}}.self_attention.{x}_layernorm.weight",
                (f"model.layers.{{i}}.self_attn.{x}_norm.weight",)) for x in "qk"]


def _cat(tensors, ctx) -> torch.Tensor:
    import torch

    return torch.cat(tensors)


def _mlp(mcore: str, hf: str) -> List[Rule]:
    """A SwiGLU MLP: [gate; up] fused into ``linear_fc1``, ``down_proj`` as ``linear_fc2``."""
    return [Rule(f"{mcore}.linear_fc1.weight", (f"{hf}.gate_proj.weight", f"{hf}.up_proj.weight"),
                 fuse=_cat, split=lambda t, ctx: t.chunk(2)),
            Rule(f"{mcore}.linear_fc2.weight", (f"{hf}.down_proj.weight",))]


DENSE_MLP = _mlp("decoder.layers.{i}.mlp", "model.layers.{i}.mlp")
MOE_MLP = [Rule("decoder.layers.{i}.mlp.router.weight", ("model.layers.{i}.mlp.gate.weight",)),
           *_mlp("decoder.layers.{i}.mlp.experts.local_experts.{e}", "model.layers.{i}.mlp.experts.{e}")]
SHARED_EXPERT = [*_mlp("decoder.layers.{i}.mlp.shared_experts", "model.layers.{i}.mlp.shared_expert"),
                 Rule("decoder.layers.{i}.mlp.shared_experts.gate_weight",
                      ("model.layers.{i}.mlp.shared_expert_gate.weight",))]
UNTIED_OUTPUT = Rule("output_layer.weight", ("lm_head.weight",), _pad_vocab, _unpad_vocab)
SCORE = Rule("output_layer.weight", ("score.weight",))  # a reward model's head (models/reward.py)
VOCAB_DIVISIBLE_BY = 128  # finetune_qwen.py's --make-vocab-size-divisible-by default


def rules(shape: ModelShape, record: Optional[dict] = None) -> List[Rule]:
    """The table of a shape: every layer's attention and norms, then the dense MLPs, then the MoE layers'."""
    n = shape.num_layers
    pattern = shape.moe.pattern(n) if shape.moe else (0,) * n
    attention = RULES + (QKV_BIAS if shape.qkv_bias else []) + (QK_NORM if shape.qk_norm else [])
    head = [SCORE] if shape.head == "score" else [] if shape.tie_word_embeddings else [UNTIED_OUTPUT]
    table = concrete_rules(attention + head, n)
    table += concrete_rules(DENSE_MLP, n, layers=[i for i in range(n) if not pattern[i]])
    if shape.moe:
        moe_rules = MOE_MLP + (SHARED_EXPERT if shape.moe.shared_expert_size else [])
        table += concrete_rules(moe_rules, n, layers=[i for i in range(n) if pattern[i]],
                                num_experts=shape.moe.num_experts)
    return table


def source(shape: ModelShape, names, get) -> Tuple[List[Rule], dict]:
    """The rules naming a Hugging Face checkpoint's tensors, and what to record beside the shape (nothing). A reward
    model read from a language model (no ``score.weight``) starts its score head afresh."""
    table = rules(shape)
    if shape.head == "score" and "score.weight" not in set(names):
        table = [rule for rule in table if rule.hf != SCORE.hf]
    return table, {}


def context(shape: ModelShape) -> Context:
    from megatron_ext.models.qwen.model import padded_vocab_size

    return Context(shape, padded_vocab_size(shape.vocab_size, VOCAB_DIVISIBLE_BY, 1))


def ignorable(name: str, shape: ModelShape) -> bool:
    """HF tensors with no place in the model: some tied exports repeat ``lm_head.weight``; old ones keep RoPE's."""
    lm_head = shape.tie_word_embeddings or shape.head == "score"  # (a reward model from a language model)
    return (name == "lm_head.weight" and lm_head) or name.endswith("rotary_emb.inv_freq")


# transformers' config class and architecture of each family
HF_CLASSES = {"qwen2": ("Qwen2Config", "Qwen2ForCausalLM"), "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
              "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"), "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM")}


def config_fields(shape: ModelShape) -> dict:
    """The fields of the shape's transformers config (``Qwen2Config`` ... ``Qwen3MoeConfig``) that it determines."""
    fields = dict(vocab_size=shape.vocab_size, hidden_size=shape.hidden_size, intermediate_size=shape.ffn_hidden_size,
                  num_hidden_layers=shape.num_layers, num_attention_heads=shape.num_attention_heads,
                  num_key_value_heads=shape.num_query_groups, max_position_embeddings=shape.max_position_embeddings,
                  rope_theta=shape.rope_theta, rms_norm_eps=shape.rms_norm_eps,
                  tie_word_embeddings=shape.tie_word_embeddings)
    if shape.qk_norm:
        fields.update(head_dim=shape.kv_channels, attention_bias=False)
    return {**fields, **(moe_fields(shape) if shape.moe else {})}


def hf_config(shape: ModelShape, record: dict, dtype: torch.dtype) -> dict:
    """config.json for the exported model: the original HF config when the checkpoint records one of this shape's
    family and shape (every value kept); else the recorded one (a dense model made MoE by flags) or a fresh one, with
    the fields of the shape; the dtype is the exported one."""
    import transformers

    original, model_type = record.get("hf_config"), shape.model_type
    config_class, architecture = HF_CLASSES[model_type]
    fields = config_fields(shape)
    if shape.head == "score":  # a reward model: the family's sequence classifier of one label
        architecture = architecture.replace("ForCausalLM", "ForSequenceClassification")
        fields.update(id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
    if original is not None and original.get("model_type") == model_type and \
            shape_from_config(original) == shape_from_config({**original, **fields, "architectures": [architecture]}):
        return with_dtype(dict(original), dtype)
    if original is None:
        original = getattr(transformers, config_class)(**fields).to_dict()
    return with_dtype({**original, **fields, "model_type": model_type, "architectures": [architecture]}, dtype)


def shape_from_config(config: dict) -> ModelShape:
    return shape_from_hf_dict(config, "config.json", "the recorded config")


def moe_fields(shape: ModelShape) -> dict:
    """The MoE fields of a Qwen2-MoE or Qwen3-MoE config; the layer pattern as ``decoder_sparse_step=1`` plus
    ``mlp_only_layers`` (any pattern is expressible that way)."""
    moe = shape.moe
    fields = dict(num_experts=moe.num_experts, num_experts_per_tok=moe.topk, moe_intermediate_size=moe.ffn_hidden_size,
                  norm_topk_prob=moe.norm_topk_prob, decoder_sparse_step=1,
                  mlp_only_layers=[i for i, p in enumerate(moe.pattern(shape.num_layers)) if not p])
    if shape.qk_norm:
        if moe.shared_expert_size is not None:
            raise ConfigError("this Qwen3-MoE model has a shared expert, and transformers' Qwen3MoeForCausalLM has "
                              "none: there is no Hugging Face class to export it to")
        return fields
    if moe.shared_expert_size is None:
        raise ConfigError("this MoE model has no shared expert, and transformers' Qwen2MoeForCausalLM always has "
                          "one: there is no Hugging Face class to export it to")
    return {**fields, "shared_expert_intermediate_size": moe.shared_expert_size}
