"""Batch-size ramp-up (``pretrain_gpt.py --rampup-batch-size START INCREMENT SAMPLES``, Megatron-LM's): each step's
global batch from megatron-core's calculator, Megatron-LM's step count, a schedule that advances by each step's
batch, one rank = DP2, a resume mid-ramp, and the mistakes refused in one line."""

import math

import dataclasses

import pytest

from support.ranks import run_ranks
from support.step_checks import records

GPT = ["--model", "tiny", "--mock-data", "--seq-length", "32", "--micro-batch-size", "1", "--global-batch-size", "8",
       "--rampup-batch-size", "2", "2", "12", "--train-samples", "40", "--lr", "1e-2", "--min-lr", "1e-3",
       "--lr-warmup-samples", "4", "--lr-decay-style", "linear", "--lr-decay-samples", "40"]
BATCHES = [2, 2, 4, 6, 8, 8, 8]  # 12 / 3 = 4 samples per increment: 0, 2 -> 2; 4 -> 4; 8 -> 6; past 12 -> 8


def parse(argv, world=1):
    from megatron_ext.arguments import parse as parse_args

    return parse_args(argv, world_size=world, family="gpt")


def test_batch_sizes_and_step_count_are_megatron_lms():
    """Megatron-LM's example arithmetic: start 4, +4 over 40 samples to 16 (13.3 samples an increment); its
    update_train_iters: 7 ramp steps to sample 44, then (200 - 44) // 16 = 9 whole batches."""
    from megatron_ext.config.rampup import Rampup

    ramp = Rampup(4, 4, 40, 16, 2, 2)
    consumed, sizes = 0, []
    while consumed < 80:
        sizes.append(ramp.batch_at(consumed))
        consumed += sizes[-1]
    assert sizes == [4, 4, 4, 4, 8, 8, 12, 16, 16, 16]
    assert ramp.train_iters(200) == 16 and ramp.sizes() == [4, 8, 12, 16]
    run = parse(GPT, world=2)
    assert run.training.train_iters == len(BATCHES) and run.rampup.sizes() == [2, 4, 6, 8]


def test_the_schedule_advances_by_each_steps_batch():
    """The schedule counts samples: after each step, the rate at the samples consumed so far; advanced by the
    final global batch instead, it is not."""
    import torch

    settings = parse(GPT).optimizer
    expected = [lr_at(sum(BATCHES[:k + 1])) for k in range(len(BATCHES))]
    for rampup, agrees in ((settings.rampup, True), (None, False)):
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
        scheduler = dataclasses.replace(settings, rampup=rampup).lr_schedule(optimizer)
        got = []
        for _ in BATCHES:
            scheduler.step(1)
            got.append(optimizer.param_groups[0]["lr"])
        assert (got == pytest.approx(expected, rel=1e-12)) == agrees


def lr_at(samples: int) -> float:
    """GPT's schedule: linear warm-up over 4 samples, linear decay from 1e-2 to 1e-3 at sample 40."""
    if samples <= 4:
        return 1e-2 * samples / 4
    return 1e-3 + 9e-3 * (1 - min(samples - 4, 36) / 36)


