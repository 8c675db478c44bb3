"""The optimizer's flags reach every engine: ``--lr-decay-iters`` ends the decay there (``--min-lr`` after it), and
``--adam-beta1/2`` are the AdamW's of the megatron engine, DeepSpeed's and FSDP2's alike; a resumed run continues its
checkpoint's schedule, or says which flags differ (``--override-opt-param-scheduler`` takes them). One rank each, fp32,
tiny Qwen."""

import math

import pytest
import torch

from support.ranks import run_ranks, run_script
from support.step_checks import assert_close, by_step, records

from megatron_ext.arguments import parse
from megatron_ext.engines.optimizer import OptimizerSettings, resume_schedule
from megatron_ext.errors import ConfigError

STEPS = range(1, 6)
COMMON = ["finetune_qwen.py", "--model", "tiny", "--mock-data", "--seq-length", "64", "--micro-batch-size", "2",
          "--global-batch-size", "4", "--train-iters", "5", "--lr", "1e-2", "--min-lr", "1e-3", "--lr-decay-style",
          "linear", "--lr-decay-iters", "3"]
BETAS = ["--adam-beta1", "0.5", "--adam-beta2", "0.5"]
RUNS = {"default_betas": [], "megatron": BETAS, "deepspeed": BETAS + ["--engine", "deepspeed"],
        "fsdp": BETAS + ["--engine", "fsdp"],
        "wsd": ["--lr-decay-style", "WSD", "--lr-decay-iters", "4", "--lr-wsd-decay-iters", "2",
                "--lr-wsd-decay-style", "linear", "--engine", "deepspeed"],
        # the same schedule as the rest in samples (Megatron-LM's --*-samples): 20 samples of 4 a step, decay over 12
        "samples": ["--train-samples", "20", "--lr-decay-samples", "12", "--engine", "fsdp"]}
IN_STEPS = ("--train-iters", "--lr-decay-iters")  # COMMON's, which the samples run replaces


def test_flags_become_the_settings():
    settings = parse("--adam-beta1 0.8 --adam-beta2 0.99 --adam-eps 1e-6 --train-iters 50".split(),
                     world_size=1).optimizer
    assert (settings.adam_beta1, settings.adam_beta2, settings.adam_eps, settings.decay_iters) == (0.8, 0.99, 1e-6, 50)
    assert parse(["--lr-decay-iters", "20"], world_size=1).optimizer.decay_iters == 20


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("optimizer")
    out = {}
    for name, flags in RUNS.items():
        common = [a for i, a in enumerate(COMMON) if a not in IN_STEPS and COMMON[i - 1] not in IN_STEPS] \
            if "--train-samples" in flags else COMMON
        run_ranks(1, common + flags + ["--log-dir", str(root / name)])
        out[name] = records(root / name)
    return out


@pytest.mark.parametrize("name", [name for name in RUNS if name != "wsd"])
def test_the_decay_ends_at_lr_decay_iters(runs, name):
    """Linear from 1e-2 to --min-lr 1e-3 over 3 steps, then flat (the record holds the next step's lr)."""
    expected = {1: 7e-3, 2: 4e-3, 3: 1e-3, 4: 1e-3, 5: 1e-3}
    assert by_step(runs[name], "lr") == pytest.approx(expected, rel=1e-9)


def test_wsd_holds_the_rate_then_anneals(runs):
    """WSD (Megatron-LM's flags): --lr until the last --lr-wsd-decay-iters 2 steps before --lr-decay-iters 4, linear
    to --min-lr over those two, flat after."""
    expected = {1: 1e-2, 2: 1e-2, 3: 5.5e-3, 4: 1e-3, 5: 1e-3}
    assert by_step(runs["wsd"], "lr") == pytest.approx(expected, rel=1e-9)


