"""``--compile-layers`` (``models/spec.compile_layers``): each dense transformer layer compiled in place, one graph
each, trains as eager does (two steps of the megatron engine, fp32, one CPU rank; FSDP2 too), under full recompute
and LoRA, with MoE layers left eager, and the checkpoint keys unchanged. (Selective recompute also matches, but
megatron-core's checkpoint of core attention reads the RNG state: two graph breaks per layer.) On CPU the layers compile with the "aot_eager" backend
(TorchDynamo's graph capture and AOTAutograd's joint graph, without Inductor's C++ codegen, which takes ~20 s
here); Inductor runs on the GPU."""

import dataclasses
import gc

import pytest
import torch

from megatron_ext.config.training import Fusions
from megatron_ext.models import spec


def _train(monkeypatch, compile_backend=None, shape_name="tiny", recompute=spec.Recompute(), lora=False,
           engine_name="megatron"):
    """Two optimizer steps; returns (losses, the first step's main gradients, state_dict keys before and after the
    engine, layers compiled). (The second step's gradients differ in low bits: Adam's first update, g / |g| for each
    element, turns last-bit differences of near-zero gradients into different weights; the losses agree.)"""
    from support import engines
    from support.parity_layouts import MICRO_BATCH, SEQ, SETTINGS, global_batch

    from megatron_ext import parallel
    from megatron_ext.mesh import Mesh
    from megatron_ext.models import lora as lora_module
    from megatron_ext.models.init import init_mesh_independent
    from megatron_ext.models.qwen import model as qwen
    from megatron_ext.models.qwen.shape import PRESETS
    from megatron_ext.objectives.sft import forward_step
    from megatron_ext.training import run

    compiled = []
    torch._dynamo.utils.counters.clear()
    monkeypatch.setattr(run, "compile_layers", lambda chunks: compiled.append(
        spec.compile_layers(chunks, backend=compile_backend)))
    parallel.init_model_parallel(Mesh(world=1), seed=1234)
    shape = dataclasses.replace(PRESETS[shape_name], num_layers=2)
    chunk = qwen.build_qwen(qwen.transformer_config(shape, Mesh(world=1), recompute=recompute), shape, vocab_size=256)
    init_mesh_independent([chunk], 1234)
    if lora:
        lora_module.apply([chunk], lora_module.LoRAConfig(rank=4, alpha=8.0, targets=("qkv", "proj")), seed=7)
        with torch.no_grad():  # adapters that change the output from the first step
            for name, param in chunk.named_parameters():
                if "lora_b" in name:
                    param.normal_(0.0, 0.2, generator=torch.Generator().manual_seed(len(name)))
    keys = list(chunk.state_dict())
    engine = engines.build([chunk], torch.device("cpu"), forward_step, Mesh(world=1), engine=engine_name,
                           micro_batch_size=MICRO_BATCH, seq_length=SEQ, compile_layers=compile_backend is not None,
                           **SETTINGS)
    losses, grads = [], {}
    for step in range(2):
        losses.append(engine.forward_backward(global_batch(step)))
        if not step and engine_name == "megatron":  # its fp32 main_grad
            grads = {n: p.main_grad.clone() for n, p in engine.model[0].module.named_parameters() if p.requires_grad}
        engine.optimizer_step()
    breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
    after = list(chunk.state_dict())
    del engine, chunk
    _release()
    return losses, grads, keys, after, compiled, breaks


def _release():
    """Let the compiled layers and their engine go, and put back the session fixture's groups."""
    from megatron_ext import parallel
    from megatron_ext.mesh import Mesh

    torch._dynamo.reset()  # compiled code holds the layers, and an engine's process groups with them
    torch._dynamo.utils.counters.clear()
    gc.collect()  # (a backend's compiled callable in a cycle with its graph: its groups' threads end only here)
    parallel.destroy_model_parallel()
    parallel.init_model_parallel(Mesh(world=1), seed=1)  # as the session fixture left it (later tests use its groups)


def _assert_same(got, expected):
    assert got[0] == pytest.approx(expected[0], rel=1e-6)
    worst = {name: ((got[1][name] - grad).abs().max() / grad.abs().max()).item() for name, grad in expected[1].items()}
    assert max(worst.values()) < 1e-5, worst