def test_runs_ramp_the_batch_and_agree_across_meshes_and_a_resume(tmp_path):
    """One rank and DP2: the steps' batches, learning rates and losses agree (1e-5); DP2 saved at step 3 (mid-ramp)
    and resumed goes on with the same batches and losses; throughput counts each step's batch."""
    common = ["pretrain_gpt.py", *GPT, "--log-dir"]
    run_ranks(1, [*common, tmp_path / "one"])
    run_ranks(2, [*common, tmp_path / "dp2", "--save", tmp_path / "ckpt", "--save-interval", 3])
    run_ranks(2, [*common, tmp_path / "resumed", "--load", tmp_path / "ckpt" / "iter_0000003"])
    one, dp2, resumed = (records(tmp_path / name) for name in ("one", "dp2", "resumed"))
    assert [r["global_batch_size"] for r in one] == [r["global_batch_size"] for r in dp2] == BATCHES
    assert [r["lr"] for r in one] == pytest.approx([lr_at(sum(BATCHES[:k + 1])) for k in range(7)], rel=1e-9)
    for mine, theirs in zip(dp2, one):
        assert math.isclose(mine["loss"], theirs["loss"], rel_tol=1e-5), mine["step"]
    assert [r["step"] for r in resumed] == [4, 5, 6, 7]
    for mine, theirs in zip(resumed, dp2[3:]):
        assert mine["global_batch_size"] == theirs["global_batch_size"]
        assert math.isclose(mine["loss"], theirs["loss"], rel_tol=1e-5) and mine["lr"] == pytest.approx(theirs["lr"])
    # the same step time would mean 4x the samples per second at 8 as at 2
    per_sample = [r["samples_per_sec"] * r["step_time"] / r["global_batch_size"] for r in one]
    assert per_sample == pytest.approx([1.0] * 7, rel=1e-6)


def test_moe_router_statistics_follow_the_ramp(tmp_path):
    """An MoE model under the ramp: step 1 (a batch of 2: two micro-batches) logs the aux and z losses and the load
    of a run whose global batch is 2 (the same samples); normalised by the final batch's 8 micro-batches the losses
    would be 4x smaller."""
    moe = ["pretrain_gpt.py", "--model", "tiny-moe", "--mock-data", "--seq-length", "32", "--micro-batch-size", "1",
           "--lr", "1e-3", "--moe-aux-loss-coeff", "0.01", "--moe-z-loss-coeff", "1e-3", "--log-dir"]
    run_ranks(1, [*moe, tmp_path / "ramp", "--global-batch-size", "8", "--rampup-batch-size", "2", "2", "12",
                  "--train-samples", "40"])
    run_ranks(1, [*moe, tmp_path / "fixed", "--global-batch-size", "2", "--train-iters", "1"])
    ramp, fixed = records(tmp_path / "ramp")[0], records(tmp_path / "fixed")[0]
    assert ramp["global_batch_size"] == 2 and math.isclose(ramp["loss"], fixed["loss"], rel_tol=1e-6)
    assert ramp["moe_aux_loss"] > 0 and ramp["moe_z_loss"] > 0
    for key in ("moe_aux_loss", "moe_z_loss", "moe_load_max", "moe_load_cv"):
        assert math.isclose(ramp[key], fixed[key], rel_tol=1e-6), key


@pytest.mark.parametrize("flags, world, message", [
    (["--train-iters", "5"], 1, "counts samples: give the run's length as --train-samples"),
    (["--rampup-batch-size", "8", "2", "12"], 1, "START must be below --global-batch-size 8"),
    (["--rampup-batch-size", "3", "2", "12"], 1, "here 8 - 3 is not a multiple of 2"),
    (["--rampup-batch-size", "2", "1", "12"], 2, "the batch size 3 on the way is not a multiple of"),
    (["--engine", "deepspeed"], 2, "does not go with --engine deepspeed"),
])
def test_mistakes_are_one_line(flags, world, message):
    from megatron_ext.errors import ConfigError

    argv = list(GPT)
    if "--train-iters" in flags:
        at = argv.index("--train-samples")
        del argv[at:at + 2]
        for flag in ("--lr-warmup-samples", "--lr-decay-samples"):
            at = argv.index(flag)
            del argv[at:at + 2]
    with pytest.raises(ConfigError, match=message):
        parse(argv + flags, world=world)


def test_fine_tuning_says_where_the_ramp_up_lives():
    import subprocess
    import sys

    from support import REPO

    proc = subprocess.run([sys.executable, "finetune_qwen.py", "--rampup-batch-size", "2", "2", "12"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "batch-size ramp-up is pretrain_gpt.py's" in proc.stderr
