"""The ViT on megatron-core (models/vit/model.py) computes what transformers' ViTForImageClassification computes.

A tiny HF ViT (4 heads, distinct q/k/v, random weights, saved with save_pretrained so the on-disk names are the
real ones) is converted with the ViT table (models/vit/hf.py) and loaded into a one-process megatron-core ViT: logits
must agree within 1e-4 (fp32). Fusing QKV naively ([Q; K; V] instead of per head) must be caught.
"""

import pytest
import torch

from support import hf_fixtures

from megatron_ext.mesh import Mesh
from megatron_ext.models.vit import model as vit

SHAPE = vit.VIT_PRESETS["tiny"]


def hf_vit(tmp_path, num_labels=10):
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(hidden_size=SHAPE.hidden_size, num_hidden_layers=SHAPE.num_layers,
                       num_attention_heads=SHAPE.num_attention_heads, intermediate_size=SHAPE.ffn_hidden_size,
                       image_size=SHAPE.image_size, patch_size=SHAPE.patch_size, num_labels=num_labels)
    torch.manual_seed(0)
    model = ViTForImageClassification(config).eval()
    with torch.no_grad():  # HF initialises biases, norms and the class token trivially: make every tensor count
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.02)
    model.save_pretrained(tmp_path)
    return model, hf_fixtures.tensors(tmp_path)


def ours(state, num_labels=10):
    from megatron_ext import parallel

    parallel.init_model_parallel(Mesh(world=1), seed=0)
    model = vit.ViTClassifier(vit.transformer_config(SHAPE, Mesh(world=1)), SHAPE, num_labels).eval()
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all(name.endswith("_extra_state") for name in missing), (missing, unexpected)
    return model


def test_logits_match_transformers(single_rank, tmp_path):
    from megatron_ext.models import hf_rules
    from megatron_ext.models.vit import hf as convert

    hf, saved = hf_vit(tmp_path)
    assert "vit.encoder.layer.0.attention.attention.query.weight" in saved  # the legacy on-disk names
    pixels = torch.randn(3, 3, SHAPE.image_size, SHAPE.image_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(pixel_values=pixels).logits
        actual = ours(hf_rules.hf_to_mcore(convert, saved, SHAPE))(pixels)
    assert actual.shape == expected.shape == (3, 10)
    assert (actual - expected).abs().max().item() < 1e-4

    naive = hf_rules.hf_to_mcore(convert, saved, SHAPE)
    for kind in ("weight", "bias"):
        prefix = "vit.encoder.layer.{i}.attention.attention"
        for i in range(SHAPE.num_layers):
            naive[f"decoder.layers.{i}.self_attention.linear_qkv.{kind}"] = torch.cat(
                [saved[f"{prefix.format(i=i)}.{p}.{kind}"] for p in ("query", "key", "value")])
    with torch.no_grad():
        wrong = ours(naive)(pixels)
    assert (wrong - expected).abs().max().item() > 1e-2


def test_sequence_parallel_is_refused():
    from megatron_ext.errors import ConfigError

    with pytest.raises(ConfigError, match="--sequence-parallel is not supported for ViT: its 17 tokens"):
        vit.transformer_config(SHAPE, Mesh(world=2, tp=2, sequence_parallel=True))


def test_shape_from_hf_config(tmp_path):
    from transformers import ViTConfig

    from megatron_ext.errors import ConfigError

    ViTConfig(hidden_size=1280, num_hidden_layers=32, num_attention_heads=16, intermediate_size=5120,
              patch_size=14, image_size=224).save_pretrained(tmp_path)
    shape = vit.vit_shape_from_hf_config(str(tmp_path))
    assert shape == vit.VIT_PRESETS["vit-huge-14"] and shape.seq_length == 257
    (tmp_path / "config.json").write_text('{"model_type": "qwen2"}')
    with pytest.raises(ConfigError, match="model_type is 'qwen2', expected 'vit'"):
        vit.vit_shape_from_hf_config(str(tmp_path))


def test_logits_match_transformers_under_tp2_and_pp2(tmp_path):
    from support.ranks import run_ranks

    hf, _ = hf_vit(tmp_path / "hf")
    pixels = torch.randn(2, 3, SHAPE.image_size, SHAPE.image_size, generator=torch.Generator().manual_seed(2))
    torch.save(pixels, tmp_path / "pixels.pt")
    run_ranks(2, ["tests/support/vit_worker.py", str(tmp_path / "hf"), str(tmp_path / "pixels.pt"), str(tmp_path / "out.pt")])
    with torch.no_grad():
        expected = hf(pixel_values=pixels).logits
    out = torch.load(tmp_path / "out.pt")
    assert sorted(out) == ["pp2", "tp2"], sorted(out)
    for layout, logits in out.items():
        assert logits.shape == expected.shape and (logits - expected).abs().max().item() < 1e-4, layout
