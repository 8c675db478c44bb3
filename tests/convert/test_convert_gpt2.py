"""HF GPT-2 <-> megatron-core through the family-generic tools, offline. The converted checkpoint's logits under
TP1, TP2, PP2, TP2 x PP2 and PP2 x VPP2 are checked in test_convert_qwen.py's launch (one torchrun for every
family); here: the same logits in one process, the two easy mistakes (c_attn not regrouped per head, a Conv1D not
transposed) caught, fp32 and bf16 round trips bit-exact with the dtype kept, OpenAI's original checkpoint layout."""

import json

import pytest
import torch
from safetensors.torch import save_file

from support.hf_fixtures import tensors
from support.ranks import run_tool
from megatron_ext.models.gpt2.shape import GPT2Shape

SHAPE = GPT2Shape(64, 4, 4, vocab_size=300, max_position_embeddings=128)
TOL = 1e-4


def make_hf_gpt2(path, dtype=torch.float32, seed=0):
    """A random GPT2LMHeadModel of SHAPE saved with save_pretrained; weights large enough that mistakes show."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from megatron_ext.models.gpt2.hf import config_fields

    torch.manual_seed(seed)
    config = GPT2Config(**config_fields(SHAPE), resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.3)
    model.to(dtype).save_pretrained(path)
    return model


def logits(model, tokens):
    with torch.no_grad():
        return model(tokens, torch.arange(tokens.shape[1])[None], attention_mask=None)[..., :SHAPE.vocab_size]


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt2")
    return root / "hf", make_hf_gpt2(root / "hf")


def test_single_process_logits_and_the_mistakes_they_catch(single_rank, hf, monkeypatch):
    from megatron_ext.models import hf_rules
    from megatron_ext.models.gpt2 import hf as gpt2
    from megatron_ext.models.gpt2.build import single_process as single_process_gpt2

    path, reference = hf
    tokens = torch.randint(0, SHAPE.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(tokens).logits
    state = {k: v for k, v in tensors(path).items() if not gpt2.ignorable(k, SHAPE)}

    def max_diff():
        model = single_process_gpt2(SHAPE, torch.float32).eval()
        model.load_state_dict(hf_rules.hf_to_mcore(gpt2, state, SHAPE))
        return (logits(model, tokens) - expected).abs().max().item()

    assert max_diff() < TOL
    monkeypatch.setattr(gpt2, "fuse_qkv", lambda q, k, v, shape: torch.cat([q, k, v]))  # [Q; K; V], not per head
    assert max_diff() > 0.1
    monkeypatch.undo()
    proj = next(r for r in gpt2.RULES if r.mcore.endswith("linear_proj.weight"))
    untransposed = [r if r is not proj else type(r)(r.mcore, r.hf) for r in gpt2.RULES]
    monkeypatch.setattr(gpt2, "RULES", untransposed)  # c_proj's [in, out] weight loaded as [out, in]
    assert max_diff() > 0.1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_is_bit_exact_and_keeps_the_dtype(hf, dtype, tmp_path):
    from transformers import GPT2LMHeadModel

    source = hf[0]
    if dtype == torch.bfloat16:
        source = tmp_path / "bf16"
        GPT2LMHeadModel.from_pretrained(hf[0], dtype=dtype).save_pretrained(source)
    run_tool("convert_hf_to_mcore", "--hf-path", source, "--save", tmp_path / "mcore")
    run_tool("convert_mcore_to_hf", "--load", tmp_path / "mcore", "--save", tmp_path / "back")
    original, exported = tensors(source), tensors(tmp_path / "back")
    assert sorted(exported) == sorted(original) and "lm_head.weight" not in exported
    assert all(t.dtype == dtype and torch.equal(t, original[name]) for name, t in exported.items())
    assert json.load(open(tmp_path / "back" / "config.json")) == json.load(open(source / "config.json"))
    model = GPT2LMHeadModel.from_pretrained(tmp_path / "back", dtype="auto")
    assert model.dtype == dtype


def test_openai_original_layout_converts(hf, tmp_path):
    """openai-community/gpt2's own file: no ``transformer.`` prefix, causal-mask buffers ``h.{i}.attn.bias``."""
    source = tmp_path / "openai"
    source.mkdir()
    state = {k.removeprefix("transformer."): v for k, v in tensors(hf[0]).items()}
    for i in range(SHAPE.num_layers):
        state[f"h.{i}.attn.bias"] = torch.tril(torch.ones(1, 1, 128, 128))
    save_file(state, source / "model.safetensors")
    (source / "config.json").write_text((hf[0] / "config.json").read_text())
    run_tool("convert_hf_to_mcore", "--hf-path", source, "--save", tmp_path / "mcore")
    run_tool("convert_mcore_to_hf", "--load", tmp_path / "mcore", "--save", tmp_path / "back")
    exported = tensors(tmp_path / "back")
    assert all(torch.equal(exported[f"transformer.{k}"], v) for k, v in state.items() if not k.endswith("attn.bias"))
