"""The optimizer's flags reach every engine: ``--lr-decay-iters`` ends the decay there (``--min-lr`` after it), and
``--adam-beta1/2`` are the AdamW's of the megatron engine, DeepSpeed's and FSDP2's alike; a resumed run continues its
checkpoint's schedule, or says which flags differ (``--override-opt-param-scheduler`` takes them). One rank each, fp32,
tiny Qwen."""

import math

import pytest

from conftest import run_ranks, run_script
from step_checks import assert_close, by_step, records

from megatron_ext.arguments import parse
from megatron_ext.engines.optimizer import settings_from_args

STEPS = range(1, 6)
COMMON = ["finetune_qwen.py", "--model", "tiny", "--mock-data", "--seq-length", "64", "--micro-batch-size", "2",
          "--global-batch-size", "4", "--train-iters", "5", "--lr", "1e-2", "--min-lr", "1e-3", "--lr-decay-style",
          "linear", "--lr-decay-iters", "3"]
BETAS = ["--adam-beta1", "0.5", "--adam-beta2", "0.5"]
RUNS = {"default_betas": [], "megatron": BETAS, "deepspeed": BETAS + ["--engine", "deepspeed"],
        "fsdp": BETAS + ["--engine", "fsdp"]}


def test_flags_become_the_settings():
    args = parse("--adam-beta1 0.8 --adam-beta2 0.99 --adam-eps 1e-6 --train-iters 50".split(), world_size=1).args
    settings = settings_from_args(args)
    assert (settings.adam_beta1, settings.adam_beta2, settings.adam_eps, settings.decay_iters) == (0.8, 0.99, 1e-6, 50)
    assert settings_from_args(parse(["--lr-decay-iters", "20"], world_size=1).args).decay_iters == 20


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("optimizer")
    out = {}
    for name, flags in RUNS.items():
        run_ranks(1, COMMON + flags + ["--log-dir", str(root / name)])
        out[name] = records(root / name)
    return out


@pytest.mark.parametrize("name", list(RUNS))
def test_the_decay_ends_at_lr_decay_iters(runs, name):
    """Linear from 1e-2 to --min-lr 1e-3 over 3 steps, then flat (the record holds the next step's lr)."""
    expected = {1: 7e-3, 2: 4e-3, 3: 1e-3, 4: 1e-3, 5: 1e-3}
    assert by_step(runs[name], "lr") == pytest.approx(expected, rel=1e-9)


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
