"""Tiny Hugging Face models of every family, saved as users get them: sharded safetensors with an index, and laid
out as a hub cache (``models--org--name/refs/main`` + ``snapshots/<commit>/``) for hub ids under HF_HUB_OFFLINE=1.
Every tensor is random (transformers starts norms at 1 and biases at 0: a mistake there would not show)."""

from __future__ import annotations

import json
import os
import shutil

import torch
from safetensors import safe_open

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENIZER = os.path.join(REPO, "examples", "tokenizers", "tiny-qwen")
COMMIT = "0123456789abcdef0123456789abcdef01234567"
QWEN_VOCAB = 1100  # the tiny tokenizer's 1024 tokens fit; padded to 1152 rows, so TP2's second shard has padding


def _perturb(model, scale=0.05):
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * scale)
    return model


def make_qwen(path, tied: bool = True, dtype=torch.float32, vocab: int = QWEN_VOCAB, seed: int = 1):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=512, rope_theta=1e4,
                         rms_norm_eps=1e-6, tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2)
    _perturb(Qwen2ForCausalLM(config)).to(dtype).save_pretrained(path, max_shard_size="100KB")
    for name in os.listdir(TOKENIZER):
        shutil.copy(os.path.join(TOKENIZER, name), path)
    return path


def make_vit(path, classes=None, dtype=torch.float32, seed: int = 4):
    """A ViTForImageClassification with ``classes`` labels, or (None) a ViTModel backbone as google/*-in21k."""
    from transformers import ViTConfig, ViTForImageClassification, ViTModel

    torch.manual_seed(seed)
    config = ViTConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                       image_size=32, patch_size=8, num_channels=3, hidden_act="gelu", qkv_bias=True,
                       num_labels=classes or 2)
    model = ViTModel(config) if classes is None else ViTForImageClassification(config)
    _perturb(model, 0.1).to(dtype).save_pretrained(path, max_shard_size="100KB")
    return path


def as_hub_cache(model_dir, cache, repo_id: str) -> str:
    """``model_dir`` as huggingface_hub caches ``repo_id`` (plain files in the snapshot, as the hub's Windows
    layout has them); returns the snapshot directory."""
    root = os.path.join(str(cache), "models--" + repo_id.replace("/", "--"))
    snapshot = os.path.join(root, "snapshots", COMMIT)
    shutil.copytree(model_dir, snapshot)
    os.makedirs(os.path.join(root, "refs"), exist_ok=True)
    with open(os.path.join(root, "refs", "main"), "w") as f:
        f.write(COMMIT)
    return snapshot


def tensors(path) -> dict:
    """Every tensor of a Hugging Face directory, by name."""
    index = os.path.join(str(path), "model.safetensors.index.json")
    files = set(json.load(open(index))["weight_map"].values()) if os.path.exists(index) else {"model.safetensors"}
    out = {}
    for file in files:
        with safe_open(os.path.join(str(path), file), "pt") as f:
            out.update({name: f.get_tensor(name) for name in f.keys()})
    return out
