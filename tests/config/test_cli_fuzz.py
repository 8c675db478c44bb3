"""Every numeric flag of the three entry points is checked before any process group exists. Property-based: command
lines drawn with bad values (negative, zero, nan, inf, huge, not a number) or bad combinations end in exactly one
line ``error: ...`` and exit status 2 -- no traceback, nothing written -- and the valid command lines drawn by the
same strategies parse. A few real entry-point processes confirm it end to end."""

import contextlib
import io
import os
import shlex
import subprocess
import sys
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_ext import arguments
from megatron_ext.cli import run_main

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPTS = {"qwen": "finetune_qwen.py", "vit": "pretrain_vit.py", "gpt": "pretrain_gpt.py"}
BASE = {"qwen": ["--mock-data", "--distributed-backend", "gloo"], "vit": ["--mock-data", "--num-workers", "0"],
        "gpt": ["--mock-data"]}
ALL = ("qwen", "vit", "gpt")
LM = ("qwen", "gpt")  # the MoE flags: finetune_qwen.py's, and pretrain_gpt.py's for Qwen MoE models
FUZZ = settings(derandomize=True, deadline=None, max_examples=150, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

# (flag, kind, families): every numeric flag of the three entry points
FLAGS = [(f, "positive_int", ALL) for f in (
    "--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--context-parallel-size",
    "--expert-model-parallel-size", "--expert-tensor-parallel-size", "--num-layers-per-virtual-pipeline-stage",
    "--zero-hpz-partition-size", "--micro-batch-size", "--global-batch-size", "--seq-length",
    "--recompute-num-layers", "--eval-iters", "--exit-interval", "--save-interval", "--profile-step-start",
    "--profile-step-end", "--num-layers", "--save-retain", "--ddp-bucket-size", "--lr-decay-iters",
    "--lr-wsd-decay-iters", "--train-samples", "--lr-decay-samples", "--lr-wsd-decay-samples")]
FLAGS += [(f, "nonneg_int", ALL) for f in ("--train-iters", "--lr-warmup-iters", "--eval-interval", "--profile-ranks",
                                            "--local-rank", "--lr-warmup-samples", "--manual-gc-interval")]
FLAGS += [(f, "nonneg_float", ALL) for f in ("--lr", "--min-lr", "--weight-decay", "--clip-grad")]
FLAGS += [(f, "fraction", ALL) for f in ("--adam-beta1", "--adam-beta2", "--lr-warmup-fraction")]
FLAGS += [(f, "positive_float", ALL) for f in ("--loss-scale", "--initial-loss-scale", "--peak-tflops", "--adam-eps",
                                                "--exit-duration-in-mins", "--distributed-timeout-minutes")]
FLAGS += [("--seed", "seed", ALL), ("--loss-spike-factor", "above_one", ALL), ("--data-split", "split", ALL),
          ("--make-vocab-size-divisible-by", "positive_int", ("qwen", "gpt")),
          ("--lora-rank", "nonneg_int", ("qwen", "vit")), ("--eval-generate-samples", "nonneg_int", ("qwen",)), ("--lora-alpha", "positive_float", ("qwen", "vit")),
          ("--lora-dropout", "fraction", ("qwen", "vit")),
          ("--image-size", "positive_int", ("vit",)), ("--num-classes", "at_least_2", ("vit",)),
          ("--label-smoothing", "fraction", ("vit",)), ("--num-workers", "nonneg_int", ("vit",)),
          ("--num-experts", "at_least_2", LM), ("--moe-router-topk", "positive_int", LM),
          ("--moe-ffn-hidden-size", "positive_int", LM), ("--moe-shared-expert-intermediate-size", "nonneg_int", LM),
          ("--moe-aux-loss-coeff", "nonneg_float", LM), ("--moe-z-loss-coeff", "nonneg_float", LM),
          ("--moe-expert-capacity-factor", "positive_float", LM),
          ("--dpo-beta", "positive_float", ("qwen",)), ("--dpo-label-smoothing", "fraction", ("qwen",)),
          ("--dpo-f-alpha", "positive_float", ("qwen",)), ("--dpo-discopop-tau", "positive_float", ("qwen",)),
          ("--dpo-simpo-gamma", "nonneg_float", ("qwen",)), ("--center-rewards-coefficient", "nonneg_float", ("qwen",)),
          ("--dpo-loss", "dpo_loss", ("qwen",)), ("--dpo-loss-weights", "weights", ("qwen",)),
          ("--kto-desirable-weight", "positive_float", ("qwen",)),
          ("--kto-undesirable-weight", "positive_float", ("qwen",)), ("--dpo-ld-alpha", "unit", ("qwen",)),
          ("--rampup-batch-size", "positive_int", ("gpt",)),
          ("--check-weight-hash-across-dp-replicas-interval", "positive_int", ALL)]
CHOICES = ["--engine", "--zero-stage", "--lr-decay-style", "--lr-wsd-decay-style", "--distributed-backend", "--on-nan",
           "--offload-param", "--recompute-granularity", "--recompute-method", "--kto-loss"]
VALID_CHOICES = {"megatron", "deepspeed", "fsdp", "cosine", "linear", "constant", "inverse-square-root", "WSD",
                 "exponential", "minus_sqrt", "nccl", "gloo", "stop", "skip", "cpu", "nvme", "full", "selective",
                 "uniform", "block", "kto"}

# no digits, no letters of nan/inf/infinity: never a number
junk = st.text(alphabet="bcdeghjklmopqrstuvwxyz!@#%^&*()/;: -_.", max_size=8)
non_finite = st.sampled_from(["nan", "-nan", "NaN", "inf", "-inf", "Infinity", "1e400", "-1e999"])
not_an_int = junk | non_finite | st.floats(allow_nan=False).map(repr) | st.just("9" * 5000)
negative = st.floats(max_value=-5e-324, allow_infinity=False).map(repr)
BAD = {
    "positive_int": st.integers(max_value=0).map(str) | not_an_int,
    "nonneg_int": st.integers(max_value=-1).map(str) | not_an_int,
    "at_least_2": st.integers(max_value=1).map(str) | not_an_int,
    "seed": (st.integers(max_value=-1) | st.integers(min_value=2**32)).map(str) | not_an_int,
    "nonneg_float": negative | non_finite | junk,
    "positive_float": st.floats(max_value=0.0, allow_infinity=False).map(repr) | non_finite | junk,
    "above_one": st.floats(max_value=1.0, allow_infinity=False).map(repr) | non_finite | junk,
    "fraction": negative | st.floats(min_value=1.0, allow_infinity=False).map(repr) | non_finite | junk,
    "unit": negative | st.floats(min_value=1.0, exclude_min=True, allow_infinity=False).map(repr) | non_finite | junk,
    "split": st.sampled_from(["1", "1,2,3", "0,1", "-1,1", "1,-1", "nan,1", "1,inf", "a,b", "", ",", "1e400,1"])
    | junk,
    "dpo_loss": st.sampled_from(["aot", "aot_unpaired", "sigmoid,sigmoid", "", "sigmoid,", "SIGMOID", "dpo"]) | junk,
    "weights": st.sampled_from(["", "-1", "1,-0.5", "nan", "1,inf", "a", "1,,2"]) | junk,
}
# bad combinations of values that are each fine: (families, flags, compatible with --save)
COMBOS = [
    (ALL, "--lr 0.01 --min-lr 0.1", True),
    (ALL, "--tensor-model-parallel-size 3", True),
    (ALL, "--micro-batch-size 2 --global-batch-size 3", True),
    (ALL, "--profile --profile-step-start 20 --train-iters 10", True),
    (ALL, "--profile --profile-step-start 3 --profile-step-end 3", True),
    (ALL, "--profile --profile-ranks 4", True),
    (ALL, "--save-retain 2", False),
    (ALL, "--recompute-granularity full --recompute-num-layers 3", True),
    (ALL, "--recompute-method block", True),
    (ALL, "--recompute-granularity full --recompute-method block --recompute-num-layers 9", True),
    (ALL, "--engine deepspeed --zero-stage 3 --zero-hpz-partition-size 3", True),
    (ALL, "--pipeline-model-parallel-size 1 --num-layers-per-virtual-pipeline-stage 1", True),
    (ALL, "--tensor-model-parallel-size 1 --sequence-parallel", True),
    (ALL, "--bf16 --fp16", True),
    (ALL, "--train-samples 640", True),
    (ALL, "--lr-decay-samples 640", True),
    (ALL, "--lr-warmup-fraction 0.1 --lr-warmup-iters 3", True),
    (ALL, "--lr-decay-style WSD", True),
    (ALL, "--lr-decay-style cosine --lr-wsd-decay-iters 5", True),
    (ALL, "--lr-decay-style WSD --lr-wsd-decay-iters 2000000", True),
    (ALL, "--zero-hpz-partition-size 2", True),
    (ALL, "--exit-signals SIGKILL", True),
    (("qwen",), "--num-experts 4 --moe-router-topk 5", True),
    (("qwen",), "--model tiny --moe-router-topk 2", True),
    (("qwen",), "--model tiny-moe --moe-layer-freq 1,0", True),
    (("qwen", "vit"), "--lora-rank 3 --tensor-model-parallel-size 2", True),
    (("qwen", "vit"), "--lora-rank 4 --lora-targets qkv,mlp", True),
    (("vit",), "--image-size 30", True),
    (("vit",), "--context-parallel-size 2", True),
    (("gpt",), "--seq-length 4096", True),
]


def one_of(values):
    return st.sampled_from(values)


@st.composite
def valid_command(draw, root):
    """A family, a world size and a command line that must parse: the tiny model, mock data, drawn values."""
    family, world = draw(one_of(ALL)), draw(one_of([1, 2, 4]))
    argv = list(BASE[family])
    moe = family == "qwen" and draw(st.booleans())
    tp = draw(one_of([t for t in (1, 2) if world % t == 0]))
    pp = draw(one_of([p for p in (1, 2) if world % (tp * p) == 0]))
    dp, mbs = world // (tp * pp), draw(st.integers(1, 4))
    argv += ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
             "--micro-batch-size", str(mbs), "--global-batch-size", str(mbs * dp * draw(st.integers(1, 4)))]
    lr = draw(st.floats(0, 1))
    train_iters = draw(st.integers(1, 10**6))
    argv += ["--lr", repr(lr), "--min-lr", repr(draw(st.floats(0, lr))), "--train-iters", str(train_iters),
             "--lr-warmup-iters", str(draw(st.integers(0, 100))), "--weight-decay", repr(draw(st.floats(0, 1))),
             "--clip-grad", repr(draw(st.floats(0, 10))), "--seed", str(draw(st.integers(0, 2**32 - 1))),
             "--eval-interval", str(draw(st.integers(0, 100))), "--eval-iters", str(draw(st.integers(1, 10))),
             "--data-split", f"{draw(st.integers(1, 99))},{draw(st.integers(0, 99))}",
             "--initial-loss-scale", repr(draw(st.floats(1, 2.0**32))),
             "--distributed-timeout-minutes", repr(draw(st.floats(0.1, 1e3)))]
    optional = {"--save-interval": st.integers(1, 1000).map(str), "--exit-interval": st.integers(1, 1000).map(str),
                "--peak-tflops": st.floats(1e-3, 1e4).map(repr), "--loss-scale": st.floats(1, 2.0**16).map(repr),
                "--exit-duration-in-mins": st.floats(0.01, 1e4).map(repr),
                "--loss-spike-factor": st.floats(1.01, 100).map(repr),
                "--lr-decay-iters": st.integers(101, 10**6).map(str),  # past any --lr-warmup-iters drawn
                "--adam-beta1": st.floats(0, 0.999).map(repr), "--adam-beta2": st.floats(0, 0.9999).map(repr),
                "--adam-eps": st.floats(1e-12, 1e-3).map(repr)}
    for flag, values in optional.items():
        if draw(st.booleans()):
            argv += [flag, draw(values)]
    if draw(st.booleans()):
        argv += ["--save", os.path.join(root, "ckpt"), "--save-retain", str(draw(st.integers(1, 5)))]
    if draw(st.booleans()):
        argv += ["--log-dir", os.path.join(root, "logs"), "--profile",
                 "--profile-step-start", str(draw(st.integers(1, min(train_iters, 5)))), "--profile-ranks", "0"]
    if family == "qwen" and moe:
        argv += ["--model", "tiny-moe", "--moe-router-topk", str(draw(st.integers(1, 4))),
                 "--moe-aux-loss-coeff", repr(draw(st.floats(0, 1))), "--moe-z-loss-coeff", repr(draw(st.floats(0, 1))),
                 "--moe-expert-capacity-factor", repr(draw(st.floats(0.1, 4)))]
        if tp > 1:
            argv += ["--sequence-parallel"]
    elif family in ("qwen", "vit") and draw(st.booleans()):
        argv += ["--lora-rank", str(tp * draw(st.integers(1, 8))), "--lora-alpha", repr(draw(st.floats(0.1, 64))),
                 "--lora-dropout", repr(draw(st.floats(0, 0.9)))]
    if family == "vit":
        argv += ["--image-size", str(8 * draw(st.integers(1, 8))), "--num-classes", str(draw(st.integers(2, 1000))),
                 "--label-smoothing", repr(draw(st.floats(0, 0.99)))]
    elif family == "gpt":
        argv += ["--seq-length", str(draw(st.integers(1, 512)))]
    elif not moe or tp == 1:
        argv += ["--seq-length", str(draw(st.integers(1, 4096)))]
    return family, world, argv


