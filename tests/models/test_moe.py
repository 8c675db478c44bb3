"""Mixture-of-Experts without a launch: flags and their one-line refusals, the layer pattern (HF's decoder_sparse_step
is not megatron-core's moe_layer_freq), per-stage layer specs, active-parameter FLOPs and the router statistics."""

import dataclasses
import json

import pytest

from megatron_ext.arguments import ConfigError, parse
from megatron_ext.models.qwen.shape import PRESETS, MoEShape, moe_layer_pattern, shape_from_hf_config
from megatron_ext.observability.flops import training_flops_per_token


@pytest.mark.parametrize("flags, world, expected", [
    ("--moe-router-topk 2", 1, "--moe-router-topk needs an MoE model"),
    ("--moe-aux-loss-coeff 0.01", 1, "--moe-aux-loss-coeff needs an MoE model"),
    ("--model tiny-moe --moe-router-topk 5", 1, "--moe-router-topk 5 must be between 1 and --num-experts 4"),
    ("--model tiny-moe --moe-layer-freq 1,0,1", 1, "--moe-layer-freq has 3 entries for 4 layers"),
    ("--model tiny-moe --moe-layer-freq 2", 1, "give an explicit 0/1 list"),
    ("--num-experts 1", 1, "--num-experts must be >= 2"),
    ("--model tiny-moe --engine deepspeed", 2, "--engine deepspeed does not run megatron-core's MoE layers"),
    ("--model tiny-moe --lora-rank 4 --lora-targets qkv,fc1 --lora-dropout 0.05", 1,
     "adapters on an MoE model's experts (fc1) take no dropout"),
    ("--model tiny-moe --moe-aux-loss-coeff -1", 1, "--moe-aux-loss-coeff must be >= 0"),
    ("--model tiny-moe --moe-expert-capacity-factor 0", 1, "--moe-expert-capacity-factor must be > 0"),
    ("--model tiny-moe --tensor-model-parallel-size 2 --sequence-parallel --expert-model-parallel-size 2 "
     "--moe-token-dispatcher-type alltoall --distributed-backend gloo", 4, "gloo has no uneven all-gather"),
    ("--model tiny-moe --expert-model-parallel-size 3", 3, "--num-experts 4 is not divisible"),
    ("--model tiny-moe --tensor-model-parallel-size 2", 2, "needs --sequence-parallel"),
    ("--model tiny-moe --tensor-model-parallel-size 2 --sequence-parallel --expert-tensor-parallel-size 1", 2,
     "--expert-tensor-parallel-size 1 differs from --tensor-model-parallel-size 2 only with --expert-model-parallel"),
    ("--moe-grouped-gemm", 1, "--moe-grouped-gemm needs an MoE model"),
    ("--model tiny-moe --moe-ffn-hidden-size 60 --moe-grouped-gemm --bf16", 1,
     "--moe-grouped-gemm: the expert FFN size per expert-TP rank 60 is not a multiple of 8"),
    ("--model tiny-moe --moe-grouped-gemm --tensor-model-parallel-size 2 --sequence-parallel "
     "--expert-model-parallel-size 2 --moe-ffn-hidden-size 70", 4, "expert FFN size per expert-TP rank 35 is not"),
])
def test_bad_moe_flags_are_one_clear_line(flags, world, expected):
    with pytest.raises(ConfigError) as info:
        parse(flags.split(), world_size=world)
    assert expected in str(info.value) and "\n" not in str(info.value)


def test_dispatcher_follows_the_backend():
    """alltoall by default; gloo with expert TP > 1 falls back to allgather (gloo has no uneven all-gather)."""
    tp_sp_ep = "--model tiny-moe --tensor-model-parallel-size 2 --sequence-parallel --expert-model-parallel-size 2"
    run = parse((tp_sp_ep + " --distributed-backend gloo").split(), world_size=4)
    assert run.mesh.etp == 2 and run.moe.dispatcher == "allgather"
    run = parse((tp_sp_ep + " --distributed-backend gloo --expert-tensor-parallel-size 1").split(), world_size=4)
    assert run.mesh.etp == 1 and run.moe.dispatcher == "alltoall"
    run = parse((tp_sp_ep + " --distributed-backend nccl").split(), world_size=4)
    assert run.moe.dispatcher == "alltoall"


def test_moe_flags_shape_the_model():
    run = parse("--model tiny --num-experts 8 --moe-router-topk 1 --moe-ffn-hidden-size 32 "
                "--moe-shared-expert-intermediate-size 16 --moe-layer-freq [0,1,0,1] --moe-aux-loss-coeff 0.01 "
                "--moe-z-loss-coeff 0.001 --moe-expert-capacity-factor 1.5".split(), world_size=1)
    assert run.shape.moe == MoEShape(8, 1, 32, 16, norm_topk_prob=True, layer_pattern=(0, 1, 0, 1))
    assert (run.moe.aux_loss_coeff, run.moe.z_loss_coeff, run.moe.capacity_factor) == (0.01, 0.001, 1.5)
    assert parse("--model tiny-moe --moe-shared-expert-intermediate-size 0".split(), world_size=1) \
        .shape.moe.shared_expert_size is None
    assert parse([], world_size=1).moe is None


