"""Parallel layouts compute what one process computes (fp32, tiny Qwen with GQA and QKV bias; tiny ViT; tiny GPT-2).

One process computes every family's reference, then one torchrun launch per world size (2, 4 and 8 CPU ranks) runs
all layouts of that size; see parity_layouts.py (what runs) and parity_worker.py. The MoE family (tiny Qwen2-MoE: top-2 of 4 experts, gated shared
expert, load-balancing and z-loss on) proves expert parallelism and the grouped experts (torch._grouped_mm) against
the reference's SequentialMLP: EP2 (and with SequentialMLP), DP2 x EP2 with the distributed
optimizer, TP2+SP x EP2 (expert TP 1 and 2), PP2 x EP2, CP2 x EP2 and the 5D DP2 x PP2 x TP2+SP x EP2, on rows
with padding tails that are never routed (each pipeline stage and sequence/context slice gets its part of the mask).
Every megatron-engine layout reduces its gradients in 4,096-element buckets, each started during the backward
(overlap_grad_reduce), and the ``ce_fusion_*`` layouts compute the loss with --cross-entropy-loss-fusion against the
unfused reference. Loss of step 1, every parameter gradient (TP shards gathered back to full shape, EP shards to their global experts,
the distributed optimizer's shards all-gathered), the clipped grad norm and the losses of three AdamW steps must
match.
"""

import json
import math

import pytest

from support.ranks import run_ranks
from megatron_ext.models.qwen.shape import PRESETS
from megatron_ext.models.vit.shape import VIT_PRESETS
from support.parity_layouts import LAYOUTS, LORA, family

TOL = 1e-5
MOE_LAYERS = PRESETS["tiny-moe"].num_layers
WORLDS = {world: [n for n, l in LAYOUTS.items() if l["world"] == world]
          for world in sorted({l["world"] for l in LAYOUTS.values()})}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("parity")
    # Every family's reference in one process: megatron-core's imports are paid once.
    run_ranks(1, ["tests/support/parity_worker.py", "reference", str(out), *sorted({family(n) for n in LAYOUTS})])
    merged = {}
    for world, names in WORLDS.items():
        path = out / f"world{world}.json"
        run_ranks(world, ["tests/support/parity_worker.py", "compare", str(out), str(path), *names])
        merged.update(json.loads(path.read_text()))
    return merged


def check_layout(r: dict, layout: str) -> None:
    assert r["params_compared"] == r["params_expected"], "every parameter's gradient must be compared"
    assert r["grad_rel_diff"] < TOL, f"{layout}: max grad diff {r['grad_rel_diff']:.2e} at {r['worst_param']}"
    assert r["loss_rel_diff"] < TOL, f"{layout}: losses {r['losses']} vs {r['ref_losses']}"
    assert r["grad_norm_rel_diff"] < TOL
    assert len(r["losses"]) == 3 and r["losses"][0] != r["losses"][2], "three optimizer steps must change the loss"
    assert all(math.isfinite(x) for x in r["losses"]), r["losses"]
    assert r["frozen_rel_change"] == 0.0, "frozen (LoRA base) weights must never change"


@pytest.mark.parametrize("layout", [n for n in LAYOUTS if not n.endswith("wrong")])
def test_layout_matches_single_process(results, layout):
    check_layout(results[layout], layout)


def test_a_nan_after_the_first_step_fails_the_comparison(results):
    """DP2 whose last step goes NaN (the steps before match): every aggregate that reads that step says so, and
    the check every layout passes fails it."""
    r = results["dp2_nan_wrong"]
    assert r["grad_rel_diff"] < TOL and r["loss_rel_diff"] == math.inf and r["grad_norm_rel_diff"] == math.inf, r
    with pytest.raises(AssertionError):
        check_layout(r, "dp2_nan_wrong")


def test_aggregates_count_nan_and_missing_steps_as_failures():
    from support.parity_worker import step_diffs
    from support.step_checks import worst

    assert worst([1e-7, math.nan]) == worst([math.nan, 1e-7]) == math.inf and worst([1e-7, 2e-7]) == 2e-7
    assert worst(step_diffs([1.0, 2.0], [1.0, 2.0, 3.0])) == math.inf  # a step missing
    assert worst(step_diffs([1.0, None], [1.0, 2.0])) == math.inf  # a step not reported


def test_lora_covers_every_adapter_and_only_adapters_and_head(results):
    """Every adapter of every target (and the head) gets its gradient, also through reentrant recompute; nothing
    else trains."""
    names = results["vit_lora_tp2_recompute"]["params_compared"]
    assert names and all(".lora_" in n or n.startswith("head.") for n in names)
    layers = VIT_PRESETS["tiny"].num_layers
    assert sum(".lora_" in n for n in names) == 2 * len(LORA["targets"]) * layers, "A and B, every target and layer"


def test_weights_wait_for_their_all_gather(results):
    """With the distributed optimizer each rank updates its shard and the others' arrive by an all-gather started
    in the next forward: without waiting for it, step 1 still matches and every later step must not."""
    r = results["dp2_distopt_gather_wrong"]
    assert r["grad_rel_diff"] < TOL and r["losses"][0] == pytest.approx(r["ref_losses"][0], rel=TOL), r
    assert r["loss_rel_diff"] > 1e-4, r


@pytest.mark.parametrize("layout", ["vit_lora_tp2_wrong", "moe_lora_tp2_sp_etp2_ep2_allgather_wrong"])
def test_lora_without_tp_reduction_is_detected(results, layout):
    """Row-parallel adapters that skip their all-reduce compute partial sums: the comparison must catch it (on the
    MoE model, in the routed experts' adapters)."""
    assert results[layout]["grad_rel_diff"] > 1e-2
    assert "moe" not in layout or ".local_experts." in results[layout]["worst_param"], results[layout]["worst_param"]