def cli(argv, family, world):
    """What an entry point does with ``argv``: (exit status, stderr)."""
    err = io.StringIO()
    with mock.patch.dict(os.environ, {"RANK": "0"}), contextlib.redirect_stderr(err):
        try:
            run_main(lambda: arguments.parse(argv, world_size=world, family=family))
            code = 0
        except SystemExit as e:
            code = e.code
    return code, err.getvalue()


def assert_one_line(code, stderr, argv):
    lines, command = stderr.splitlines(), shlex.join(argv)
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (command, code, stderr[-2000:])
    assert "Traceback" not in stderr, (command, stderr[-2000:])


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("cli_fuzz"))


@FUZZ
@given(data=st.data())
def test_valid_commands_parse(root, data):
    family, world, argv = data.draw(valid_command(root))
    assert cli(argv, family, world) == (0, ""), argv
    assert os.listdir(root) == []


@st.composite
def bad_command(draw, root):
    family, world, argv = draw(valid_command(root))
    how = draw(one_of(["value", "value", "value", "combo", "choice", "unknown", "missing"]))
    if how == "value":
        for _ in range(draw(st.integers(1, 3))):  # one or more bad values, anywhere after the valid ones
            flag, kind, _families = draw(one_of([f for f in FLAGS if family in f[2]]))
            value = draw(BAD[kind])
            argv += draw(one_of([[flag, value], [f"{flag}={value}"]]))
    elif how == "combo":
        families, flags, save_ok = draw(one_of([c for c in COMBOS if family in c[0]]))
        if not save_ok and "--save" in argv:
            at = argv.index("--save")
            del argv[at:at + 4]  # --save DIR --save-retain N
        argv += flags.split()
    elif how == "choice":
        argv += [draw(one_of(CHOICES)), draw(junk.filter(lambda v: not v.startswith("-") and v not in VALID_CHOICES)
                                             | st.just("4"))]
    elif how == "unknown":
        argv.insert(draw(st.integers(0, len(argv))), draw(one_of(["--no-such-flag", "--learning-rate", "--tensor",
                                                                   "--lr-max", "-x", "--num-layer"])))
    else:
        argv.append(draw(one_of([f for f, _kind, families in FLAGS if family in families])))
    return family, world, argv


