"""HF <-> megatron-core conversion of Qwen2-MoE (tools/convert_*.py), offline, fp32.

A random tiny Qwen2MoeForCausalLM in the tiny-moe shape (4 experts, top-2, gated shared expert, softmax-then-top-k)
and a variant with renormalised top-k and a dense layer in the pattern (mlp_only_layers) are converted once. The
checkpoints must give transformers' logits and export back bit for bit (fp32 and bf16, config.json included); a
wrong expert mapping (gate/up swapped, experts permuted) must fail the same comparison, so it has teeth. Expert
parallelism (EP2, EP4, TP2+SP x EP2, PP2 x EP2) is checked in test_convert_qwen.py's torchrun launch: one launch for
both families, as each costs ~8 s of imports per rank.
"""

import dataclasses
import json

import pytest
import torch

from support.ranks import run_tool
from support import hf_fixtures
from support.hf_fixtures import tensors as hf_tensors

TOL = 1e-4
CONFIGS = {"tiny_moe": dict(norm_topk_prob=False, mlp_only_layers=[]),
           "renorm_mixed": dict(norm_topk_prob=True, mlp_only_layers=[1])}


def make_hf_moe_model(path, norm_topk_prob=False, mlp_only_layers=(), dtype=torch.float32):
    """The tiny-moe preset as a transformers model; the router gets a larger spread so no token sits on a top-k
    tie."""
    hf_fixtures.make_qwen(path, "Qwen2Moe", dtype=dtype, shard=None, tokenizer=False, vocab=256, seed=3,
                          router_scale=0.3, norm_topk_prob=norm_topk_prob, mlp_only_layers=list(mlp_only_layers),
                          bos_token_id=None, eos_token_id=None)


@pytest.fixture(scope="module")
def converted_moe(tmp_path_factory):
    root = tmp_path_factory.mktemp("convert_moe")
    for kind, settings in CONFIGS.items():
        make_hf_moe_model(root / f"hf_{kind}", **settings)
        run_tool("convert_hf_to_mcore", "--hf-path", root / f"hf_{kind}", "--save", root / f"mcore_{kind}")
    return {kind: (root / f"hf_{kind}", root / f"mcore_{kind}") for kind in CONFIGS}


def hf_logits(hf_dir, tokens):
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        return AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()(tokens).logits


def sample_tokens(shape):
    from support.convert_worker import BATCH, SEQ

    return torch.randint(0, shape.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))


def test_shapes_are_read_from_the_hf_configs(converted_moe):
    from megatron_ext.models.qwen.shape import PRESETS, shape_from_hf_config

    assert shape_from_hf_config(str(converted_moe["tiny_moe"][0])) == PRESETS["tiny-moe"]
    mixed = shape_from_hf_config(str(converted_moe["renorm_mixed"][0])).moe
    assert mixed.norm_topk_prob and mixed.layer_pattern == (1, 0, 1, 1)


@pytest.mark.parametrize("kind", CONFIGS)
def test_logits_match_transformers(single_rank, converted_moe, kind):
    """The converted checkpoint, loaded as the tools' users load it (dist-checkpoint, pipeline schedule)."""
    from support.convert_worker import megatron_logits

    from megatron_ext.mesh import Mesh
    from megatron_ext.models.qwen.shape import shape_from_hf_config

    hf, mcore = converted_moe[kind]
    shape = shape_from_hf_config(str(hf))
    tokens = sample_tokens(shape)
    diff = (megatron_logits(str(mcore), Mesh(world=1), shape, tokens) - hf_logits(hf, tokens)).abs().max().item()
    print(f"{kind}: max |logits - transformers| = {diff:.2e}")
    assert diff < TOL


def _swap_gate_up(state, name):
    if ".experts.local_experts." in name and name.endswith("linear_fc1.weight"):
        gate, up = state[name].chunk(2)
        state[name] = torch.cat([up, gate])


def _permute_experts(state, name):
    if ".experts.local_experts.0." in name:
        other = name.replace(".local_experts.0.", ".local_experts.1.")
        state[name], state[other] = state[other], state[name]


@pytest.mark.parametrize("wrong", [None, _swap_gate_up, _permute_experts], ids=["right", "gate_up", "permuted"])
def test_a_wrong_expert_mapping_fails_the_logits_comparison(single_rank, converted_moe, wrong):
    from megatron_ext.mesh import Mesh
    from megatron_ext.models import hf_rules
    from megatron_ext.models.qwen import hf as qwen_hf
    from megatron_ext.models.qwen import model as qwen
    from megatron_ext.models.qwen.shape import shape_from_hf_config
    from megatron_ext.models.sharding import load_full_state

    hf = converted_moe["tiny_moe"][0]
    shape = shape_from_hf_config(str(hf))
    state = hf_rules.hf_to_mcore(qwen_hf, hf_tensors(hf), shape)
    for name in list(state):
        if wrong:
            wrong(state, name)
    model = qwen.build_qwen(qwen.transformer_config(shape, Mesh(world=1)), shape,
                            vocab_size=qwen.padded_vocab_size(shape.vocab_size, 128, 1)).eval()
    load_full_state([model], state)
    tokens = sample_tokens(shape)
    with torch.no_grad():
        ours = model(tokens, torch.arange(tokens.shape[1])[None], attention_mask=None)[..., :shape.vocab_size]
    diff = (ours - hf_logits(hf, tokens)).abs().max().item()
    print(f"{getattr(wrong, '__name__', 'right')}: max |logits - transformers| = {diff:.2e}")
    assert diff < TOL if wrong is None else diff > 100 * TOL


