"""Tiny Hugging Face models of every family, saved as users get them: sharded safetensors with an index, and laid
out as a hub cache (``models--org--name/refs/main`` + ``snapshots/<commit>/``) for hub ids under HF_HUB_OFFLINE=1.
Every tensor is random (transformers starts norms at 1 and biases at 0: a mistake there would not show)."""

from __future__ import annotations

import json
import os
import shutil

import torch

from support import REPO

TOKENIZER = os.path.join(REPO, "examples", "tokenizers", "tiny-qwen")
COMMIT = "0123456789abcdef0123456789abcdef01234567"
QWEN_VOCAB = 1100  # the tiny tokenizer's 1024 tokens fit; padded to 1152 rows, so TP2's second shard has padding


def _perturb(model, scale=0.05, router_scale=None):
    """Every tensor moved by N(0, scale); MoE routers (``mlp.gate.weight``) by N(0, router_scale), when given, so that
    no token sits on a top-k tie."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            wide = router_scale is not None and name.endswith("mlp.gate.weight")
            p.add_(torch.randn_like(p) * (router_scale if wide else scale))
    return model


# The tiny shape of each Qwen family (transformers' class names), and what differs from it: Qwen3's head dimension
# (32) is not hidden / heads (16), as the published 30B-A3B's is not; Qwen3-MoE has 4 experts, top-2 renormalised,
# no shared expert, its second layer dense; Qwen2-MoE (the tiny-moe preset) a shared expert.
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=512, rope_theta=1e4, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)
FAMILIES = {"Qwen2": {}, "Qwen3": dict(head_dim=32),
            "Qwen2Moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                             shared_expert_intermediate_size=64, norm_topk_prob=False, mlp_only_layers=[]),
            "Qwen3Moe": dict(head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                             norm_topk_prob=True, mlp_only_layers=[1])}


def random_qwen(family: str = "Qwen2", tied: bool = True, vocab: int = QWEN_VOCAB, seed: int = 1, scale: float = 0.05,
                router_scale=None, **config):
    """The one maker of random Hugging Face Qwen models: a ``{family}ForCausalLM`` of the tiny shape (``config``
    overrides any field), seeded, every tensor random (transformers starts norms at 1 and biases at 0: a mistake
    there would not show)."""
    import transformers

    torch.manual_seed(seed)
    fields = {**TINY, **FAMILIES[family], "vocab_size": vocab, "tie_word_embeddings": tied, **config}
    config = getattr(transformers, f"{family}Config")(**fields)
    return _perturb(getattr(transformers, f"{family}ForCausalLM")(config), scale, router_scale)


def make_qwen(path, family: str = "Qwen2", dtype=torch.float32, shard="100KB", tokenizer: bool = True, **model):
    """``random_qwen(family, **model)`` saved to ``path`` as users get it (shards of ``shard``, None for one file),
    with the tiny tokenizer beside it unless not ``tokenizer``; returns ``path``."""
    random_qwen(family, **model).to(dtype).save_pretrained(path, **({"max_shard_size": shard} if shard else {}))
    for name in os.listdir(TOKENIZER) if tokenizer else ():
        shutil.copy(os.path.join(TOKENIZER, name), path)
    return path


def make_qwen3(path, moe: bool = False, tied: bool = False, seed: int = 6, mlp_only_layers=(1,), **kwargs):
    """A Qwen3 (or Qwen3-MoE) directory: ``make_qwen`` with Qwen3's test defaults (untied, seed 6)."""
    extra = dict(mlp_only_layers=list(mlp_only_layers)) if moe else {}
    return make_qwen(path, "Qwen3Moe" if moe else "Qwen3", tied=tied, seed=seed, **extra, **kwargs)