@FUZZ
@given(data=st.data())
def test_bad_commands_are_one_line_exit_2(root, data):
    family, world, argv = data.draw(bad_command(root))
    assert_one_line(*cli(argv, family, world), argv)
    assert os.listdir(root) == []


def test_every_numeric_flag_is_fuzzed():
    """A new numeric flag must join FLAGS (and so get a range): the table is checked against the parsers."""
    numeric = set()
    for family in ALL:
        for action in arguments.build_parser(family=family)._actions:
            if action.type is not None and action.type is not str and not action.choices:
                numeric.add((action.option_strings[-1], family))
    assert numeric == {(flag, family) for flag, _kind, families in FLAGS for family in families}


def test_every_flag_refuses_typical_bad_values():
    """Not left to chance: each flag of FLAGS with each of a few bad values of its kind, in every family."""
    typical = {"positive_int": ["0", "-3", "1.5", "nan", "x"], "nonneg_int": ["-1", "2.0", "inf", ""],
               "at_least_2": ["1", "0", "two"], "seed": ["-1", str(2**32), "1e3"],
               "nonneg_float": ["-1", "-1e-9", "nan", "inf", "1e400", "abc"],
               "positive_float": ["0", "-2.5", "nan", "-inf", "1e999"], "above_one": ["1", "0.5", "nan", "inf"],
               "fraction": ["1", "-0.1", "1.5", "nan", "inf"], "unit": ["-0.1", "1.01", "nan", "inf"],
               "split": ["1", "0,1", "nan,1", "1,-1", "a,b"],
               "dpo_loss": ["aot", "sigmoid,sigmoid", "", "kto"], "weights": ["-1", "nan", "1,", "x"]}
    for flag, kind, families in FLAGS:
        for family in families:
            for value in typical[kind]:
                argv = BASE[family] + [f"{flag}={value}"]
                assert_one_line(*cli(argv, family, 1), argv)


