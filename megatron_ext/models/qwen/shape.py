"""Qwen2/2.5 and Qwen3 shapes, dense and MoE: the published presets and reading any Hugging Face ``config.json``.

Kept free of torch and megatron imports so flag validation stays instant.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

from megatron_ext.errors import ConfigError
from megatron_ext.models.hf_rules import read_config


@dataclasses.dataclass(frozen=True)
class MoEShape:
    """The Mixture-of-Experts part of a Qwen2-MoE or Qwen3-MoE shape (``Qwen2MoeConfig``, ``Qwen3MoeConfig``)."""

    num_experts: int
    topk: int
    ffn_hidden_size: int  # each routed expert's FFN (HF moe_intermediate_size)
    shared_expert_size: Optional[int] = None  # the shared expert's FFN, behind its sigmoid gate; None: no shared expert
    # HF norm_topk_prob: renormalise the top-k probabilities (megatron-core: top-k on logits, then softmax over the k);
    # False: softmax over all experts, then top-k, no renormalisation (megatron-core's moe_router_pre_softmax).
    norm_topk_prob: bool = False
    layer_pattern: Optional[Tuple[int, ...]] = None  # 1 = MoE layer, 0 = dense MLP; None: every layer is MoE

    def __post_init__(self):  # a checkpoint's JSON record gives a list
        if self.layer_pattern is not None:
            object.__setattr__(self, "layer_pattern", tuple(self.layer_pattern))

    def pattern(self, num_layers: int) -> Tuple[int, ...]:
        return self.layer_pattern if self.layer_pattern is not None else (1,) * num_layers


@dataclasses.dataclass(frozen=True)
class ModelShape:
    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_query_groups: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    moe: Optional[MoEShape] = None
    # Qwen3: RMSNorm on each head's query and key, no QKV bias, the head dimension from the config (128 at every
    # size, not hidden / heads). Qwen2 keeps the defaults.
    head_dim: Optional[int] = None
    qk_norm: bool = False
    qkv_bias: bool = True
    # "lm": the output layer over the vocabulary (*ForCausalLM); "score": one scalar per token from the final hidden
    # state, read at a sequence's last token (*ForSequenceClassification with one label: a reward model)
    head: str = "lm"

    def __post_init__(self):  # a checkpoint's record gives the MoE part as a dict
        if isinstance(self.moe, dict):
            object.__setattr__(self, "moe", MoEShape(**self.moe))

    @property
    def kv_channels(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def model_type(self) -> str:
        """The Hugging Face family of this shape: ``qwen2``, ``qwen2_moe``, ``qwen3`` or ``qwen3_moe``."""
        return ("qwen3" if self.qk_norm else "qwen2") + ("_moe" if self.moe else "")

    @property
    def num_experts(self) -> Optional[int]:
        return self.moe.num_experts if self.moe else None


# Published configs of Qwen/Qwen2.5-*B (config.json on the Hugging Face hub).
PRESETS = {
    "qwen2.5-0.5b": ModelShape(896, 4864, 24, 14, 2, 151936, 32768, 1e6, 1e-6, True),
    "qwen2.5-1.5b": ModelShape(1536, 8960, 28, 12, 2, 151936, 32768, 1e6, 1e-6, True),
    "qwen2.5-3b": ModelShape(2048, 11008, 36, 16, 2, 151936, 32768, 1e6, 1e-6, True),
    "qwen2.5-7b": ModelShape(3584, 18944, 28, 28, 4, 152064, 32768, 1e6, 1e-6, False),
    # For tests and the CPU quickstart: GQA (4 heads, 2 groups), 4 layers so PP2 x VPP2 has one layer per chunk.
    "tiny": ModelShape(64, 128, 4, 4, 2, 256, 512, 10000.0, 1e-6, True),
    # Qwen/Qwen1.5-MoE-A2.7B: 60 routed experts (top-4) + a gated shared expert in every layer.
    "qwen1.5-moe-a2.7b": ModelShape(2048, 5632, 24, 16, 16, 151936, 8192, 1e6, 1e-6, False,
                                    MoEShape(60, 4, 1408, 5632)),
    # Qwen2.5-3B upcycled (tools/upcycle_moe.py --num-experts 8 --moe-router-topk 2 --granularity 2): 8 experts, each
    # half of the dense FFN, top-2 (a token's compute = the dense MLP's) + a zero-initialised gated shared expert.
    "qwen2.5-3b-moe": ModelShape(2048, 11008, 36, 16, 2, 151936, 32768, 1e6, 1e-6, True,
                                 MoEShape(8, 2, 5504, 5504, norm_topk_prob=True)),
    # Tests and the MoE quickstart: the tiny model with 4 experts (top-2) and a gated shared expert.
    "tiny-moe": ModelShape(64, 128, 4, 4, 2, 256, 512, 10000.0, 1e-6, True, MoEShape(4, 2, 64, 64)),
}


def _qwen3(hidden: int, ffn: int, layers: int, heads: int, groups: int, tied: bool, moe: Optional[MoEShape] = None,
           vocab: int = 151936, positions: int = 40960, rope_theta: float = 1e6, head_dim: int = 128) -> ModelShape:
    return ModelShape(hidden, ffn, layers, heads, groups, vocab, positions, rope_theta, 1e-6, tied, moe,
                      head_dim=head_dim, qk_norm=True, qkv_bias=False)


# Published configs of Qwen/Qwen3-* (config.json on the Hugging Face hub): head_dim 128 everywhere, untied from 8B.
# Qwen3-MoE: 128 experts, top-8 with renormalised probabilities, no shared expert, every layer sparse.
PRESETS.update({
    "qwen3-0.6b": _qwen3(1024, 3072, 28, 16, 8, True),
    "qwen3-1.7b": _qwen3(2048, 6144, 28, 16, 8, True),
    "qwen3-4b": _qwen3(2560, 9728, 36, 32, 8, True),
    "qwen3-8b": _qwen3(4096, 12288, 36, 32, 8, False),
    "qwen3-14b": _qwen3(5120, 17408, 40, 40, 8, False),
    "qwen3-32b": _qwen3(5120, 25600, 64, 64, 8, False),
    "qwen3-30b-a3b": _qwen3(2048, 6144, 48, 32, 4, False, MoEShape(128, 8, 768, norm_topk_prob=True)),
    "qwen3-235b-a22b": _qwen3(4096, 12288, 94, 64, 4, False, MoEShape(128, 8, 1536, norm_topk_prob=True)),
    # Tests: the tiny model as Qwen3 (a head dimension of 32, twice hidden / heads, as the published 30B-A3B's is),
    # and with 4 experts (top-2), no shared expert.
    "tiny-qwen3": _qwen3(64, 128, 4, 4, 2, True, vocab=256, positions=512, rope_theta=10000.0, head_dim=32),
    "tiny-qwen3-moe": _qwen3(64, 128, 4, 4, 2, True, MoEShape(4, 2, 64, norm_topk_prob=True), vocab=256,
                             positions=512, rope_theta=10000.0, head_dim=32),
})
QWEN_MODEL_TYPES = ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe")


def read_hf_config(path: Optional[str], flag: str = "--hf-config") -> Optional[dict]:
    """A Qwen2/Qwen3 ``config.json`` (or a directory holding one) as a dict; None for no path."""
    return None if path is None else read_config(path, flag, QWEN_MODEL_TYPES)


def moe_layer_pattern(cfg: dict) -> Tuple[int, ...]:
    """HF Qwen2-MoE's and Qwen3-MoE's sparse layers: layer i is MoE iff (i+1) % decoder_sparse_step == 0 and i is not in
    mlp_only_layers (megatron-core's integer moe_layer_freq means i % N == 0: not the same, so a list)."""
    step, dense = cfg.get("decoder_sparse_step", 1), set(cfg.get("mlp_only_layers") or ())
    return tuple(int(i not in dense and step > 0 and (i + 1) % step == 0) for i in range(cfg["num_hidden_layers"]))


def moe_shape_from_hf_config(cfg: dict) -> Optional[MoEShape]:
    if cfg.get("model_type") not in ("qwen2_moe", "qwen3_moe"):
        return None
    pattern = moe_layer_pattern(cfg)
    shared = cfg.get("shared_expert_intermediate_size") or None
    # transformers 5 writes Qwen3-MoE's expert count as num_local_experts; the published configs say num_experts
    experts = cfg["num_experts"] if "num_experts" in cfg else cfg["num_local_experts"]
    return MoEShape(num_experts=experts, topk=cfg["num_experts_per_tok"],
                    ffn_hidden_size=cfg["moe_intermediate_size"], shared_expert_size=shared,
                    norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                    layer_pattern=None if all(pattern) else pattern)


def shape_from_hf_config(path: str, flag: str = "--hf-config") -> ModelShape:
    """The shape of a Qwen2, Qwen2-MoE, Qwen3 or Qwen3-MoE ``config.json`` (or a directory holding one)."""
    return shape_from_hf_dict(read_hf_config(path, flag), flag, path)


def shape_from_hf_dict(cfg: dict, flag: str, path: str) -> ModelShape:
    """The shape of a Qwen config read from ``path`` (named in errors with ``flag``)."""
    if cfg.get("model_type") not in QWEN_MODEL_TYPES:
        raise ConfigError(f"{flag} {path}: model_type is {cfg.get('model_type')!r}, expected one of "
                          f"{', '.join(QWEN_MODEL_TYPES)}")
    qwen3 = cfg["model_type"].startswith("qwen3")
    unsupported = [name for name, bad in (("attention_bias", qwen3 and cfg.get("attention_bias")),
                                          ("use_sliding_window", cfg.get("use_sliding_window"))) if bad]
    if unsupported:
        raise ConfigError(f"{flag} {path}: {unsupported[0]} is true, which the published Qwen models never set and "
                          "megatron_ext cannot build; set it to false")
    scaling = rope_scaling_type(cfg)
    if scaling:  # YaRN and the like (Qwen3's long-context recipe): a RoPE megatron_ext does not build
        raise ConfigError(f"{flag} {path}: RoPE scaling {scaling!r} (rope_scaling), which megatron_ext cannot build; "
                          "remove it from config.json to train at the model's native context length")
    try:
        return ModelShape(
            hidden_size=cfg["hidden_size"],
            ffn_hidden_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_attention_heads=cfg["num_attention_heads"],
            num_query_groups=cfg.get("num_key_value_heads", cfg["num_attention_heads"]),
            vocab_size=cfg["vocab_size"],
            max_position_embeddings=cfg.get("max_position_embeddings", 32768),
            rope_theta=float(cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            moe=moe_shape_from_hf_config(cfg),
            # Qwen3Config defaults head_dim to 128; Qwen3MoeConfig has no default (hidden / heads)
            head_dim=cfg.get("head_dim", 128 if cfg["model_type"] == "qwen3" else None) if qwen3 else None,
            qk_norm=qwen3,
            qkv_bias=not qwen3,
            head=_head(cfg, flag, path),
        )
    except KeyError as e:
        raise ConfigError(f"{flag} {path}: missing field {e.args[0]!r}") from None


def _head(cfg: dict, flag: str, path: str) -> str:
    """"score" for a sequence classifier of one label (a reward model), "lm" otherwise."""
    if not any(a.endswith("ForSequenceClassification") for a in cfg.get("architectures") or ()):
        return "lm"
    labels = len(cfg.get("id2label") or {}) or cfg.get("num_labels", 2)
    if labels != 1:
        raise ConfigError(f"{flag} {path}: a sequence classifier of {labels} labels; megatron_ext trains reward "
                          "models, of one (num_labels 1)")
    return "score"


def rope_scaling_type(cfg: dict):
    """The RoPE scaling a config asks for (transformers 4's ``rope_scaling``, 5's ``rope_parameters``), or None for
    plain RoPE."""
    for key in ("rope_scaling", "rope_parameters"):
        kind = (cfg.get(key) or {}).get("rope_type", (cfg.get(key) or {}).get("type"))
        if kind not in (None, "default"):
            return kind
    return None
