"""GPU tier for Mixture-of-Experts (marked ``gpu``; skipped without CUDA): the tiny Qwen2-MoE in fp32 on one GPU as
a plain process, Qwen1.5-MoE-A2.7B's real layer shapes (cut to 2 layers) in bf16 with the grouped experts against
SequentialMLP (every weight's gradient at every step, each expert's on its own, tests/support/experts_worker.py, and a
planted wrong grouping touching only two experts that must fail the same comparison), and expert-parallel layouts
over
NCCL (marked ``multigpu``: alltoall's uneven all-to-all and host-side split sizes, allgather with expert TP 2, the
5D mesh) against the one-GPU run. CPU ranks prove the same layouts with gloo (the moe_* layouts of tests/training/test_parity_megatron.py); here
the dispatchers' device tensors and CUDA-stream host copies are real."""

import functools
import json

import pytest

from support.ranks import run_concurrently, run_ranks
from support.step_checks import assert_close, assert_trains, by_step, worst
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


# Every weight's gradient at every step against SequentialMLP's, each routed expert on its own (relative to the
# larger of its norm and its layer's typical expert norm: experts_worker.relative_by_parameter), in bf16. On CPU
# (tiny-moe in bf16, 2026-12-06): step 1 1.7e-3 (rounding alone), steps 2-3 1.0e-2 and 0.11 (the weights have moved
# apart by a few roundings, and some tokens' top-k choices flip); the reversed grouping 0.69-0.96 and two experts'
# counts swapped 0.65-1.0 at every step. (A layer's experts taken together, a single wrong expert of 60 would move the
# layer by about 1.4 x sqrt(1/60) = 0.18, inside this band.)
EXPERT_BANDS = dict(step1=2e-2, every_step=0.2)


@pytest.fixture(scope="module")
def a27b_runs(root):
    """Qwen1.5-MoE-A2.7B's real layers in bf16, all at once on the GPU (conftest.run_concurrently; one after another
    they took 94 s and more on an H200): finetune_qwen.py with grouped experts (the default on CUDA) and with
    SequentialMLP, and tests/support/experts_worker.py's every-gradient comparison of the two."""
    out = root / "experts.json"
    launches = {name: functools.partial(train, root, f"a27b_bf16_{name}", 1, A27B + extra)
                for name, extra in (("grouped", []), ("sequential", ["--no-moe-grouped-gemm"]))}
    launches["experts"] = functools.partial(
        run_ranks, 1, ["tests/support/experts_worker.py", "--model", "qwen1.5-moe-a2.7b", "--num-layers", "2", "--vocab-size",
                       "2048", "--seq-length", "256", "--bf16", "--out", str(out)])
    logs = run_concurrently(launches)
    runs = {name: records(logs[name]) for name in ("grouped", "sequential")}
    runs.update({f"{name}_experts": json.loads((logs[name] / "summary.json").read_text())["run"]["experts"]
                 for name in ("grouped", "sequential")})
    return runs, json.loads(out.read_text())


@pytest.fixture(scope="module")
def a27b(a27b_runs):
    return a27b_runs[0]


@pytest.fixture(scope="module")
def expert_gradients(a27b_runs):
    return a27b_runs[1]


def test_real_moe_layers_train_in_bf16(a27b):
    for name in ("grouped", "sequential"):
        assert_trains(by_step(a27b[name]), STEPS)
        assert all(r["mfu"] > 0 and r["moe_load_max"] >= 1.0 and r["moe_aux_loss"] > 0 for r in a27b[name])
    assert a27b["grouped_experts"].startswith("grouped") and a27b["sequential_experts"].startswith("sequential")


def test_grouped_experts_match_the_expert_loop_in_bf16(a27b, expert_gradients):
    """Training runs: step 1's loss and grad norm and every loss within the bands the fused weight-gradient paths
    are held to (test_gpu_megatron.py). Every weight's gradient at every step within EXPERT_BANDS; the planted
    wrong grouping of two experts outside them at every step."""
    diffs = fused_differences(a27b["sequential"], a27b["grouped"])
    assert diffs["loss_step1"] <= BANDS["loss"] and diffs["grad_norm_step1"] <= BANDS["grad_norm_step1"], diffs
    assert diffs["loss"] <= BANDS["loss"], diffs
    grouped = expert_gradients["grouped"]
    assert expert_gradients["reference_kinds"] == ["SequentialMLP"] and grouped["kinds"] == ["TorchGroupedMLP"]
    # both layers' experts, each weight of each expert on its own: 2 layers x 60 experts x (fc1, fc2)
    assert grouped["experts_compared"] == 2 * 60 * 2 and grouped["compared"] > grouped["experts_compared"], grouped
    steps = grouped["worst_by_step"]
    assert len(steps) == 3 and steps[0] <= EXPERT_BANDS["step1"], grouped
    assert worst(steps) <= EXPERT_BANDS["every_step"], grouped  # worst(): a NaN anywhere is the worst
    wrong = expert_gradients["two_experts"]  # (all() of nothing is True: the steps counted first)
    assert len(wrong["worst_by_step"]) == 3 and all(d > EXPERT_BANDS["every_step"] for d in wrong["worst_by_step"]), \
        wrong


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.multigpu(w)) for n, (w, _) in MULTI_GPU.items()])
def test_expert_parallel_layouts_equal_one_gpu(one_gpu, root, name):
    world, flags = MULTI_GPU[name]
    assert_close(losses(train(root, name, world, flags)), one_gpu, TOL, STEPS)
