"""Qwen3 and Qwen3-MoE, offline, fp32, in this process: the shapes read from published configs, logits equal to
transformers' Qwen3ForCausalLM / Qwen3MoeForCausalLM on one rank (a left-out query/key norm must fail), conversion
both ways bit-exact with the dtype kept, the export loaded by transformers, a dense Qwen3 upcycled into a
Qwen3-MoE, and what cannot be built refused in one line. Meshes (TP2, PP2, CP2, EP2): tests/convert/test_pretrained.py's
launch; training parity: tests/training/test_parity_megatron.py's qwen3 layouts."""

import json
import math

import pytest
import torch

from support import hf_fixtures
from support.ranks import run_script, run_tool
from support.step_checks import worst

TOL = 1e-4


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3")
    return {"root": root,
            "dense": hf_fixtures.make_qwen3(root / "dense", vocab=200),
            "tied": hf_fixtures.make_qwen3(root / "tied", tied=True, vocab=200, seed=7),
            "moe": hf_fixtures.make_qwen3(root / "moe", moe=True, vocab=200, seed=8)}


@pytest.mark.parametrize("name, preset", [("Qwen/Qwen3-0.6B", "qwen3-0.6b"), ("Qwen/Qwen3-8B", "qwen3-8b"),
                                          ("Qwen/Qwen3-30B-A3B", "qwen3-30b-a3b")])
def test_presets_are_the_published_configs(tmp_path, name, preset):
    from megatron_ext.models.qwen.shape import PRESETS, shape_from_hf_config

    (tmp_path / "config.json").write_text(json.dumps(hf_fixtures.PUBLISHED[name]))
    shape = shape_from_hf_config(str(tmp_path))
    assert shape == PRESETS[preset] and shape.kv_channels == 128 and shape.model_type == \
        hf_fixtures.PUBLISHED[name]["model_type"]
    assert (shape.qk_norm, shape.qkv_bias) == (True, False)
    if shape.moe:
        assert (shape.moe.num_experts, shape.moe.topk, shape.moe.shared_expert_size, shape.moe.norm_topk_prob) == \
            (128, 8, None, True)


def logits_of(hf_dir, shape, tokens, drop_qk_norm: bool = False):
    from megatron_ext.models import hf_rules
    from megatron_ext.models.qwen import hf as qwen_hf
    from megatron_ext.mesh import Mesh
    from megatron_ext.models.qwen import model as qwen
    from megatron_ext.models.sharding import load_full_state

    config = qwen.transformer_config(shape, Mesh(world=1))
    model = qwen.build_qwen(config, shape, vocab_size=qwen.padded_vocab_size(shape.vocab_size, 128, 1)).eval()
    state = hf_rules.hf_to_mcore(qwen_hf, hf_fixtures.tensors(hf_dir), shape)
    if drop_qk_norm:  # the planted mistake: the norms left at their initial ones
        state = {k: torch.ones_like(v) if "_layernorm" in k and "self_attention" in k else v for k, v in state.items()}
    load_full_state([model], state)
    with torch.no_grad():
        return model(tokens, torch.arange(tokens.shape[1]).expand_as(tokens), attention_mask=None)[
            ..., :shape.vocab_size]


@pytest.mark.parametrize("kind", ["dense", "tied", "moe"])
def test_logits_match_transformers_and_a_left_out_norm_fails(single_rank, sources, kind):
    from transformers import AutoModelForCausalLM

    from megatron_ext.models.qwen.shape import shape_from_hf_config

    shape = shape_from_hf_config(str(sources[kind]))
    assert shape.kv_channels == 32 != shape.hidden_size // shape.num_attention_heads
    tokens = torch.randint(0, shape.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(sources[kind]).eval()(tokens).logits
    assert (logits_of(sources[kind], shape, tokens) - expected).abs().max().item() < TOL
    assert (logits_of(sources[kind], shape, tokens, drop_qk_norm=True) - expected).abs().max().item() > 100 * TOL


@pytest.mark.parametrize("kind, dtype", [("dense", torch.float32), ("tied", torch.bfloat16), ("moe", torch.bfloat16)])
def test_round_trip_is_bit_exact_keeps_the_dtype_and_loads_in_transformers(sources, tmp_path, kind, dtype):
    from transformers import AutoModelForCausalLM

    source = sources[kind]
    if dtype != torch.float32:
        AutoModelForCausalLM.from_pretrained(source, dtype=dtype).save_pretrained(tmp_path / "src")
        source = tmp_path / "src"
    run_tool("convert_hf_to_mcore", "--hf-path", source, "--save", tmp_path / "mcore")
    run_tool("convert_mcore_to_hf", "--load", tmp_path / "mcore", "--save", tmp_path / "back")
    original, exported = hf_fixtures.tensors(source), hf_fixtures.tensors(tmp_path / "back")
    assert sorted(exported) == sorted(original)
    assert any(".q_norm." in n for n in original) and not any(".bias" in n for n in original)
    assert all(exported[n].dtype == dtype and torch.equal(exported[n], original[n]) for n in original)
    assert json.load(open(tmp_path / "back" / "config.json")) == json.load(open(source / "config.json"))
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "back")
    assert type(model).__name__ == ("Qwen3MoeForCausalLM" if kind == "moe" else "Qwen3ForCausalLM")