def test_help_still_works():
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as info:
        arguments.parse(["--help"], world_size=1, family="vit")
    assert info.value.code == 0 and "--label-smoothing" in out.getvalue()


@pytest.mark.parametrize("family, flags", [
    ("qwen", ["--lr", "-1"]),
    ("vit", ["--mock-data", "--label-smoothing", "nan"]),
    ("gpt", ["--mock-data", "--train-iters", "ten"]),
    ("qwen", ["--mock-data", "--seq-length", "128", "--no-such-flag"]),
])
def test_entry_points_refuse_with_one_line_and_write_nothing(tmp_path, family, flags):
    save, logs = tmp_path / "ckpt", tmp_path / "logs"
    proc = subprocess.run([sys.executable, SCRIPTS[family], *flags, "--save", str(save), "--log-dir", str(logs)],
                          cwd=REPO, env=dict(os.environ, RANK="0", WORLD_SIZE="1"), capture_output=True, text=True,
                          timeout=120)
    assert_one_line(proc.returncode, proc.stderr, flags)
    assert not save.exists() and not logs.exists()


TOOLS = ["eval_math", "compare_runs", "convert_hf_to_mcore", "convert_mcore_to_hf", "analyze_traces", "math_report",
         "merge_traces", "preprocess_data", "upcycle_moe", "verify_model"]


@pytest.mark.parametrize("tool", TOOLS)
def test_every_tool_refuses_a_bad_flag_in_one_line(tool):
    """A flag the tool does not know, or a required one missing: one line, exit 2, as the entry points (argparse's
    usage block and "tool.py: error:" were two or three lines)."""
    import runpy

    err = io.StringIO()
    with mock.patch.object(sys, "argv", [f"tools/{tool}.py", "--no-such-flag"]), \
            mock.patch.dict(os.environ, {"RANK": "0"}), contextlib.redirect_stderr(err), pytest.raises(SystemExit) as end:
        runpy.run_path(os.path.join(REPO, "tools", f"{tool}.py"), run_name="__main__")
    assert_one_line(end.value.code, err.getvalue(), [tool, "--no-such-flag"])
