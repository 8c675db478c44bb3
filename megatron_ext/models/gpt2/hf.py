"""Hugging Face GPT-2 (``GPT2LMHeadModel``) <-> megatron-core (``model.py``): the name table.

GPT-2's linear layers are ``Conv1D``s, weights stored [in, out]: transposed both ways. ``c_attn`` is [Q | K | V]
over all heads, megatron-core's ``linear_qkv`` [q; k; v] per head (``qwen/hf.fuse_qkv`` with one group per
head). Vocabulary rows are padded for TP on import and removed on export; the output layer is the embedding (no
``lm_head.weight`` either side). Names are ``save_pretrained``'s (``transformer.`` prefix); the original OpenAI
checkpoints (no prefix, causal-mask buffers ``attn.bias``) are read too.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, List, Tuple

from megatron_ext.models.gpt2.shape import GPT2Shape
from megatron_ext.models.hf_rules import Rule, concrete_rules, with_dtype
from megatron_ext.models.qwen.hf import _cat, _pad_vocab, _unpad_vocab, fuse_qkv, split_qkv

if TYPE_CHECKING:
    import torch

PREFIX = "transformer."
VOCAB_DIVISIBLE_BY = 128  # pretrain_gpt.py's --make-vocab-size-divisible-by default: 50257 -> 50304


@dataclasses.dataclass(frozen=True)
class Context:
    shape: GPT2Shape
    padded_vocab: int


def _transposed(mcore: str, hf: str) -> List[Rule]:
    """A Conv1D: weight transposed, bias as is."""
    return [Rule(f"{mcore}.weight", (f"{hf}.weight",), fuse=lambda t, ctx: t[0].t().contiguous(),
                 split=lambda t, ctx: [t.t().contiguous()]),
            Rule(f"{mcore}.bias", (f"{hf}.bias",))]


def _same(mcore: str, hf: str) -> List[Rule]:
    return [Rule(f"{mcore}.{kind}", (f"{hf}.{kind}",)) for kind in ("weight", "bias")]


def _qkv_weight(t, ctx: Context) -> torch.Tensor:
    return fuse_qkv(*t[0].t().split(ctx.shape.hidden_size), ctx.shape)


def _qkv_bias(t, ctx: Context) -> torch.Tensor:
    return fuse_qkv(*t[0].split(ctx.shape.hidden_size), ctx.shape)


LAYER = f"{PREFIX}h.{{i}}"
QKV = "decoder.layers.{i}.self_attention.linear_qkv"
RULES = [
    Rule("embedding.word_embeddings.weight", (f"{PREFIX}wte.weight",), _pad_vocab, _unpad_vocab),
    Rule("embedding.position_embeddings.weight", (f"{PREFIX}wpe.weight",)),
    *_same("decoder.layers.{i}.input_layernorm", f"{LAYER}.ln_1"),
    Rule(f"{QKV}.weight", (f"{LAYER}.attn.c_attn.weight",), fuse=_qkv_weight,
         split=lambda t, ctx: [_cat(split_qkv(t, ctx.shape), ctx).t().contiguous()]),
    Rule(f"{QKV}.bias", (f"{LAYER}.attn.c_attn.bias",), fuse=_qkv_bias,
         split=lambda t, ctx: [_cat(split_qkv(t, ctx.shape), ctx)]),
    *_transposed("decoder.layers.{i}.self_attention.linear_proj", f"{LAYER}.attn.c_proj"),
    *_same("decoder.layers.{i}.pre_mlp_layernorm", f"{LAYER}.ln_2"),
    *_transposed("decoder.layers.{i}.mlp.linear_fc1", f"{LAYER}.mlp.c_fc"),
    *_transposed("decoder.layers.{i}.mlp.linear_fc2", f"{LAYER}.mlp.c_proj"),
    *_same("decoder.final_layernorm", f"{PREFIX}ln_f"),
]


def rules(shape: GPT2Shape, record: dict = None) -> List[Rule]:
    return concrete_rules(RULES, shape.num_layers)


def source(shape: GPT2Shape, names, get) -> Tuple[List[Rule], dict]:
    """Rules naming a checkpoint's own tensors: with the ``transformer.`` prefix or (OpenAI's originals) without."""
    table = rules(shape)
    if not any(name.startswith(PREFIX) for name in names):
        table = [dataclasses.replace(rule, hf=tuple(n[len(PREFIX):] for n in rule.hf)) for rule in table]
    return table, {}


def context(shape: GPT2Shape) -> Context:
    from megatron_ext.models.qwen.model import padded_vocab_size

    return Context(shape, padded_vocab_size(shape.vocab_size, VOCAB_DIVISIBLE_BY, 1))


def ignorable(name: str, shape: GPT2Shape) -> bool:
    """The tied ``lm_head.weight`` some exports repeat, and old checkpoints' causal-mask buffers."""
    return name == "lm_head.weight" or name.endswith((".attn.bias", ".attn.masked_bias"))


def config_fields(shape: GPT2Shape) -> dict:
    """The ``GPT2Config`` fields a shape determines; end of text is the vocabulary's last token, as in GPT-2's (50256)
    and the tiny tokenizer's (2047: transformers' default 50256 lies outside a 2,048-token vocabulary)."""
    return dict(vocab_size=shape.vocab_size, bos_token_id=shape.vocab_size - 1, eos_token_id=shape.vocab_size - 1, n_positions=shape.max_position_embeddings, n_embd=shape.hidden_size,
                n_layer=shape.num_layers, n_head=shape.num_attention_heads,
                n_inner=None if shape.ffn_hidden_size == 4 * shape.hidden_size else shape.ffn_hidden_size,
                layer_norm_epsilon=shape.layer_norm_eps, activation_function="gelu_new", tie_word_embeddings=True)


def hf_config(shape: GPT2Shape, record: dict, dtype: torch.dtype) -> dict:
    """config.json for ``GPT2LMHeadModel``: the recorded HF config (every value kept), else one from the shape."""
    config = record.get("hf_config")
    if config is None:
        from transformers import GPT2Config

        config = GPT2Config(**config_fields(shape), architectures=["GPT2LMHeadModel"]).to_dict()
    return with_dtype(config, dtype)