def test_configs_from_the_shape_alone_are_transformers_own(single_rank):
    """A run from a preset (no recorded config.json) exports Qwen3's config, which rebuilds the same shape."""
    from megatron_ext.models.qwen.hf import hf_config, shape_from_config
    from megatron_ext.models.qwen.shape import PRESETS

    for name in ("tiny-qwen3", "tiny-qwen3-moe", "qwen3-30b-a3b"):
        config = hf_config(PRESETS[name], {}, torch.bfloat16)
        assert config["architectures"] == [{"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}[
            PRESETS[name].model_type]] and config["dtype"] == "bfloat16"
        assert shape_from_config(config) == PRESETS[name]


def test_a_dense_qwen3_upcycles_into_a_qwen3_moe_with_the_same_logits(sources, tmp_path):
    from transformers import AutoModelForCausalLM

    run_tool("upcycle_moe", "--load", sources["dense"], "--save", tmp_path / "moe", "--num-experts", "4",
             "--moe-router-topk", "2", "--granularity", "2")
    upcycled = AutoModelForCausalLM.from_pretrained(tmp_path / "moe").eval()
    assert type(upcycled).__name__ == "Qwen3MoeForCausalLM" and not any("shared" in n for n, _ in
                                                                      upcycled.named_parameters())
    tokens = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        dense = AutoModelForCausalLM.from_pretrained(sources["dense"]).eval()(tokens).logits
        assert (upcycled(tokens).logits - dense).abs().max().item() < TOL
    from megatron_ext.errors import ConfigError

    with pytest.raises(ConfigError, match="Qwen3-MoE has no shared expert"):
        run_tool("upcycle_moe", "--load", sources["dense"], "--save", tmp_path / "x", "--num-experts", "4",
                 "--shared-expert-size", "32")


@pytest.mark.parametrize("field, value", [("attention_bias", True), ("use_sliding_window", True)])
def test_configs_we_cannot_build_are_one_line(tmp_path, field, value):
    from megatron_ext.errors import ConfigError
    from megatron_ext.models.qwen.shape import shape_from_hf_config

    (tmp_path / "config.json").write_text(json.dumps({**hf_fixtures.PUBLISHED["Qwen/Qwen3-8B"], field: value}))
    with pytest.raises(ConfigError, match=f"{field} is true") as error:
        shape_from_hf_config(str(tmp_path))
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("field", ["rope_scaling", "rope_parameters"])
def test_rope_scaling_is_one_line_and_plain_rope_builds(tmp_path, field):
    """YaRN (Qwen3's long-context recipe, in either transformers' spelling) is refused; "default" is plain RoPE."""
    from megatron_ext.errors import ConfigError
    from megatron_ext.models.qwen.shape import shape_from_hf_config

    published = hf_fixtures.PUBLISHED["Qwen/Qwen3-8B"]
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768, "rope_theta": 1e6}
    (tmp_path / "config.json").write_text(json.dumps({**published, field: yarn}))
    with pytest.raises(ConfigError, match="RoPE scaling 'yarn'") as error:
        shape_from_hf_config(str(tmp_path))
    assert "\n" not in str(error.value)
    (tmp_path / "config.json").write_text(json.dumps({**published, field: {"rope_type": "default", "rope_theta": 1e6}}))
    assert shape_from_hf_config(str(tmp_path)).rope_theta == published.get("rope_theta", 1e6)


@pytest.mark.parametrize("script, flags, message", [
    ("pretrain_vit.py", [], "is a 'qwen3' model; pretrain_vit.py takes vit"),
    ("finetune_qwen.py", ["--model", "qwen2.5-0.5b"], "--model qwen2.5-0.5b is not the model of --pretrained"),
    ("finetune_qwen.py", ["--tensor-model-parallel-size", "16"], "8 key/value groups (GQA) do not divide over"),
])
def test_mixed_up_families_and_meshes_exit_2_in_one_line(sources, script, flags, message):
    proc = run_script([script, "--pretrained", "Qwen/Qwen3-8B", "--mock-data", *flags],
                      env=dict(WORLD_SIZE="16" if "16" in flags else "1"))
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert message in lines[-1] and len(lines) == 1, proc.stderr[-2000:]


def per_expert(tensors: dict) -> dict:
    """transformers 5's in-memory fused experts (gate_up_proj [E, 2I, H], down_proj [E, H, I]) as the per-expert
    tensors of the files."""
    out = {}
    for name, t in tensors.items():
        prefix, _, kind = name.rpartition(".experts.")
        if kind == "gate_up_proj":
            for e, (gate, up) in enumerate(zip(*t.chunk(2, dim=1))):
                out[f"{prefix}.experts.{e}.gate_proj.weight"], out[f"{prefix}.experts.{e}.up_proj.weight"] = gate, up
        elif kind == "down_proj":
            out.update({f"{prefix}.experts.{e}.down_proj.weight": d for e, d in enumerate(t)})
        else:
            out[name] = t
    return out


