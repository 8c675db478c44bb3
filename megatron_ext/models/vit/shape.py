"""ViT shapes: the published presets and reading a Hugging Face ``config.json``.

Kept free of torch and megatron imports so flag validation stays instant.
"""

from __future__ import annotations

import dataclasses

from megatron_ext.errors import ConfigError
from megatron_ext.models.hf_rules import read_config


@dataclasses.dataclass(frozen=True)
class ViTShape:
    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_attention_heads: int
    patch_size: int
    image_size: int
    num_channels: int = 3
    layer_norm_eps: float = 1e-12

    @property
    def num_query_groups(self) -> int:  # no GQA: fused QKV is [q, k, v] per head (qwen/hf.fuse_qkv)
        return self.num_attention_heads

    @property
    def kv_channels(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def seq_length(self) -> int:
        return self.num_patches + 1  # the class token first


# google/vit-{base,large}-patch16-224 and google/vit-huge-patch14-224-in21k (config.json on the hub).
VIT_PRESETS = {
    "vit-base-16": ViTShape(768, 3072, 12, 12, 16, 224),
    "vit-large-16": ViTShape(1024, 4096, 24, 16, 16, 224),
    "vit-huge-14": ViTShape(1280, 5120, 32, 16, 14, 224),
    # Tests and the CPU quickstart: 4 heads (TP2), 4 layers (PP2 x VPP2), 32px images of 8px patches = 17 tokens.
    "tiny": ViTShape(64, 128, 4, 4, 8, 32),
}


def vit_shape_from_hf_config(path: str, flag: str = "--hf-config") -> ViTShape:
    """The shape of a Hugging Face ViT ``config.json`` (or a directory holding one)."""
    cfg = read_config(path, flag, ("vit",))
    if cfg.get("hidden_act", "gelu") != "gelu" or not cfg.get("qkv_bias", True):
        raise ConfigError(f"{flag} {path}: only ViTs with exact GELU and QKV bias are supported")
    try:
        return ViTShape(hidden_size=cfg["hidden_size"], ffn_hidden_size=cfg["intermediate_size"],
                        num_layers=cfg["num_hidden_layers"], num_attention_heads=cfg["num_attention_heads"],
                        patch_size=cfg["patch_size"], image_size=cfg["image_size"],
                        num_channels=cfg.get("num_channels", 3), layer_norm_eps=cfg.get("layer_norm_eps", 1e-12))
    except KeyError as e:
        raise ConfigError(f"{flag} {path}: missing field {e.args[0]!r}") from None