def make_adapter(base, out, scale: float = 0.2, targets=("q_proj", "v_proj"), rank: int = 4, alpha: int = 8):
    """A PEFT LoRA adapter on ``base`` whose B is random (N(0, scale)), so base + adapter differs from the base (with
    PEFT's B = 0 a broken adapter forward would change nothing)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                           LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets)))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, scale)
    model.save_pretrained(out)
    return out


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
    """Every tensor of a safetensors file, or of a Hugging Face directory (its index's shards, or model.safetensors),
    by name: read by safetensors itself, not by the reader of megatron_ext the tests check."""
    from safetensors.torch import load_file

    path = str(path)
    if os.path.isfile(path):
        return load_file(path)
    index = os.path.join(path, "model.safetensors.index.json")
    files = sorted(set(json.load(open(index))["weight_map"].values())) if os.path.exists(index) else \
        ["model.safetensors"]
    return {name: tensor for file in files for name, tensor in load_file(os.path.join(path, file)).items()}


def _qwen2(**fields) -> dict:
    return {"architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
            "eos_token_id": 151643, "hidden_act": "silu", "initializer_range": 0.02, "model_type": "qwen2",
            "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "torch_dtype": "bfloat16", "use_cache": True,
            "use_sliding_window": False, "vocab_size": 151936, **fields}


def _qwen3(**fields) -> dict:
    return {"architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
            "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
            "initializer_range": 0.02, "max_position_embeddings": 40960, "model_type": "qwen3", "rms_norm_eps": 1e-06,
            "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None, "torch_dtype": "bfloat16",
            "use_cache": True, "use_sliding_window": False, "vocab_size": 151936, **fields}


def _vit(**fields) -> dict:
    return {"architectures": ["ViTModel"], "attention_probs_dropout_prob": 0.0, "hidden_act": "gelu",
            "hidden_dropout_prob": 0.0, "image_size": 224, "initializer_range": 0.02, "layer_norm_eps": 1e-12,
            "model_type": "vit", "num_channels": 3, "qkv_bias": True, **fields}


# config.json of the models the launchers and README's recipes start from, as published on the hub (the fields our
# shapes read).
PUBLISHED = {
    "Qwen/Qwen2.5-0.5B": _qwen2(hidden_size=896, intermediate_size=4864, max_position_embeddings=32768,
                                max_window_layers=24, num_attention_heads=14, num_hidden_layers=24,
                                num_key_value_heads=2, sliding_window=32768, tie_word_embeddings=True),
    "Qwen/Qwen2.5-1.5B": _qwen2(hidden_size=1536, intermediate_size=8960, max_position_embeddings=131072,
                                max_window_layers=21, num_attention_heads=12, num_hidden_layers=28,
                                num_key_value_heads=2, sliding_window=131072, tie_word_embeddings=True),
    "Qwen/Qwen2.5-3B": _qwen2(hidden_size=2048, intermediate_size=11008, max_position_embeddings=32768,
                              max_window_layers=36, num_attention_heads=16, num_hidden_layers=36,
                              num_key_value_heads=2, sliding_window=32768, tie_word_embeddings=True),
    "Qwen/Qwen2.5-3B-Instruct": _qwen2(hidden_size=2048, intermediate_size=11008, max_position_embeddings=32768,
                                       max_window_layers=70, num_attention_heads=16, num_hidden_layers=36,
                                       num_key_value_heads=2, sliding_window=32768, tie_word_embeddings=True),
    "Qwen/Qwen1.5-MoE-A2.7B": _qwen2(
        architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe", decoder_sparse_step=1, hidden_size=2048,
        intermediate_size=5632, max_position_embeddings=8192, max_window_layers=21, moe_intermediate_size=1408,
        norm_topk_prob=False, num_attention_heads=16, num_experts=60, num_experts_per_tok=4, num_hidden_layers=24,
        num_key_value_heads=16, router_aux_loss_coef=0.001, shared_expert_intermediate_size=5632,
        sliding_window=32768, tie_word_embeddings=False),
    "Qwen/Qwen3-0.6B": _qwen3(hidden_size=1024, intermediate_size=3072, max_window_layers=28, num_attention_heads=16,
                              num_hidden_layers=28, num_key_value_heads=8, tie_word_embeddings=True),
    "Qwen/Qwen3-8B": _qwen3(hidden_size=4096, intermediate_size=12288, max_window_layers=36, num_attention_heads=32,
                            num_hidden_layers=36, num_key_value_heads=8, tie_word_embeddings=False),
    "Qwen/Qwen3-30B-A3B": _qwen3(
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", decoder_sparse_step=1, hidden_size=2048,
        intermediate_size=6144, max_window_layers=48, mlp_only_layers=[], moe_intermediate_size=768,
        norm_topk_prob=True, num_attention_heads=32, num_experts=128, num_experts_per_tok=8, num_hidden_layers=48,
        num_key_value_heads=4, output_router_logits=False, router_aux_loss_coef=0.001, tie_word_embeddings=False),
    "google/vit-huge-patch14-224-in21k": _vit(hidden_size=1280, intermediate_size=5120, num_attention_heads=16,
                                              num_hidden_layers=32, patch_size=14),
    "google/vit-base-patch16-224-in21k": _vit(hidden_size=768, intermediate_size=3072, num_attention_heads=12,
                                              num_hidden_layers=12, patch_size=16),
    "openai-community/gpt2": {"architectures": ["GPT2LMHeadModel"], "activation_function": "gelu_new",
                              "model_type": "gpt2", "n_ctx": 1024, "n_embd": 768, "n_head": 12, "n_layer": 12,
                              "n_positions": 1024, "layer_norm_epsilon": 1e-05, "vocab_size": 50257,
                              "bos_token_id": 50256, "eos_token_id": 50256},
}


def published_hub(cache) -> dict:
    """A hub cache holding only the published config.json of each launcher's model: enough for the flags to be
    parsed offline. Returns the environment that points huggingface_hub at it."""
    for repo_id, config in PUBLISHED.items():
        snapshot = os.path.join(str(cache), "models--" + repo_id.replace("/", "--"), "snapshots", COMMIT)
        os.makedirs(snapshot, exist_ok=True)
        with open(os.path.join(snapshot, "config.json"), "w") as f:
            json.dump(config, f)
        refs = os.path.join(str(cache), "models--" + repo_id.replace("/", "--"), "refs")
        os.makedirs(refs, exist_ok=True)
        with open(os.path.join(refs, "main"), "w") as f:
            f.write(COMMIT)
    return dict(HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(cache))