def schedule(steps: int, **settings):
    """A scheduler from ``OptimizerSettings(**settings)`` after ``steps`` steps: its learning rate and state."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    scheduler = OptimizerSettings(**dict(dict(lr=1.0, min_lr=0.1, decay_iters=10), **settings)).lr_schedule(optimizer)
    scheduler.step(steps)
    return optimizer.param_groups[0]["lr"], scheduler


def test_a_schedule_in_samples_resumes_where_it_was():
    """Saved after 3 steps of 64 samples, a schedule in samples resumes at sample 192 with the rate it had (it came
    back at sample 12,288, the decay's end, when megatron-core's replay of the count was multiplied by 64)."""
    rate, saved = schedule(3, samples_per_step=64, decay_iters=640, warmup_iters=0, decay_style="linear")
    _, resumed = schedule(0, samples_per_step=64, decay_iters=640, warmup_iters=0, decay_style="linear")
    resume_schedule(resumed, saved.state_dict())
    assert resumed.num_steps == 192 and resumed.get_lr(resumed.optimizer.param_groups[0]) == pytest.approx(rate)
    assert rate == pytest.approx(0.1 + 0.9 * (1 - 192 / 640))


def test_a_schedule_in_samples_advances_a_global_batch_a_step():
    """--train-samples 640 of 64 a step: 10 steps; warm-up over 96 samples and a linear decay to sample 512, as
    Megatron-LM's sample-based schedule (the rate at step k is the one at sample 64k)."""
    args = parse("--train-samples 640 --global-batch-size 64 --micro-batch-size 8 --lr-warmup-samples 96 "
                 "--lr-decay-samples 512 --lr-decay-style linear --lr 1.0 --min-lr 0.1".split(), world_size=8)
    settings = args.optimizer
    assert (args.training.train_iters, settings.samples_per_step, settings.warmup_iters, settings.decay_iters) == (
        10, 64, 96, 512)
    expected = [64 / 96] + [0.1 + 0.9 * (1 - (64 * k - 96) / (512 - 96)) for k in range(2, 9)] + [0.1, 0.1]
    got = [schedule(k, samples_per_step=64, warmup_iters=96, decay_iters=512, decay_style="linear")[0]
           for k in range(1, 11)]
    assert got == pytest.approx(expected, rel=1e-12)
    fraction = parse("--train-samples 640 --global-batch-size 64 --micro-batch-size 8 "
                     "--lr-warmup-fraction 0.25".split(), world_size=8).optimizer
    assert (fraction.warmup_iters, fraction.decay_iters) == (160, 640)
    assert parse("--train-iters 40 --lr-warmup-fraction 0.1".split(), world_size=1).optimizer.warmup_iters == 4


def test_resuming_in_another_unit_is_refused_unless_overridden():
    """A checkpoint whose schedule counted steps, resumed by a run counting samples: refused; overridden, it goes on
    from the same point (step 3 = sample 192)."""
    _, saved = schedule(3)
    with pytest.raises(ConfigError, match=r"counted its schedule in steps, this run in samples \(64 a step\)"):
        resume_schedule(schedule(0, samples_per_step=64, decay_iters=640)[1], saved.state_dict())
    _, new = schedule(0, samples_per_step=64, decay_iters=640, override_schedule=True)
    resume_schedule(new, saved.state_dict())
    assert new.num_steps == 192


@pytest.mark.parametrize("style, shape", [("linear", lambda r: 1 - r),
                                          ("cosine", lambda r: (1 + math.cos(math.pi * r)) / 2),
                                          ("exponential", lambda r: 2 * 0.5 ** r - 1),
                                          ("minus_sqrt", lambda r: 1 - r ** 0.5)])
def test_every_wsd_annealing_shape(style, shape):
    """Warm-up 2 steps from 0, 1.0 through step 6, then ``shape`` of the annealing's progress down to 0.1 at 10."""
    wsd = dict(warmup_iters=2, decay_style="WSD", wsd_decay_iters=4, wsd_decay_style=style)
    expected = [0.5, 1.0, 1.0, 1.0, 1.0, 1.0] + [0.1 + 0.9 * shape(k / 4) for k in (1, 2, 3, 4)] + [0.1]
    assert [schedule(step, **wsd)[0] for step in range(1, 12)] == pytest.approx(expected, rel=1e-12)


def test_inverse_square_root_decay():
    """Megatron-LM's ``inverse-square-root``: --lr x sqrt(warm-up / step) after the warm-up, never under --min-lr."""
    got = [schedule(step, warmup_iters=4, decay_style="inverse-square-root", min_lr=0.3, decay_iters=1000)[0]
           for step in (4, 9, 16, 100)]
    assert got == pytest.approx([1.0, 2 / 3, 0.5, 0.3], rel=1e-12)


def test_resuming_with_another_annealing_phase_is_refused():
    """WSD's settings travel in the schedule's state (megatron-core's leaves them out), so a resume with another
    --lr-wsd-decay-iters or -style is refused like any other schedule change, unless overridden."""
    _, saved = schedule(3, decay_style="WSD", wsd_decay_iters=4)
    state = saved.state_dict()
    resume_schedule(schedule(0, decay_style="WSD", wsd_decay_iters=4)[1], state)  # the same schedule: goes on
    for changed, flag in ((dict(wsd_decay_iters=2), "--lr-wsd-decay-iters 4"),
                          (dict(wsd_decay_style="cosine"), "--lr-wsd-decay-style exponential")):
        with pytest.raises(ConfigError, match=f"was training with {flag}, this run asks for"):
            resume_schedule(schedule(0, **dict(dict(decay_style="WSD", wsd_decay_iters=4), **changed))[1], state)
    _, new = schedule(0, decay_style="WSD", wsd_decay_iters=2, override_schedule=True)
    resume_schedule(new, state)
    assert (new.num_steps, new.wsd_decay_steps) == (3, 2)


