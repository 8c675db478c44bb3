"""The Qwen2 spec computes what transformers' Qwen2ForCausalLM computes (fp32 logits), tied and untied."""

import pytest
import torch

from megatron_ext.mesh import Mesh
from megatron_ext.models import hf_rules
from megatron_ext.models.qwen import hf as qwen_hf
from megatron_ext.models.qwen import model as qwen
from megatron_ext.models.qwen.shape import shape_from_hf_config
from megatron_ext.models.sharding import load_full_state
from support import hf_fixtures


@pytest.mark.parametrize("tied", [True, False])
def test_logits_match_transformers(single_rank, tmp_path, tied):
    hf_model = hf_fixtures.random_qwen(tied=tied, vocab=200, seed=0, num_hidden_layers=2, intermediate_size=96,
                                       rope_theta=5e5, rms_norm_eps=1e-5).eval()
    hf_model.config.save_pretrained(tmp_path)
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
