"""GPT-2 shapes: the published presets and reading a Hugging Face ``config.json``.

Kept free of torch and megatron imports so flag validation stays instant.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from megatron_ext.errors import ConfigError
from megatron_ext.models.hf_rules import read_config
from megatron_ext.models.qwen.shape import QWEN_MODEL_TYPES, shape_from_hf_config

@dataclasses.dataclass(frozen=True)
class GPT2Shape:
    """GPT-2 (``GPT2LMHeadModel``): LayerNorm, tanh-GELU MLP of 4h (``n_inner``), learned positions, biases
    everywhere, embeddings tied to the output layer, multi-head attention."""

    hidden_size: int
    num_layers: int
    num_attention_heads: int
    vocab_size: int = 50257
    max_position_embeddings: int = 1024
    ffn_hidden_size: Optional[int] = None  # None: 4 x hidden (HF n_inner None)
    layer_norm_eps: float = 1e-5

    def __post_init__(self):
        if self.ffn_hidden_size is None:
            object.__setattr__(self, "ffn_hidden_size", 4 * self.hidden_size)

    @property
    def num_query_groups(self) -> int:
        return self.num_attention_heads

    @property
    def kv_channels(self) -> int:
        return self.hidden_size // self.num_attention_heads

    tie_word_embeddings = True
    gated_mlp = False  # fc1 -> GELU -> fc2 (observability/flops.py)
    num_experts = None
    moe = None


# openai-community/gpt2{,-medium,-large,-xl} (config.json on the hub).
GPT2_PRESETS = {
    "gpt2": GPT2Shape(768, 12, 12),
    "gpt2-medium": GPT2Shape(1024, 24, 16),
    "gpt2-large": GPT2Shape(1280, 36, 20),
    "gpt2-xl": GPT2Shape(1600, 48, 25),
    # Tests and the CPU quickstart: 4 heads (TP2), 4 layers (PP2 x VPP2), the shipped tiny tokenizer's vocabulary.
    "tiny": GPT2Shape(64, 4, 4, vocab_size=2048, max_position_embeddings=512),
}


def decoder_shape_from_hf_config(path: str, flag: str = "--hf-config"):
    """pretrain_gpt.py's models: a GPT-2 or Qwen2/Qwen3 (dense or MoE) ``config.json``'s shape."""
    model_type = read_config(path, flag, ("gpt2",) + QWEN_MODEL_TYPES)["model_type"]
    return gpt2_shape_from_hf_config(path, flag) if model_type == "gpt2" else shape_from_hf_config(path, flag)


def gpt2_shape_from_hf_config(path: str, flag: str = "--hf-config") -> GPT2Shape:
    """The shape of a Hugging Face GPT-2 ``config.json`` (or a directory holding one)."""
    cfg = read_config(path, flag, ("gpt2",))
    if cfg.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh") \
            or cfg.get("scale_attn_by_inverse_layer_idx") or cfg.get("reorder_and_upcast_attn"):
        raise ConfigError(f"{flag} {path}: only GPT-2s with the tanh GELU and plain attention scaling are supported")
    try:
        return GPT2Shape(hidden_size=cfg["n_embd"], num_layers=cfg["n_layer"], num_attention_heads=cfg["n_head"],
                         vocab_size=cfg["vocab_size"], max_position_embeddings=cfg["n_positions"],
                         ffn_hidden_size=cfg.get("n_inner"), layer_norm_eps=cfg.get("layer_norm_epsilon", 1e-5))
    except KeyError as e:
        raise ConfigError(f"{flag} {path}: missing field {e.args[0]!r}") from None