def test_dpo_without_the_context_parallel_sum_is_detected(results):
    """Each CP rank holds part of every row: a pair loss from the partial log-probabilities must fail."""
    r = results["dpo_cp2_wrong"]
    assert r["grad_rel_diff"] > 1e-2 and r["loss_rel_diff"] > 1e-2, r


def test_moe_lora_trains_every_linears_adapters_only(results):
    """On the MoE model the adapters sit on the attention, the shared expert and every routed expert, compared
    expert by expert; router, norms and base weights stay frozen."""
    names = results["moe_lora_tp2_sp_etp2_ep2_allgather"]["params_compared"]
    assert names and all(".lora_" in n for n in names), names
    experts = PRESETS["tiny-moe"].moe.num_experts
    assert len(names) == 2 * (2 + 2 + 2 * experts) * MOE_LAYERS, "A and B of qkv, proj, the shared expert's and " \
        "every expert's fc1 and fc2 in every layer"
    assert sum(".local_experts." in n for n in names) == 2 * 2 * experts * MOE_LAYERS


@pytest.mark.parametrize("layout", [n for n, l in LAYOUTS.items() if l.get("tp", 1) > 1 and family(n) == "qwen"])
def test_wrong_shard_layout_is_detected(results, layout):
    """Gathering SwiGLU's fused fc1 shards by plain concatenation is wrong; the comparison must say so."""
    assert results[layout]["wrong_layout_rel_diff"] > 1e-2


def test_a_loss_fusion_that_misplaces_the_vocabulary_split_is_detected(results):
    """--cross-entropy-loss-fusion under TP with every rank's rows taken for the first of the vocabulary: the loss
    and gradients must fail the comparison the fused layouts pass."""
    r = results["ce_fusion_tp2_sp_wrong"]
    assert r["loss_rel_diff"] > 1e-3 and r["grad_rel_diff"] > 1e-1, r  # (measured 8.1e-3 and 2.2)


def test_gloo_never_batches_p2p(results):
    """Interleaved pipeline + batched p2p on gloo gives wrong gradients: the engine must turn batching off."""
    assert results["pp2_vpp2"]["batch_p2p_comm"] is False


def test_top_left_causal_mask_under_cp_is_detected(results):
    """SDPA's is_causal is top-left aligned when a CP rank's query block is shorter than its keys: wrong, and the
    comparison must say so."""
    assert results["cp2_topleft_wrong"]["grad_rel_diff"] > 1e-2


@pytest.mark.parametrize("layout", ["cp2", "cp2_packed", "cp2_tp2_sp"])
def test_cp_reads_nothing_back_per_micro_batch(results, layout):
    """Context parallelism's slicing, masks and RoPE positions are device arithmetic: a step (4 micro-batches) reads
    back to the host only the loss and megatron-core's token-count check, as without CP (tests/models/test_kernels.py)."""
    assert all(reads == ["__bool__", "tolist"] for reads in results[layout]["host_reads"]), \
        results[layout]["host_reads"]


def test_experts_are_compared_one_by_one(results):
    """EP shards map back to global experts: every expert of every layer has its own gradient compared."""
    names = results["moe_dp2_pp2_tp2_sp_ep2_distopt"]["params_compared"]
    assert sum(".local_experts." in n and n.endswith("linear_fc1.weight") for n in names) == 4 * 4


@pytest.mark.parametrize("layout", [n for n in LAYOUTS if family(n) in ("moe", "moe_lora", "qwen3moe", "dpomoe")])
def test_moe_layouts_run_grouped_experts_against_sequential_ones(results, layout):
    """The reference runs SequentialMLP; every MoE layout but "sequential" runs the grouped experts, so each of
    them proves grouped == sequential on its mesh."""
    assert results[layout]["experts"] == ["SequentialMLP" if layout.endswith("sequential") else "TorchGroupedMLP"]


def test_expert_gradients_over_the_dense_data_parallel_group_are_detected(results):
    r = results["moe_dp2_ep2_wrong"]
    assert r["grad_rel_diff"] > 1e-2 and ".local_experts." in r["worst_param"]


def test_tied_embedding_without_its_pipeline_all_reduce_is_detected(results):
    """GPT-2 under PP2: the first stage's embedding and the last stage's output layer are one tensor; skipping
    megatron-core's all-reduce between them must fail the comparison."""
    r = results["gpt2_pp2_wrong"]
    assert r["grad_rel_diff"] > 1e-2 and "word_embeddings" in r["worst_param"]


def test_qwen3_query_key_norms_without_their_tensor_parallel_sum_are_detected(results):
    """Each TP rank's query/key norm gradient covers its own heads only: not summed over TP, they are wrong."""
    for layout in ("qwen3_tp2_wrong", "qwen3_fsdp2_tp2_wrong"):
        r = results[layout]
        assert r["grad_rel_diff"] > 1e-2 and "_layernorm" in r["worst_param"], (layout, r["worst_param"])


@pytest.mark.parametrize("layout", ["gpt2_fsdp2_tp2_wrong", "qwen_lora_fsdp2_tp2_wrong"])
def test_fsdp_grad_norm_without_the_tensor_parallel_shards_is_detected(results, layout):
    """FSDP2 x TP2 whose grad norm counts TP-split parameters (the adapters, all of them) on one TP rank only:
    clipping then scales wrongly."""
    assert results[layout]["grad_norm_rel_diff"] > 1e-2
    with pytest.raises(AssertionError):
        check_layout(results[layout], layout)