@pytest.mark.parametrize("flags, says", [
    ("--lr-decay-style WSD", "--lr-decay-style WSD needs --lr-wsd-decay-iters N"),
    ("--lr-wsd-decay-iters 3", "--lr-wsd-decay-iters shapes WSD's annealing phase, but --lr-decay-style is cosine"),
    ("--lr-wsd-decay-style linear", "--lr-wsd-decay-style shapes WSD's annealing phase"),
    ("--lr-decay-style WSD --lr-wsd-decay-iters 9 --lr-warmup-iters 2",
     "--lr-wsd-decay-iters 9 is longer than the 8 steps from the warm-up's end to --lr-decay-iters"),
    ("--train-samples 64", "--train-iters and --train-samples both give the run's length; keep one"),
    ("--lr-decay-samples 64", "--lr-decay-samples counts samples, but the run's length is --train-iters: use "
                              "--lr-decay-iters, or give --train-samples"),
    ("--lr-warmup-fraction 0.1 --lr-warmup-iters 2", "--lr-warmup-fraction and --lr-warmup-iters both give"),
])
def test_wsd_flags_that_cannot_work_are_refused(flags, says):
    with pytest.raises(ConfigError, match=says):
        parse(f"--train-iters 10 {flags}".split(), world_size=1)


@pytest.mark.parametrize("flags, says", [
    ("--train-samples 3", "--train-samples 3 is less than one --global-batch-size 4"),
    ("--train-samples 40 --lr-decay-iters 5", "--lr-decay-iters counts steps, but the run's length is "
                                              "--train-samples: use --lr-decay-samples"),
])
def test_sample_flags_that_cannot_work_are_refused(flags, says):
    with pytest.raises(ConfigError, match=says):
        parse(f"--global-batch-size 4 --micro-batch-size 4 {flags}".split(), world_size=1)


def test_adam_betas_reach_every_engine(runs):
    """Every engine with betas (0.5, 0.5) computes the same steps, and not those of the default (0.9, 0.95) (the
    first update is the same for any betas: the runs part from step 3)."""
    ours = by_step(runs["megatron"])
    for engine in ("deepspeed", "fsdp"):
        assert_close(by_step(runs[engine]), ours, 1e-5, STEPS)
    default = by_step(runs["default_betas"])
    apart = max(abs(default[s] / ours[s] - 1) for s in (3, 4, 5))  # measured: 5.7e-3 (step 4)
    assert default[2] == pytest.approx(ours[2], rel=1e-6) and apart > 1e-3, (default, ours)


def cosine(step: int, decay: int, top: float = 1e-2, bottom: float = 1e-3) -> float:
    return bottom + (top - bottom) * 0.5 * (1 + math.cos(math.pi * min(step, decay) / decay))


@pytest.mark.parametrize("engine", ["megatron", "deepspeed", "fsdp"])
def test_resuming_under_another_schedule_is_refused_unless_overridden(tmp_path, engine):
    """Saved at step 3 of a 5-step cosine schedule (and run on to 5), resumed from that iter_ directory: with the
    same flags, steps 4-5 as before; with --train-iters 8 (megatron-core would silently have kept the old schedule,
    at --min-lr from step 5 on) refused in one line, nothing written; with --override-opt-param-scheduler too, steps
    4-8 on the 8-step schedule (and, with another --seed, a line saying the data order changed). metrics.jsonl
    continues: steps 1-3 of the first run, then the resumed ones."""
    flags = COMMON[:COMMON.index("--train-iters")] + ["--lr", "1e-2", "--min-lr", "1e-3", "--engine", engine,
                                                      "--log-dir", str(tmp_path)]
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    run_ranks(1, flags + ["--train-iters", "5", "--save", str(ckpt), "--save-interval", "3"])
    first = by_step(records(tmp_path))
    proc = run_ranks(1, flags + ["--train-iters", "5", "--load", str(ckpt / "iter_0000003")])
    assert f"resumed from --load {ckpt / 'iter_0000003'} at step 3" in proc.stdout and "resuming with" not in proc.stdout
    assert_close(by_step(records(tmp_path)), first, 1e-5, STEPS)
    written = metrics.read_text()
    resume = flags + ["--train-iters", "8", "--load", str(ckpt / "iter_0000003")]
    proc = run_script(resume)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and lines[-1] == (
        "error: the checkpoint under --load was training with --lr-decay-iters 5, this run asks for --lr-decay-iters "
        "8 (--lr-decay-iters defaults to --train-iters): pass the checkpoint's values to continue its schedule, or "
        "--override-opt-param-scheduler to follow this run's from step 3"), proc.stderr[-3000:]
    assert metrics.read_text() == written
    proc = run_ranks(1, resume + ["--override-opt-param-scheduler", "--seed", "7"])
    assert "megatron_ext: resuming with --seed 7 (the checkpoint's: 1234): the data goes on" in proc.stdout
    steps = records(tmp_path)
    assert [r["step"] for r in steps] == list(range(1, 9))
    assert written.splitlines()[:3] == metrics.read_text().splitlines()[:3]
    expected = {s: cosine(s, 5) for s in (1, 2, 3)} | {s: cosine(s, 8) for s in range(4, 9)}
    assert by_step(steps, "lr") == pytest.approx(expected, rel=1e-9)
