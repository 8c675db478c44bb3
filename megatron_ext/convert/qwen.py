"""Hugging Face Qwen2 <-> megatron-core names and layouts, as one table plus the two fused transforms.

Only the in-memory mapping lives here (it is what proves the spec against ``transformers``); streaming shards and
megatron-core distributed checkpoints build on it in tools/.
"""

from __future__ import annotations

from typing import Dict

import torch

from megatron_ext.models.shapes import ModelShape

# megatron-core name (per layer where it starts with "layer.") -> Hugging Face name; fused entries are below.
LAYER = "decoder.layers.{i}."
HF_LAYER = "model.layers.{i}."
DIRECT = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",  # untied models only
    LAYER + "input_layernorm.weight": HF_LAYER + "input_layernorm.weight",
    LAYER + "self_attention.linear_proj.weight": HF_LAYER + "self_attn.o_proj.weight",
    LAYER + "pre_mlp_layernorm.weight": HF_LAYER + "post_attention_layernorm.weight",
    LAYER + "mlp.linear_fc2.weight": HF_LAYER + "mlp.down_proj.weight",
}


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shape: ModelShape) -> torch.Tensor:
    """megatron-core's fused QKV: for each KV group, its query heads, then its key, then its value."""
    groups, d = shape.num_query_groups, shape.kv_channels
    per_group = shape.num_attention_heads // groups
    rest = q.shape[1:]
    return torch.cat([q.reshape(groups, per_group * d, *rest), k.reshape(groups, d, *rest),
                      v.reshape(groups, d, *rest)], dim=1).reshape(-1, *rest)


def hf_to_mcore(hf: Dict[str, torch.Tensor], shape: ModelShape, padded_vocab: int) -> Dict[str, torch.Tensor]:
    """A full (TP=PP=1) megatron-core state dict from a Hugging Face Qwen2 one; vocabulary rows padded with zeros."""
    out = {}
    for i in range(shape.num_layers):
        for mcore, name in DIRECT.items():
            if mcore.startswith(LAYER):
                out[mcore.format(i=i)] = hf[name.format(i=i)]
        attn, mlp = HF_LAYER.format(i=i) + "self_attn.", HF_LAYER.format(i=i) + "mlp."
        for kind in ("weight", "bias"):
            out[LAYER.format(i=i) + f"self_attention.linear_qkv.{kind}"] = fuse_qkv(
                hf[attn + f"q_proj.{kind}"], hf[attn + f"k_proj.{kind}"], hf[attn + f"v_proj.{kind}"], shape)
        out[LAYER.format(i=i) + "mlp.linear_fc1.weight"] = torch.cat([hf[mlp + "gate_proj.weight"],
                                                                     hf[mlp + "up_proj.weight"]])
    out["decoder.final_layernorm.weight"] = hf["model.norm.weight"]
    vocab_names = ["embedding.word_embeddings.weight"] + ([] if shape.tie_word_embeddings else ["output_layer.weight"])
    for mcore in vocab_names:
        weight = hf[DIRECT[mcore]]
        out[mcore] = torch.cat([weight, weight.new_zeros(padded_vocab - weight.shape[0], weight.shape[1])])
    return out
