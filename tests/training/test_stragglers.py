"""The slowest rank, every step: each rank's busy time (the step less its waits for other ranks: exposed gradient
reduction and pipeline exchanges) travels in the loop's one all-reduce per step, so metrics.jsonl names the rank
that kept the others waiting, and the summary the one most often slowest."""

import json

from support.ranks import run_ranks

RUN = ["pretrain_gpt.py", "--model", "tiny", "--mock-data", "--seq-length", "32", "--micro-batch-size", "2",
       "--global-batch-size", "4", "--train-iters", "4", "--lr-warmup-iters", "0"]


def records(path):
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


def test_a_slow_rank_is_named_every_step(tmp_path):
    """DP2 with rank 1 made 0.5 s slower per step: rank 1 is the slowest at every step and its busy time exceeds
    rank 0's by about that (rank 0 spent it waiting in the gradient reduction). The summary says so."""
    proc = run_ranks(2, ["tests/support/patched.py", "slow_rank_1", *RUN, "--log-dir", str(tmp_path)])
    steps = records(tmp_path)
    assert [r["slowest_rank"] for r in steps] == [1, 1, 1, 1]
    assert all(0.35 < r["busy_time_max"] - r["busy_time_min"] < 1.0 for r in steps), steps
    assert all(r["busy_time_min"] <= r["step_time"] for r in steps)  # (at most rank 0's own, within its step)
    assert "slowest rank                   1 (in 100% of steps; busy" in proc.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["slowest_rank"] == 1 and summary["slowest_rank_share"] == 1.0 and summary["busy_spread"] > 0.5


def test_one_rank_has_no_straggler(tmp_path):
    proc = run_ranks(1, [*RUN, "--log-dir", str(tmp_path)])
    steps = records(tmp_path)
    assert all(r["slowest_rank"] == 0 and r["busy_time_max"] == r["busy_time_min"] > 0 for r in steps)
    assert "slowest rank" not in proc.stdout
    assert json.loads((tmp_path / "summary.json").read_text())["slowest_rank"] is None
