"""The in-run profiler and the step's time split, in one process: the window, the flags, exclusive region times.
(Traces of real multi-rank runs under both engines: test_finetune_e2e.py and test_deepspeed_engine.py.)"""

import gzip
import json

import pytest
import torch

from megatron_ext import arguments
from megatron_ext.config.profiling import Profiling
from megatron_ext.errors import ConfigError
from megatron_ext.observability import regions
from megatron_ext.observability.regions import LABELS, StepRegions, region, timed
from megatron_ext.training.loop import LoopSettings, train


class FakeEngine:
    """Just enough engine for the loop: a matmul in labelled forward and backward regions."""

    device = torch.device("cpu")
    last_metrics = {}

    def forward_backward(self, microbatches):
        with region("forward"):
            torch.randn(64, 64) @ torch.randn(64, 64)
        with region("backward"):
            with region("grad_reduce"):
                torch.randn(64, 64).sum()
        return 1.0

    def optimizer_step(self):
        return {"lr": 0.1, "grad_norm": 1.0, "skipped": False}


class FakeData:
    def train_microbatches(self):
        return [{}]


class Logger:
    def log(self, record):
        pass


def run(tmp_path, start_iteration=0, **flags):
    settings = Profiling(enabled=True, directory=str(tmp_path / "traces"), **flags)
    loop = LoopSettings(train_iters=6, tokens_per_step=8, samples_per_step=1, flops_per_token=1.0, peak_flops=None,
                        profile=settings, trace_metadata=dict(engine="fake"))
    return train(FakeEngine(), FakeData(), loop, Logger(), start_iteration=start_iteration)


def user_annotations(path):
    with gzip.open(path, "rt") as f:
        trace = json.load(f)
    return trace, [e["name"] for e in trace["traceEvents"] if e.get("cat") == "user_annotation"]


def test_only_the_window_is_recorded(single_rank, tmp_path):
    history = run(tmp_path, step_start=3, step_end=5)
    trace, names = user_annotations(tmp_path / "traces" / "rank0_trace.json.gz")
    assert trace["megatron_ext"]["steps"] == [3, 4] and trace["megatron_ext"]["engine"] == "fake"
    assert trace["distributedInfo"]["rank"] == 0  # HTA reads the rank here
    assert [n for n in names if n.startswith("ProfilerStep")] == ["ProfilerStep#3", "ProfilerStep#4"]
    for label in (LABELS["data"], LABELS["forward"], LABELS["optimizer"]):
        assert names.count(label) == 2, label
    assert [r["step"] for r in history] == [1, 2, 3, 4, 5, 6]


def test_a_resumed_run_past_the_window_records_nothing(single_rank, tmp_path, capsys):
    run(tmp_path, start_iteration=3, step_start=2, step_end=4)
    assert not (tmp_path / "traces").exists()
    assert "nothing is recorded" in capsys.readouterr().out


def test_a_run_ending_inside_the_window_still_writes_its_trace(single_rank, tmp_path):
    run(tmp_path, step_start=5, step_end=9)
    _, names = user_annotations(tmp_path / "traces" / "rank0_trace.json.gz")
    assert [n for n in names if n.startswith("ProfilerStep")] == ["ProfilerStep#5", "ProfilerStep#6"]


def test_nested_regions_are_exclusive(monkeypatch):
    clock = iter(range(100))
    timer = StepRegions(torch.device("cpu"))
    monkeypatch.setattr(timer, "_mark", lambda: float(next(clock)))
    with timer.active():
        with region("backward"):        # 0 .. 5
            with region("grad_reduce"):  # 1 .. 4: 3 s, taken out of backward's 5
                with region("data"):     # 2 .. 3
                    pass
        with region("optimizer"):        # 6 .. 7
            pass
    assert regions._active is None
    seconds = timer.seconds()
    assert seconds == dict(data_time=1.0, forward_time=0.0, backward_time=2.0, pipeline_comm_time=0.0,
                           grad_reduce_time=2.0, optimizer_time=1.0, gc_time=0.0)
    assert timer.seconds() == {name: 0.0 for name in seconds}  # read once


def test_regions_outside_a_step_cost_nothing_and_wrapping_is_idempotent():
    assert regions._active is None
    with region("forward"):  # evaluation, benchmarks: no step being measured
        pass
    wrapped = timed("forward", len)
    assert timed("forward", wrapped) is wrapped and wrapped([1, 2]) == 2


BASE = ["--model", "tiny", "--mock-data", "--train-iters", "10", "--micro-batch-size", "1", "--global-batch-size", "2"]


@pytest.mark.parametrize("flags, message", [
    (["--profile-dir", "x"], "--profile-dir needs --profile"),
    (["--profile-ranks", "0"], "--profile-ranks needs --profile"),
    (["--profile"], "--profile needs --profile-dir DIR or --log-dir DIR"),
    (["--profile", "--log-dir", "l", "--profile-step-start", "0"], "--profile-step-start must be >= 1"),
    (["--profile", "--log-dir", "l", "--profile-step-start", "4", "--profile-step-end", "4"], "must be greater"),
    (["--profile", "--log-dir", "l", "--profile-step-start", "11"], "after the last step (--train-iters 10)"),
    (["--profile", "--log-dir", "l", "--profile-ranks", "0", "2"], "--profile-ranks 2 is not a rank of this world"),
])
def test_bad_profile_flags_are_one_line_errors(flags, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        arguments.parse(BASE + flags, world_size=2)


def test_profile_settings_from_flags():
    run_config = arguments.parse(BASE + ["--profile", "--log-dir", "l", "--profile-step-end", "40",
                                         "--profile-ranks", "1", "0", "1"], world_size=2)
    settings = run_config.profile
    assert (settings.directory, settings.step_start, settings.step_end, settings.ranks) == ("l/traces", 2, 11, (0, 1))
    assert not arguments.parse(BASE, world_size=2).profile.enabled