@pytest.mark.parametrize("variant", [dict(), dict(recompute=spec.Recompute("full")), dict(lora=True)],
                         ids=["plain", "full-recompute", "lora"])
def test_compiled_layers_train_as_eager(single_rank, monkeypatch, variant):
    expected = _train(monkeypatch, **variant)
    got = _train(monkeypatch, "aot_eager", **variant)
    assert got[4] == [2], "both layers compiled"
    assert got[5] == 0, "one graph per layer"
    assert got[2] == expected[2] and got[3] == expected[3], "no _orig_mod. in the checkpoint keys"
    _assert_same(got, expected)


def test_fsdp_trains_as_eager(single_rank, monkeypatch):
    """FSDP2 shards the compiled layers (fully_shard after compile, torchtitan's order)."""
    expected = _train(monkeypatch, engine_name="fsdp")
    got = _train(monkeypatch, "aot_eager", engine_name="fsdp")
    assert got[4] == [2] and got[0] == pytest.approx(expected[0], rel=1e-6)


def test_moe_layers_stay_eager(single_rank, monkeypatch):
    expected = _train(monkeypatch, shape_name="tiny-moe")
    got = _train(monkeypatch, "aot_eager", shape_name="tiny-moe")
    assert got[4] == [0]
    _assert_same(got, expected)


def test_a_layer_compiled_wrong_is_caught(single_rank, monkeypatch):
    """Planted: a backend whose compiled layer scales its output by 1.001; the comparison above must see it."""

    def wrong(graph, inputs):
        return lambda *args: [t * 1.001 if t.is_floating_point() else t for t in graph(*args)]

    expected = _train(monkeypatch)
    got = _train(monkeypatch, wrong)
    with pytest.raises(AssertionError):
        _assert_same(got, expected)


def _train_vit(monkeypatch, compile_backend=None):
    """Two optimizer steps of a 2-layer ViT (biases everywhere, LayerNorm, exact GELU, attention without a mask):
    (losses, layers compiled, graph breaks)."""
    from support import engines

    from megatron_ext import parallel
    from megatron_ext.mesh import Mesh
    from megatron_ext.models.init import init_mesh_independent
    from megatron_ext.models.vit import model as vit
    from megatron_ext.models.vit.shape import VIT_PRESETS
    from megatron_ext.training import run

    compiled = []
    torch._dynamo.utils.counters.clear()
    monkeypatch.setattr(run, "compile_layers", lambda chunks: compiled.append(
        spec.compile_layers(chunks, backend=compile_backend)))
    parallel.init_model_parallel(Mesh(world=1), seed=1234)
    shape = dataclasses.replace(VIT_PRESETS["tiny"], num_layers=2)
    chunk = vit.ViTClassifier(vit.transformer_config(shape, Mesh(world=1)), shape, 10)
    init_mesh_independent([chunk], 1234)
    engine = engines.build([chunk], torch.device("cpu"), vit.forward_step, Mesh(world=1), micro_batch_size=4,
                           seq_length=shape.seq_length, compile_layers=compile_backend is not None, lr=1e-3)
    g = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(2):
        losses.append(engine.forward_backward([dict(pixels=torch.randn(4, 3, 32, 32, generator=g), labels=torch.randint(
            0, 10, (4,), generator=g), loss_mask=torch.ones(4)) for _ in range(2)]))
        engine.optimizer_step()
    breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
    del engine, chunk
    _release()
    return losses, compiled, breaks


def test_vit_layers_compile_as_eager(single_rank, monkeypatch):
    """The ViT-H A/B's lever (``ab.vit.compile-layers``): each ViT layer one graph, the same losses as eager."""
    expected = _train_vit(monkeypatch)
    losses, compiled, breaks = _train_vit(monkeypatch, "aot_eager")
    assert compiled == [2] and breaks == 0 and losses == pytest.approx(expected[0], rel=1e-6)


def test_zero3_is_refused():
    from megatron_ext.arguments import parse
    from megatron_ext.errors import ConfigError

    assert not Fusions().compile_layers
    with pytest.raises(ConfigError, match="--compile-layers with --zero-stage 3: ZeRO-3's gathering hooks"):
        parse("--compile-layers --engine deepspeed --zero-stage 3".split(), world_size=1)