def test_hf_sparse_layers_are_not_megatron_layer_freq(tmp_path):
    """HF: layer i is sparse iff (i+1) % decoder_sparse_step == 0 and i is not in mlp_only_layers; megatron-core's
    integer moe_layer_freq N means i % N == 0. The explicit list is what crosses over."""
    assert moe_layer_pattern(dict(num_hidden_layers=4, decoder_sparse_step=2)) == (0, 1, 0, 1)
    assert moe_layer_pattern(dict(num_hidden_layers=4, decoder_sparse_step=1, mlp_only_layers=[0])) == (0, 1, 1, 1)
    config = dict(model_type="qwen2_moe", hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=256, num_experts=4,
                  num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64,
                  norm_topk_prob=True, decoder_sparse_step=2)
    (tmp_path / "config.json").write_text(json.dumps(config))
    moe = shape_from_hf_config(str(tmp_path)).moe
    assert moe == MoEShape(4, 2, 32, 64, norm_topk_prob=True, layer_pattern=(0, 1, 0, 1))


def test_each_pipeline_stage_builds_its_slice_of_the_pattern(single_rank):
    """PP stages take their own slice of the 0/1 pattern, as megatron-core's get_gpt_decoder_block_spec does."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from megatron_ext.mesh import Mesh
    from megatron_ext.models.qwen import model as qwen
    from megatron_ext.models.spec import decoder_block_spec

    shape = dataclasses.replace(PRESETS["tiny-moe"], moe=dataclasses.replace(PRESETS["tiny-moe"].moe,
                                                                              layer_pattern=(0, 1, 1, 0)))
    config = qwen.transformer_config(shape, Mesh(world=1))
    kinds = [spec.submodules.mlp.module is MoELayer for spec in decoder_block_spec(config).layer_specs]
    assert kinds == [False, True, True, False]
    model = qwen.build_qwen(config, shape, vocab_size=256)
    names = dict(model.named_parameters())
    assert "decoder.layers.1.mlp.router.weight" in names and "decoder.layers.0.mlp.linear_fc1.weight" in names
    # MoE layers keep their norm under TE's key; dense layers fold it into fc1's name (checkpoint compatibility).
    keys = {t.key for t in model.sharded_state_dict().values() if hasattr(t, "key")}
    assert "decoder.layers.1.pre_mlp_layernorm.weight" in keys and "decoder.layers.0.pre_mlp_layernorm.weight" \
        not in keys and "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in keys


def test_moe_flops_count_active_parameters():
    """top-k experts of f/k each, no shared expert: the dense model's FLOPs plus the router's."""
    dense = PRESETS["qwen2.5-3b"]
    f, h, layers = dense.ffn_hidden_size, dense.hidden_size, dense.num_layers
    moe = dataclasses.replace(dense, moe=MoEShape(16, 2, f // 2, None, norm_topk_prob=True))
    router = 2 * 3 * layers * h * 16
    assert training_flops_per_token(moe, 4096) == pytest.approx(training_flops_per_token(dense, 4096) + router)
    shared = dataclasses.replace(moe, moe=dataclasses.replace(moe.moe, shared_expert_size=f))
    assert training_flops_per_token(shared, 4096) > training_flops_per_token(moe, 4096)
    half = dataclasses.replace(moe, moe=dataclasses.replace(moe.moe, layer_pattern=(1, 0) * (layers // 2)))
    assert training_flops_per_token(half, 4096) == pytest.approx(training_flops_per_token(dense, 4096) + router / 2)


def test_router_stats_summary():
    """Load is tokens per expert over the balanced share: min/max over layers and experts, CV per layer averaged;
    dropped tokens with a capacity factor; the aux loss averaged over DP, micro-batches and MoE layers."""
    import unittest.mock as mock
    from types import SimpleNamespace

    from megatron_ext.models import moe

    stats = SimpleNamespace(num_layers=2, num_experts=4, topk=2, num_microbatches=1, capacity=True, model_scope=False)
    # Layer 0: 8 routed slots of 4 tokens, perfectly balanced; layer 1: unbalanced, 2 slots dropped.
    values = [2, 2, 2, 2, 4, 4, 2, 0, 0, 4] + [1.0, 1.2] + [0.0, 0.0]
    with mock.patch("megatron.core.parallel_state.get_data_parallel_world_size", return_value=1), \
            mock.patch("megatron.core.parallel_state.get_pipeline_model_parallel_world_size", return_value=1), \
            mock.patch("torch.distributed.get_world_size", return_value=1):
        summary = moe.RouterStats.summarise(stats, values)
    loads = [4 / 1.5, 2 / 1.5, 0.0, 0.0]  # layer 1: 6 routed over 4 experts
    assert summary["moe_load_min"] == 0.0 and summary["moe_load_max"] == pytest.approx(loads[0])
    assert summary["moe_load_cv"] == pytest.approx((sum((x - 1) ** 2 for x in loads) / 4) ** 0.5 / 2)
    assert summary["moe_dropped"] == pytest.approx(2 / 16)
    assert summary["moe_aux_loss"] == pytest.approx(1.1) and "moe_z_loss" not in summary