@pytest.mark.parametrize("scope", ["model", "model_recompute", "layer"])
def test_model_scope_load_balancing_loss_is_transformers(single_rank, sources, scope):
    """--moe-aux-loss-scope model on the tiny Qwen3-MoE (three MoE layers, a padded row): the loss is transformers'
    load_balancing_loss_func over every layer's routing, with padding left out, and each gradient equals that of
    transformers' mean token loss + router_aux_loss_coef * aux_loss (fp32, 1e-5), with full activation recomputation
    too (the counts then come from the no-grad first pass). megatron-core's per-layer loss (scope layer) gives other
    router gradients."""
    from transformers import AutoModelForCausalLM

    from megatron_ext.models import hf_rules

    from megatron_ext.models.qwen import hf as qwen_hf
    from support import engines
    from megatron_ext.objectives.sft import forward_step
    from megatron_ext.models.moe import RouterStats
    from megatron_ext.mesh import Mesh
    from megatron_ext.models.qwen import model as qwen
    from megatron_ext.models.moe_flags import MoESettings
    from megatron_ext.models.qwen.shape import shape_from_hf_config
    from megatron_ext.models.sharding import global_named_parameters, load_full_state
    from megatron_ext.models.spec import Recompute

    coeff, seq = 0.05, 16
    shape = shape_from_hf_config(str(sources["moe"]))
    ids = torch.randint(0, shape.vocab_size, (2, seq), generator=torch.Generator().manual_seed(3))
    valid = torch.ones(2, seq, dtype=torch.bool)
    valid[1, 11:] = False  # the second row's last five tokens are padding
    hf = AutoModelForCausalLM.from_pretrained(sources["moe"], output_router_logits=True, router_aux_loss_coef=coeff)
    out = hf(input_ids=ids, attention_mask=valid.long(), labels=ids.masked_fill(~valid, -100))
    out.loss.backward()
    hf_grads = hf_rules.hf_to_mcore(qwen_hf, per_expert({n: p.grad for n, p in hf.named_parameters()}), shape)

    recompute = dict(recompute=Recompute("full")) if scope.endswith("recompute") else {}
    config = qwen.transformer_config(shape, Mesh(world=1), moe_settings=MoESettings(
        aux_loss_coeff=coeff, aux_loss_scope=scope.split("_")[0], grouped_gemm=False), **recompute)
    model = qwen.build_qwen(config, shape, vocab_size=qwen.padded_vocab_size(shape.vocab_size, 128, 1))
    load_full_state([model], hf_rules.hf_to_mcore(qwen_hf, hf_fixtures.tensors(sources["moe"]), shape))
    engine = engines.build([model], torch.device("cpu"), forward_step, Mesh(world=1), micro_batch_size=2,
                           seq_length=seq, lr=0.0)
    labels = torch.cat([ids[:, 1:], ids[:, :1]], dim=1)
    loss_mask = (valid & torch.cat([valid[:, 1:], torch.zeros(2, 1, dtype=torch.bool)], dim=1)).float()
    stats = RouterStats([model], shape.num_layers, num_microbatches=1)  # what the run logs
    loss = engine.forward_backward([dict(tokens=ids, labels=labels, loss_mask=loss_mask, padding_mask=~valid,
                                         position_ids=torch.arange(seq).expand(2, seq))])
    aux = stats()["moe_aux_loss"]
    grads = {g: p.main_grad for g, _, p in global_named_parameters(model)}
    routers = [g for g in grads if g.endswith("router.weight")]
    assert len(routers) == 3
    diffs = [(grads[g] - hf_grads[g]).abs().max().item() for g in routers]
    assert all(math.isfinite(d) for d in diffs), diffs  # (a NaN would pass "> 1e-4" below and slip past max())
    router_diff = worst(diffs)
    if scope == "layer":
        assert router_diff > 1e-4
        return
    assert abs(loss - (out.loss.item() - coeff * out.aux_loss.item())) < 1e-5
    assert abs(aux - out.aux_loss.item()) < 1e-5 * out.aux_loss.item()  # the logged moe_aux_loss
    assert router_diff < 1e-5 and all((grads[g] - hf_grads[g][:grads[g].shape[0]]).abs().max() < 1e-5
                                      for g in grads), max(grads, key=lambda g: (grads[g] - hf_grads[g][
                                          :grads[g].shape[0]]).abs().max().item())


def test_generation_stops_at_qwen3s_end_of_turn():
    """In-run generation and tools/eval_math.py stop at the end of turn Qwen3's template closes answers with (its
    answer after the reasoning is scored: tests/evaluation/test_eval_math.py)."""
    import os

    from megatron_ext.data import chat, sft
    from megatron_ext.evaluation import math_eval

    tokenizer = sft.load_tokenizer(os.path.join(hf_fixtures.REPO, "examples", "tokenizers", "tiny-qwen3"))
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert chat.turn_end(tokenizer) == end and end in math_eval.stop_ids(tokenizer)
