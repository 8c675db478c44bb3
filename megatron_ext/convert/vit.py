"""Hugging Face ViT <-> megatron-core (``models/vit.py``): the name table.

Names are the on-disk ones (transformers 5 renames ViT modules in memory but ``save_pretrained`` writes these), with
the ``vit.`` prefix of ``ViTForImageClassification``; ``ViTModel`` checkpoints (no prefix, no classifier) are read
by stripping it. The only special case is the fused QKV, per head [q; k; v] (``convert/qwen.fuse_qkv`` with one
group per head); a naive [Q; K; V] concatenation still runs, so the tests compare logits.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List

import torch

from megatron_ext.convert.common import Rule, concrete_rules
from megatron_ext.convert.qwen import fuse_qkv, split_qkv
from megatron_ext.models.vit import ViTShape

PREFIX = "vit."


@dataclasses.dataclass(frozen=True)
class Context:
    shape: ViTShape


def _qkv(kind: str) -> Rule:
    return Rule(f"decoder.layers.{{i}}.self_attention.linear_qkv.{kind}",
                tuple(f"{PREFIX}encoder.layer.{{i}}.attention.attention.{p}.{kind}" for p in ("query", "key", "value")),
                fuse=lambda t, ctx: fuse_qkv(*t, ctx.shape), split=lambda t, ctx: split_qkv(t, ctx.shape))


def _same(mcore: str, hf: str) -> List[Rule]:
    return [Rule(f"{mcore}.{kind}", (f"{hf}.{kind}",)) for kind in ("weight", "bias")]


LAYER = f"{PREFIX}encoder.layer.{{i}}"
RULES = [
    *_same("patch_embed", f"{PREFIX}embeddings.patch_embeddings.projection"),
    Rule("cls_token", (f"{PREFIX}embeddings.cls_token",)),
    Rule("position_embeddings", (f"{PREFIX}embeddings.position_embeddings",)),
    *_same("decoder.layers.{i}.input_layernorm", f"{LAYER}.layernorm_before"),
    _qkv("weight"),
    _qkv("bias"),
    *_same("decoder.layers.{i}.self_attention.linear_proj", f"{LAYER}.attention.output.dense"),
    *_same("decoder.layers.{i}.pre_mlp_layernorm", f"{LAYER}.layernorm_after"),
    *_same("decoder.layers.{i}.mlp.linear_fc1", f"{LAYER}.intermediate.dense"),
    *_same("decoder.layers.{i}.mlp.linear_fc2", f"{LAYER}.output.dense"),
    *_same("decoder.final_layernorm", f"{PREFIX}layernorm"),
]
HEAD = _same("head", "classifier")


def rules(shape: ViTShape, with_head: bool = True) -> List[Rule]:
    return concrete_rules(RULES + (HEAD if with_head else []), shape.num_layers)


def hf_to_mcore(hf: Dict[str, torch.Tensor], shape: ViTShape) -> Dict[str, torch.Tensor]:
    """A full (TP=PP=1) megatron-core state dict from an in-memory HF one; without ``classifier.*`` (a ``ViTModel``
    or in21k checkpoint) the head is left out, for a new one."""
    if not any(name.startswith(PREFIX) for name in hf):
        hf = {PREFIX + name: tensor for name, tensor in hf.items()}
    ctx = Context(shape)
    return {rule.mcore: rule.to_mcore([hf[name] for name in rule.hf], ctx)
            for rule in rules(shape, with_head="classifier.weight" in hf)}
