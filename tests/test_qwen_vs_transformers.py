"""The Qwen2 spec computes what transformers' Qwen2ForCausalLM computes (fp32 logits), tied and untied."""

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from megatron_ext.mesh import Mesh
from megatron_ext.models import hf_rules
from megatron_ext.models.qwen import hf as qwen_hf
from megatron_ext.models.qwen import model as qwen
from megatron_ext.models.qwen.shape import shape_from_hf_config
from megatron_ext.models.sharding import load_full_state


@pytest.mark.parametrize("tied", [True, False])
def test_logits_match_transformers(single_rank, tmp_path, tied):
    torch.manual_seed(0)
    hf_config = Qwen2Config(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=200, rope_theta=5e5, rms_norm_eps=1e-5,
                            tie_word_embeddings=tied)
    hf_model = Qwen2ForCausalLM(hf_config).eval()
    with torch.no_grad():  # transformers zero-initialises biases and norms: make every tensor matter
        for p in hf_model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    hf_config.save_pretrained(tmp_path)
    shape = shape_from_hf_config(str(tmp_path))

    config = qwen.transformer_config(shape, Mesh(world=1))
    padded = qwen.padded_vocab_size(shape.vocab_size, 128, 1)
    model = qwen.build_qwen(config, shape, vocab_size=padded).eval()
    load_full_state([model], hf_rules.hf_to_mcore(qwen_hf, hf_model.state_dict(), shape))

    tokens = torch.randint(0, shape.vocab_size, (2, 24))
    positions = torch.arange(24).expand(2, 24)
    with torch.no_grad():
        expected = hf_model(tokens).logits
        ours = model(tokens, positions, attention_mask=None)[..., :shape.vocab_size]
    assert ours.shape == expected.shape
    torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-4)
