"""Expert parallelism computes what one process computes (fp32, tiny Qwen2-MoE: top-2 of 4 experts, gated shared
expert, load-balancing and z-loss on, clipping active): EP2 (both dispatchers), DP2 x EP2 with the distributed
optimizer, TP2+SP x EP2 (expert TP 1 and 2), PP2 x EP2, CP2 x EP2, and the 5D layout DP2 x PP2 x TP2+SP x EP2 in one 8-rank
launch. Loss, every expert's and every dense gradient, the clipped grad norm and three AdamW steps must match; expert
gradients reduced over the dense data-parallel group must not."""

import json

import pytest

from conftest import run_ranks
from moe_parity_worker import LAYOUTS

TOL = 1e-5


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("moe_parity")
    run_ranks(1, ["tests/moe_parity_worker.py", "reference", str(out)])
    merged = {}
    for world in sorted({layout["world"] for layout in LAYOUTS.values()}):
        names = [n for n, layout in LAYOUTS.items() if layout["world"] == world]
        path = out / f"world{world}.json"
        run_ranks(world, ["tests/moe_parity_worker.py", "compare", str(out), str(path), *names])
        merged.update(json.loads(path.read_text()))
    return merged


@pytest.mark.parametrize("layout", [n for n in LAYOUTS if not n.endswith("wrong")])
def test_expert_parallel_layout_matches_single_process(results, layout):
    r = results[layout]
    assert r["params_compared"] == r["params_expected"], "every expert's and every dense gradient must be compared"
    assert any(".local_experts.3." in n for n in r["params_compared"])
    assert r["grad_rel_diff"] < TOL, f"{layout}: max grad diff {r['grad_rel_diff']:.2e} at {r['worst_param']}"
    assert r["loss_rel_diff"] < TOL, f"{layout}: losses {r['losses']} vs {r['ref_losses']}"
    assert r["grad_norm_rel_diff"] < TOL
    assert len(r["losses"]) == 3 and r["losses"][0] != r["losses"][2], "three optimizer steps must change the loss"


def test_expert_gradients_over_the_dense_data_parallel_group_are_detected(results):
    r = results["moe_dp2_ep2_wrong"]
    assert r["grad_rel_diff"] > 1e-2 and ".local_experts." in r["worst_param"]
