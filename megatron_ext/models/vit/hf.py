"""Hugging Face ViT <-> megatron-core (``model.py``): the name table.

Names are the on-disk ones (transformers 5 renames ViT modules in memory but ``save_pretrained`` writes these), with
the ``vit.`` prefix of ``ViTForImageClassification``; ``ViTModel`` checkpoints (no prefix, no classifier) are read
by stripping it and give a headless checkpoint (``num_classes`` None); exports always carry the prefix, which both
classes load. The only special case is the fused QKV, per head [q; k; v] (``qwen/hf.fuse_qkv`` with one
group per head); a naive [Q; K; V] concatenation still runs, so the tests compare logits.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Dict, List, Tuple

from megatron_ext.models.hf_rules import Rule, concrete_rules, with_dtype
from megatron_ext.models.qwen.hf import fuse_qkv, split_qkv
from megatron_ext.models.vit.shape import ViTShape

if TYPE_CHECKING:
    import torch

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
PREPROCESSOR = "preprocessor_config.json"  # ViTImageProcessor's settings, kept through the checkpoint


def _rules(shape: ViTShape, with_head: bool) -> List[Rule]:
    return concrete_rules(RULES + (HEAD if with_head else []), shape.num_layers)


def rules(shape: ViTShape, record: dict) -> List[Rule]:
    """The table of a checkpoint recording ``num_classes`` (None: a backbone, no head)."""
    return _rules(shape, with_head=record.get("num_classes") is not None)


def source(shape: ViTShape, names, get) -> Tuple[List[Rule], dict]:
    """Rules naming a checkpoint's own tensors, and its class count: ``ViTForImageClassification`` ('vit.' prefix,
    ``classifier``) or a ``ViTModel``/in21k backbone (neither; its pooler is ignored), which gets no head."""
    names = set(names)
    with_head = "classifier.weight" in names
    table = _rules(shape, with_head)
    if not any(name.startswith(PREFIX) for name in names):
        table = [dataclasses.replace(rule, hf=tuple(n[len(PREFIX):] if n.startswith(PREFIX) else n for n in rule.hf))
                 for rule in table]
    return table, {"num_classes": get("classifier.weight").shape[0] if with_head else None}


def context(shape: ViTShape) -> Context:
    return Context(shape)


def ignorable(name: str, shape: ViTShape) -> bool:
    """ViTModel's pooler (dense + tanh on the class token): no classifier reads it."""
    return name.startswith(("pooler.", f"{PREFIX}pooler."))


def hf_config(shape: ViTShape, record: dict, dtype: torch.dtype) -> dict:
    """config.json for ``ViTForImageClassification.from_pretrained``: the recorded HF config (every value kept),
    else one from the shape; labels follow the checkpoint's head."""
    classes = record.get("num_classes")
    config = record.get("hf_config")
    if config is None:
        from transformers import ViTConfig

        config = ViTConfig(
            hidden_size=shape.hidden_size, intermediate_size=shape.ffn_hidden_size, num_hidden_layers=shape.num_layers,
            num_attention_heads=shape.num_attention_heads, image_size=shape.image_size, patch_size=shape.patch_size,
            num_channels=shape.num_channels, layer_norm_eps=shape.layer_norm_eps, hidden_act="gelu", qkv_bias=True,
            architectures=["ViTModel" if classes is None else "ViTForImageClassification"]).to_dict()
    config = dict(config)
    if classes is not None and len(config.get("id2label") or {}) != classes:
        config["id2label"] = {str(i): f"LABEL_{i}" for i in range(classes)}
        config["label2id"] = {f"LABEL_{i}": i for i in range(classes)}
        config["architectures"] = ["ViTForImageClassification"]
    return with_dtype(config, dtype)


def side_files(shape: ViTShape, record: dict) -> Dict[str, dict]:
    """preprocessor_config.json: the source's when it was recorded, else a ViTImageProcessor resizing to the image
    size, normalising with the recorded ``image_mean``/``image_std`` (default 0.5, as google/vit-*)."""
    carried = (record.get("hf_files") or {}).get(PREPROCESSOR)
    channels = shape.num_channels
    return {PREPROCESSOR: carried or {
        "image_processor_type": "ViTImageProcessor", "do_resize": True, "resample": 2,
        "size": {"height": shape.image_size, "width": shape.image_size}, "do_rescale": True,
        "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": record.get("image_mean") or [0.5] * channels,
        "image_std": record.get("image_std") or [0.5] * channels}}
