"""GPU tier for Mixture-of-Experts (marked ``gpu``; skipped without CUDA): the tiny Qwen2-MoE in fp32 on one GPU as
a plain process, Qwen1.5-MoE-A2.7B's real layer shapes (cut to 2 layers) in bf16 with the grouped experts against
SequentialMLP (and a planted wrong grouping that must fail), and expert-parallel layouts over
NCCL (marked ``multigpu``: alltoall's uneven all-to-all and host-side split sizes, allgather with expert TP 2, the
5D mesh) against the one-GPU run. CPU ranks prove the same layouts with gloo (the moe_* layouts of tests/test_parity_megatron.py); here
the dispatchers' device tensors and CUDA-stream host copies are real."""

import json

import pytest

from step_checks import assert_close, assert_trains, by_step
from test_gpu_megatron import BANDS, STEPS, TOL, fused_differences, losses, records, train

pytestmark = pytest.mark.gpu
MOE = ["--model", "tiny-moe", "--moe-aux-loss-coeff", "1e-2", "--moe-z-loss-coeff", "1e-3"]
TP_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
MULTI_GPU = {  # fp32, each against the one-GPU run
    "moe_ep2": (2, MOE + ["--expert-model-parallel-size", "2"]),
    "moe_tp2_sp_ep2": (4, MOE + TP_SP + ["--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1"]),
    "moe_tp2_sp_etp2_ep2_allgather": (4, MOE + TP_SP + ["--expert-model-parallel-size", "2",
                                                        "--moe-token-dispatcher-type", "allgather"]),
    "moe_5d": (8, MOE + TP_SP + ["--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "2",
                                 "--expert-tensor-parallel-size", "1", "--use-distributed-optimizer"]),
}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("gpu_moe")


@pytest.fixture(scope="module")
def one_gpu(root):
    return losses(train(root, "moe_fp32", 1, MOE))


A27B = ["--model", "qwen1.5-moe-a2.7b", "--num-layers", "2", "--bf16", "--moe-aux-loss-coeff", "1e-3"]


@pytest.fixture(scope="module")
def a27b(root):
    """Qwen1.5-MoE-A2.7B's real layers in bf16: grouped experts (the default on CUDA), SequentialMLP, and the
    grouped experts with the planted wrong grouping."""
    out = {}
    for name, extra, patch in (("grouped", [], None), ("sequential", ["--no-moe-grouped-gemm"], None),
                               ("reversed", [], "experts_reversed")):
        log = train(root, f"a27b_bf16_{name}", 1, A27B + extra, patch=patch)
        out[name] = records(log)
        out[f"{name}_experts"] = json.loads((log / "summary.json").read_text())["run"]["experts"]
    return out


def test_real_moe_layers_train_in_bf16(a27b):
    for name in ("grouped", "sequential"):
        assert_trains(by_step(a27b[name]), STEPS)
        assert all(r["mfu"] > 0 and r["moe_load_max"] >= 1.0 and r["moe_aux_loss"] > 0 for r in a27b[name])
    assert a27b["grouped_experts"].startswith("grouped") and a27b["sequential_experts"].startswith("sequential")


def test_grouped_experts_match_the_expert_loop_in_bf16(a27b):
    """Within the bands the fused weight-gradient paths are held to (test_gpu_megatron.py); the wrong grouping falls
    outside them from step 1."""
    diffs = fused_differences(a27b["sequential"], a27b["grouped"])
    assert diffs["loss_step1"] <= BANDS["loss"] and diffs["grad_norm_step1"] <= BANDS["grad_norm_step1"], diffs
    assert diffs["loss"] <= BANDS["loss"], diffs
    wrong = fused_differences(a27b["sequential"], a27b["reversed"])
    assert wrong["loss_step1"] > BANDS["loss"] or wrong["grad_norm_step1"] > BANDS["grad_norm_step1"], wrong


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.multigpu(w)) for n, (w, _) in MULTI_GPU.items()])
def test_expert_parallel_layouts_equal_one_gpu(one_gpu, root, name):
    world, flags = MULTI_GPU[name]
    assert_close(losses(train(root, name, world, flags)), one_gpu, TOL, STEPS)
