"""Grouped experts (torch._grouped_mm) against SequentialMLP in one process: three AdamW steps with clipping through
the megatron engine (tests/support/experts_worker.py: loss and every gradient at every step, fp32), a deliberately wrong
grouping that must fail the same check, checkpoints that cross between the two at EP1 with equal logits, and the
alignment rules. Under EP, TP+SP, PP, CP
and the 5D layout: tests/training/test_parity_megatron.py; across implementations at EP2 with optimizer state:
tests/training/test_finetune_e2e.py."""

import dataclasses

import pytest
import torch

from support import hf_fixtures
from support.experts_worker import MICRO, SEQ, SHAPE, batches, build, two_experts_swapped, reversed_grouping, train, worst_diff
from support.step_checks import worst


@pytest.fixture(scope="module")
def sequential(single_rank):
    return train(grouped=False)


def test_grouped_equals_sequential_over_three_adamw_steps(sequential):
    """Every parameter's gradient at every step, each step's loss and grad norm: 1e-5 (fp32)."""
    grouped = train(grouped=True, compare_to=sequential)
    assert grouped["kinds"] == ["TorchGroupedMLP"] and sequential["kinds"] == ["SequentialMLP"]
    assert sequential["losses"][0] != sequential["losses"][2], "the steps must change the loss"
    assert worst_diff(grouped, sequential) < 1e-5


@pytest.mark.parametrize("plant", [reversed_grouping, two_experts_swapped], ids=["reversed", "two-experts-swapped"])
def test_tokens_sent_to_the_wrong_experts_are_caught(sequential, plant):
    """Group offsets from the token counts in reverse expert order (rows meet another expert's weights), or
    two experts' counts swapped (every other expert right): caught at every step."""
    undo = plant()
    try:
        run = train(grouped=True, compare_to=sequential)
    finally:
        undo()
    assert worst_diff(run, sequential) > 1e-2
    assert len(run["worst_by_step"]) == 3 and min(run["worst_by_step"]) > 1e-2


@pytest.mark.parametrize("saved, loaded", [(False, True), (True, False)])
def test_checkpoints_cross_between_grouped_and_sequential(single_rank, tmp_path, saved, loaded):
    from megatron.core import dist_checkpointing

    source, target = build(saved, seed=5), build(loaded, seed=6)
    dist_checkpointing.save(source.sharded_state_dict(), str(tmp_path))
    target.load_state_dict(dist_checkpointing.load(target.sharded_state_dict(), str(tmp_path)))
    tokens = batches(0)[0]["tokens"]
    with torch.no_grad():
        expected, actual = (m(tokens, torch.arange(SEQ).expand(MICRO, SEQ), attention_mask=None) for m in (source, target))
    assert torch.equal(actual, expected)


def test_alignment_and_device_decide_the_default(capsys):
    from megatron_ext.errors import ConfigError
    from megatron_ext.models import moe
    from megatron_ext.models.grouped_experts import unsupported
    from megatron_ext.models.moe_flags import MoESettings

    cpu = torch.device("cpu")
    assert unsupported(64, 32, torch.float32, cpu) is None and unsupported(64, 32, torch.bfloat16, cpu) is None
    assert "expert FFN size per expert-TP rank 36 is not a multiple of 8" in unsupported(64, 36, torch.bfloat16, cpu)
    assert "hidden size 62 is not a multiple of 4" in unsupported(62, 32, torch.float32, cpu)
    odd = dataclasses.replace(SHAPE, moe=dataclasses.replace(SHAPE.moe, ffn_hidden_size=36))
    assert moe.use_grouped_gemm(odd, MoESettings(), 1, torch.float32, False)  # 36 / 4 rows of 16 bytes
    assert not moe.use_grouped_gemm(odd, MoESettings(), 1, torch.bfloat16, False)
    assert capsys.readouterr().out.strip().splitlines() == [
        "MoE experts run one by one (SequentialMLP): the expert FFN size per expert-TP rank 36 is not a multiple of "
        "8, which torch._grouped_mm needs in bfloat16"]
    with pytest.raises(ConfigError, match="^--moe-grouped-gemm: the expert FFN size .* one by one$"):
        moe.use_grouped_gemm(odd, MoESettings(grouped_gemm=True), 1, torch.bfloat16, False)
    assert not moe.use_grouped_gemm(SHAPE, MoESettings(grouped_gemm=False), 1, torch.float32, False)


