"""pretrain_vit.py end to end on synthetic labelled images (fp32, CPU ranks): one rank, TP2 x PP2 (megatron
engine) and DP2 with DeepSpeed ZeRO-2 give the same five losses (1e-5, clipping active), the loss falls, a
checkpoint saved under TP2 x PP2 resumes on one rank to the same steps, and bad ViT flags are one line before any
process group."""

import json
import re

import pytest

from conftest import run_ranks
from megatron_ext.arguments import parse
from megatron_ext.errors import ConfigError

COMMON = ["pretrain_vit.py", "--model", "tiny", "--mock-data", "--micro-batch-size", "2", "--global-batch-size", "8",
          "--train-iters", "5", "--lr", "2e-3", "--clip-grad", "0.5"]
RUNS = {"1rank": (1, []),
        "tp2_pp2": (4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]),
        "dp2_zero2": (2, ["--engine", "deepspeed", "--zero-stage", "2"])}


def test_same_losses_on_every_layout_and_engine(tmp_path):
    losses = {}
    for name, (world, flags) in RUNS.items():
        run_ranks(world, COMMON + flags + ["--log-dir", str(tmp_path / name)])
        losses[name] = [json.loads(line)["loss"] for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    # A checkpoint saved at step 3 under TP2 x PP2 resumes on one rank to the same steps 4-5.
    ckpt = ["--save", str(tmp_path / "ckpt"), "--save-interval", "3", "--exit-interval", "3"]
    run_ranks(4, COMMON + RUNS["tp2_pp2"][1] + ckpt + ["--log-dir", str(tmp_path / "first3")])
    run_ranks(1, COMMON + ["--load", str(tmp_path / "ckpt"), "--log-dir", str(tmp_path / "resumed")])
    resumed = [json.loads(line) for line in (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()]
    reference = losses.pop("1rank")
    assert len(reference) == 5 and reference[-1] < reference[0]
    assert [r["step"] for r in resumed] == [4, 5]
    losses["resumed_from_tp2_pp2"] = [None] * 3 + [r["loss"] for r in resumed]
    for name, ours in losses.items():
        assert all(a is None or abs(a - b) <= 1e-5 * b for a, b in zip(ours, reference)), (name, ours, reference)


@pytest.mark.parametrize("flags, world, expected", [
    ("--tensor-model-parallel-size 2 --sequence-parallel", 2, "--sequence-parallel is not supported for ViT: its 17"),
    ("--image-size 30", 1, "--image-size 30 is not a multiple of the patch size 8"),
    ("--engine deepspeed --zero-stage 1 --pipeline-model-parallel-size 2", 2, "pipeline engine runs language"),
    ("--num-classes 0", 1, "--num-classes must be >= 1"),
    ("--label-smoothing 1.5", 1, "--label-smoothing must be in [0, 1), got 1.5"),
])
def test_bad_vit_flags(flags, world, expected):
    with pytest.raises(ConfigError, match=re.escape(expected)):
        parse(["--mock-data", *flags.split()], world_size=world, family="vit")
    with pytest.raises(ConfigError, match="add --mock-data"):
        parse([], world_size=1, family="vit")
