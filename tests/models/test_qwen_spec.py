"""The Qwen2 spec on megatron-core: bias on QKV only, RMSNorm/SwiGLU/GQA shapes, tied vs untied output layer."""

import dataclasses

import torch

from megatron_ext.mesh import Mesh
from megatron_ext.models.qwen import model as qwen
from megatron_ext.models.qwen.shape import PRESETS
from megatron_ext.models.spec import TorchNorm


def build(shape):
    config = qwen.transformer_config(shape, Mesh(world=1))
    return qwen.build_qwen(config, shape, vocab_size=qwen.padded_vocab_size(shape.vocab_size, 128, 1))


def test_tiny_qwen_structure(single_rank):
    shape = PRESETS["tiny"]
    params = dict(build(shape).named_parameters())
    biases = sorted(n for n in params if n.endswith("bias"))
    assert biases == [f"decoder.layers.{i}.self_attention.linear_qkv.bias" for i in range(shape.num_layers)]
    d, heads, groups = shape.kv_channels, shape.num_attention_heads, shape.num_query_groups
    layer = "decoder.layers.0."
    assert params[layer + "self_attention.linear_qkv.weight"].shape == ((heads + 2 * groups) * d, shape.hidden_size)
    assert params[layer + "mlp.linear_fc1.weight"].shape == (2 * shape.ffn_hidden_size, shape.hidden_size)  # SwiGLU
    assert isinstance(build(shape).decoder.final_layernorm, torch.nn.RMSNorm)
    assert "output_layer.weight" not in params, "tied embeddings: the output layer reuses the word embeddings"


def test_untied_output_layer(single_rank):
    params = dict(build(dataclasses.replace(PRESETS["tiny"], tie_word_embeddings=False)).named_parameters())
    assert params["output_layer.weight"].shape == params["embedding.word_embeddings.weight"].shape


def test_rope_theta_reaches_megatron(single_rank):
    model = build(dataclasses.replace(PRESETS["tiny"], rope_theta=1e6))
    inv_freq = model.rotary_pos_emb.inv_freq
    d = PRESETS["tiny"].kv_channels
    torch.testing.assert_close(inv_freq, 1.0 / (1e6 ** (torch.arange(0, d, 2, dtype=torch.float32) / d)))


def test_norm_weights_are_tagged_for_sequence_parallel():
    config = qwen.transformer_config(PRESETS["tiny"], Mesh(world=2, tp=2, sequence_parallel=True))
    assert TorchNorm(config, 64).weight.sequence_parallel is True


def test_vocab_padding_does_not_depend_on_tp():
    assert qwen.padded_vocab_size(151665, 128, 1) == 151680
    assert {qwen.padded_vocab_size(151936, 128, tp) for tp in (1, 2, 4, 8)} == {151936}
    assert qwen.padded_vocab_size(1000, 128, 3) == 1152  # 1024 rows would not split over 3 ranks