def test_padding_is_never_routed_nor_counted(single_rank):
    """The same documents in rows with 40 padding tokens each: the aux and z-loss and the router load equal those
    of the unpadded rows (causal attention: the documents' own hidden states do not see the padding after them).
    Without the padding mask, as before, the padding is routed and counted, and the statistics differ."""
    from megatron_ext.mesh import Mesh
    from support import engines
    from megatron_ext.objectives.sft import forward_step
    from megatron_ext.models.moe import RouterStats

    engine = engines.build([build(True)], torch.device("cpu"), forward_step, Mesh(world=1), micro_batch_size=MICRO,
                           seq_length=SEQ)
    stats = RouterStats(engine.model, SHAPE.num_layers, num_microbatches=1)
    g = torch.Generator().manual_seed(7)
    docs, pad = torch.randint(0, SHAPE.vocab_size, (MICRO, 24), generator=g), 40
    padded = torch.cat([docs, torch.randint(0, SHAPE.vocab_size, (MICRO, pad), generator=g)], dim=1)
    padding = torch.arange(24 + pad).expand(MICRO, -1) >= 24

    def router_stats(tokens, **extra):
        n = tokens.shape[1]
        engine.forward_backward([dict(tokens=tokens, labels=tokens, loss_mask=(~padding[:, :n]).float(),
                                      position_ids=torch.arange(n).expand(MICRO, n), **extra)])
        return stats()

    plain, masked, routed = router_stats(docs), router_stats(padded, padding_mask=padding), router_stats(padded)
    assert plain.keys() == masked.keys() >= {"moe_aux_loss", "moe_z_loss", "moe_load_max", "moe_load_cv"}
    for key in plain:
        assert masked[key] == pytest.approx(plain[key], rel=1e-5), key
    assert worst(abs(routed[k] - plain[k]) / abs(plain[k]) for k in ("moe_aux_loss", "moe_z_loss", "moe_load_cv")) > 1e-3


def test_fsdp_trains_and_exports_grouped_experts_as_the_loop(tmp_path):
    """--engine fsdp takes MoE with either implementation: the same losses, and the same exported tensors (grouped
    weights initialised and gathered expert by expert under their SequentialMLP names)."""
    import json

    from support.ranks import run_ranks

    out = {}
    for name, flag in (("grouped", "--moe-grouped-gemm"), ("sequential", "--no-moe-grouped-gemm")):
        run_ranks(2, ["finetune_qwen.py", "--model", "tiny-moe", "--engine", "fsdp", flag, "--pack-sequences",
                      "--seq-length", "128", "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters",
                      "3", "--lr", "1e-3", "--data-cache-dir", str(tmp_path / "cache"), "--log-dir",
                      str(tmp_path / name), "--save-hf", str(tmp_path / f"{name}_hf")])
        out[name] = ([json.loads(line)["loss"] for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()],
                     hf_fixtures.tensors(tmp_path / f"{name}_hf"))
    (grouped, g_tensors), (sequential, s_tensors) = out["grouped"], out["sequential"]
    assert len(grouped) == 3 and grouped == pytest.approx(sequential, rel=1e-5)
    assert g_tensors.keys() == s_tensors.keys() and any(".experts.3.down_proj" in k for k in g_tensors)
    assert worst((g_tensors[k] - s_tensors[k]).abs().max().item() for k in g_tensors) < 1e-5


def test_the_fused_weighted_swiglu_of_gpu_runs_equals_the_plain_one(single_rank):
    """On CUDA the grouped experts take megatron-core's fused SwiGLU x probs (bias_activation_fusion); here both
    paths on the same weights: the same loss, and the router's gradient (which flows through the probs) equal."""
    from megatron_ext.models.sharding import global_named_parameters

    tokens = batches(0)[0]["tokens"]
    out = []
    for fused in (False, True):
        model = build(True)
        model.config.bias_activation_fusion = fused
        loss = model(tokens, torch.arange(SEQ).expand(MICRO, SEQ), attention_mask=None, labels=tokens)
        loss.sum().backward()
        out.append((loss.detach(), {n: p.grad for n, _, p in global_named_parameters(model) if "router" in n}))
    assert torch.equal(out[0][0], out[1][0])
    assert all(torch.allclose(out[0][1][n], out[1][1][n], rtol=1e-5, atol=1e-8) for n in out[0][1])