@pytest.mark.parametrize("kind", CONFIGS)
def test_round_trip_reproduces_every_tensor_and_the_config(converted_moe, kind, tmp_path):
    hf, mcore = converted_moe[kind]
    run_tool("convert_mcore_to_hf", "--load", mcore, "--save", tmp_path, "--max-shard-size", "200KB")
    original, exported = hf_tensors(hf), hf_tensors(tmp_path)
    assert sorted(exported) == sorted(original)
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in exported  # per expert, as on disk
    assert all(exported[n].dtype == torch.float32 and torch.equal(exported[n], original[n]) for n in original)
    assert json.load(open(tmp_path / "config.json")) == json.load(open(hf / "config.json"))


def test_round_trip_keeps_a_bf16_source_bf16(tmp_path):
    make_hf_moe_model(tmp_path / "bf16", **CONFIGS["renorm_mixed"], dtype=torch.bfloat16)
    run_tool("convert_hf_to_mcore", "--hf-path", tmp_path / "bf16", "--save", tmp_path / "mcore")
    run_tool("convert_mcore_to_hf", "--load", tmp_path / "mcore", "--save", tmp_path / "back")
    original, exported = hf_tensors(tmp_path / "bf16"), hf_tensors(tmp_path / "back")
    assert sorted(exported) == sorted(original)
    assert all(exported[n].dtype == torch.bfloat16 and torch.equal(exported[n], original[n]) for n in original)
    assert json.load(open(tmp_path / "back" / "config.json")) == json.load(open(tmp_path / "bf16" / "config.json"))


def test_an_moe_without_shared_expert_is_refused_before_writing(single_rank, tmp_path):
    """Qwen2MoeForCausalLM always has a shared expert: such a model has no Hugging Face class to go to."""
    from megatron.core import dist_checkpointing

    from megatron_ext.models.qwen.build import single_process as single_process_qwen
    from megatron_ext.errors import ConfigError
    from megatron_ext.models.qwen.shape import PRESETS

    shape = PRESETS["tiny-moe"]
    shape = dataclasses.replace(shape, moe=dataclasses.replace(shape.moe, shared_expert_size=None))
    model = single_process_qwen(shape, torch.float32)
    (tmp_path / "mcore").mkdir()
    dist_checkpointing.save({"model": model.sharded_state_dict(), "model_shape": dataclasses.asdict(shape),
                             "model_type": "qwen2_moe", "params_dtype": "torch.float32"}, str(tmp_path / "mcore"))
    with pytest.raises(ConfigError, match="no shared expert") as error:
        run_tool("convert_mcore_to_hf", "--load", tmp_path / "mcore", "--save", tmp_path / "hf")
    assert "\n" not in str(error.value) and not (tmp_path / "hf").exists()


def test_configs_of_models_made_moe_by_flags():
    """A dense --hf-config trained with --num-experts, and a preset with no HF config at all, export as Qwen2-MoE
    with the shape's MoE fields; a record without model_type (older checkpoints) finds its family by the shape."""
    from transformers import Qwen2Config, Qwen2MoeConfig

    from megatron_ext.models import families
    from megatron_ext.models.qwen.hf import hf_config
    from megatron_ext.models.qwen.shape import PRESETS

    shape = dataclasses.replace(PRESETS["tiny-moe"], moe=dataclasses.replace(
        PRESETS["tiny-moe"].moe, norm_topk_prob=True, layer_pattern=(0, 1, 1, 0)))
    dense = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=256).to_dict()
    for record in ({"hf_config": dense}, {}):
        config = Qwen2MoeConfig.from_dict(hf_config(shape, record, torch.bfloat16))
        assert (config.model_type, config.architectures, config.dtype) == \
            ("qwen2_moe", ["Qwen2MoeForCausalLM"], torch.bfloat16)
        assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size,
                config.shared_expert_intermediate_size, config.norm_topk_prob) == (4, 2, 64, 64, True)
        assert (config.decoder_sparse_step, config.mlp_only_layers) == (1, [0, 3])
    for model_shape, label in ((dataclasses.asdict(shape), "Qwen2-MoE"),
                               ({k: v for k, v in dataclasses.asdict(PRESETS["tiny"]).items() if k != "moe"}, "Qwen2")):
        family, found = families.from_record({"model_shape": model_shape}, "--load x")
        assert family.label == label and found.moe == (shape.moe if label == "Qwen2-MoE" else None)