@pytest.mark.parametrize("counts", [(5, 0, 3, 0), (0, 0, 0, 0), (0, 0, 12, 0)])
def test_experts_without_tokens_match_the_loop(single_rank, monkeypatch, counts):
    """Routings where some experts, or all of a rank's experts (what an EP rank that received no token sees), get
    nothing: output and every gradient equal SequentialMLP's, and an empty expert's weight gradient is zero even from
    a kernel that leaves its block undefined (reported on newer GPUs; planted here as NaN)."""
    from megatron_ext.models import grouped_experts

    real = torch._grouped_mm

    def undefined_empty_blocks(a, b, offs=None, **kw):  # a weight gradient: [E, in, out], one block per group
        out = real(a, b, offs=offs, **kw)
        if out.dim() == 3:
            out[torch.diff(offs, prepend=offs.new_zeros(1)) == 0] = float("nan")
        return out

    monkeypatch.setattr(torch, "_grouped_mm", undefined_empty_blocks)
    g = torch.Generator().manual_seed(11)
    tokens_per_expert = torch.tensor(counts)
    x = torch.randn(sum(counts), SHAPE.hidden_size, generator=g)
    probs, upstream = torch.rand(sum(counts), generator=g), torch.randn(sum(counts), SHAPE.hidden_size, generator=g)
    results = []
    for grouped in (True, False):
        experts = build(grouped).decoder.layers[0].mlp.experts
        assert isinstance(experts, grouped_experts.TorchGroupedMLP) == grouped
        tokens = x.clone().requires_grad_()
        out, _ = experts(tokens, tokens_per_expert, probs)
        out.backward(upstream)
        if grouped:
            grads = {name: view for which in ("weight1", "weight2")
                     for name, view in experts.per_expert(which, getattr(experts, which).grad)}
        else:
            grads = {name: p.grad for name, p in experts.named_parameters()}
        results.append((out.detach(), tokens.grad, grads))
    (out, grad_x, grads), (ref_out, ref_grad_x, ref_grads) = results
    assert out.shape == (sum(counts), SHAPE.hidden_size) and torch.allclose(out, ref_out, atol=1e-6)
    assert torch.allclose(grad_x, ref_grad_x, atol=1e-6)
    assert grads.keys() == ref_grads.keys() and len(grads) == 8
    for name, grad in grads.items():
        assert torch.allclose(grad, ref_grads[name], atol=1e-6), name
        assert bool(grad.any()) == (counts[int(name.split(".")[1])] > 0), name


def test_an_identity_chunk_sort_is_skipped_with_the_same_loss_and_gradients(single_rank, monkeypatch):
    """One expert-parallel rank: megatron-core's sort of the all-to-all's chunks by local expert is the identity
    (models/moe._sort_chunks returns its inputs: no split, no host read, no copy); the loss and every gradient equal
    megatron-core's own sort, and a sort that is not the identity still runs megatron-core's."""
    from megatron.core.transformer.moe import token_dispatcher

    from megatron_ext.models import moe
    from megatron_ext.models.sharding import global_named_parameters

    tokens = batches(0)[0]["tokens"]
    out, calls = [], []
    for sort in (moe._SORT_CHUNKS, moe._sort_chunks):
        monkeypatch.setattr(token_dispatcher, "sort_chunks_by_idxs",
                            lambda *a, sort=sort, **k: calls.append(sort) or sort(*a, **k))
        model = build(True)
        loss = model(tokens, torch.arange(SEQ).expand(MICRO, SEQ), attention_mask=None, labels=tokens)
        loss.sum().backward()
        out.append((loss.detach(), {n: p.grad for n, _, p in global_named_parameters(model) if p.grad is not None}))
    assert calls and torch.equal(out[0][0], out[1][0]) and out[0][1].keys() == out[1][1].keys()
    assert all(torch.equal(out[0][1][n], out[1][1][n]) for n in out[0][1])
    x, sizes = torch.arange(6.0).unsqueeze(1), torch.tensor([1, 2, 3])
    assert moe._sort_chunks(x, sizes, torch.arange(3))[0] is x
    assert moe._sort_chunks(x, sizes, torch.tensor([2, 0, 1]))[0].squeeze(1).tolist() == [3, 4, 5, 0, 1, 2]
