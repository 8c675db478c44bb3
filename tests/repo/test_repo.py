"""The repository's promises: README's commands are the ones CI and users run, and the quickstart trains."""

import json
import math
import glob
import os
import re
import shlex
import subprocess
import sys

from support import REPO
from support.ranks import free_port, run_ranks
from support.launcher_commands import clean_env, supervised


def as_written(launcher, *extra):
    """A quickstart's own command line (its DRY_RUN=1 line, extra flags passed through as a user would) run on
    forked CPU ranks: the script's mesh and flags as written, without torchrun paying every rank's imports again.
    test_quickstart_trains runs README's first command for real, torchrun and all."""
    line = subprocess.run(["bash", launcher, *map(str, extra)], cwd=REPO, env=clean_env(DRY_RUN=1),
                          capture_output=True, text=True, timeout=30, check=True).stdout.strip().splitlines()[-1]
    argv = shlex.split(line)
    assert supervised(argv), line  # torchrun under megatron_ext.launch
    script = next(i for i, word in enumerate(argv) if word.endswith(".py"))
    return run_ranks(int(argv[argv.index("--nproc-per-node") + 1]), argv[script:], plot=True)


def noise(output):
    """Lines of library noise: a warning, kineto's USDT lines."""
    return [line for line in output.splitlines() if re.search(r"Warning|warnings\.warn|WARNING|^USDT", line)]


def readme_commands():
    text = open(os.path.join(REPO, "README.md")).read()
    block = re.search(r"```bash\n(.*?)```", text, re.S).group(1)
    return [line.split("  #")[0].strip() for line in block.strip().splitlines()]


def test_ci_runs_exactly_the_readme_test_command():
    quickstart, tests = readme_commands()
    assert quickstart == "bash examples/cpu_quickstart.sh"
    ci = open(os.path.join(REPO, ".ci/run")).read().strip().splitlines()[-1]
    assert ci == tests


def test_the_long_files_the_lanes_start_with_exist():
    from conftest import LONG_FILES

    missing = [name for name in LONG_FILES if not glob.glob(os.path.join(REPO, "tests", "*", name))]
    assert not missing and len(set(LONG_FILES)) == len(LONG_FILES), f"conftest.LONG_FILES names {missing}"


def test_set_up_checks_imports_quietly():
    """The set-up script's last check is the first thing a new user's first quickstart prints: it imports the stack
    with megatron_ext's filters already in place, so megatron-core's TE/apex notices and DeepSpeed's accelerator line
    stay off that screen (run here as the script runs it, from the script's own line). What no CPU rank uses is
    deferred (platform/imports.py): megatron-core's torch.compile fusions are off without CUDA, so Inductor's
    compiler is not imported."""
    script = open(os.path.join(REPO, "scripts", "setup_venv.sh")).read()
    check = re.search(r"^\"\$venv/bin/python\" -c '([^']*)'$", script, re.M).group(1)
    deferred = ("; import sys, megatron.core.jit as jit; print(jit.jit_fuser is jit.noop_decorator, "
                "'torch._inductor.compile_fx' in sys.modules)")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    proc = subprocess.run([sys.executable, "-c", check + deferred], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stderr == "", proc.stdout + proc.stderr
    assert proc.stdout == "True False\n", proc.stdout


def test_quickstart_trains(tmp_path):
    """README's main job, as written, shortened: SFT on TP2 x PP2 CPU ranks, metrics per step, loss falls,
    validation runs, and the summary plot is written. Its screen is ours: no library warning anywhere (known ones
    are filtered as megatron_ext is imported, platform/quiet.py; torchrun's OMP banner is not triggered), and the
    first line is one of ours or the progress bar."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONWARNINGS", "OMP_NUM_THREADS")}
    proc = subprocess.run(["bash", "examples/cpu_quickstart.sh", "--train-iters", "10", "--eval-interval", "5",
                           "--log-dir", str(tmp_path)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=600, env=dict(env, MASTER_PORT=str(free_port())))
    assert proc.returncode == 0, proc.stdout[-4000:]
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert noise(proc.stdout) == []
    assert lines[0].startswith(("megatron_ext:", "train:")), lines[:5]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 11))
    assert records[-1]["loss"] < records[0]["loss"] - 0.3
    assert [r["step"] for r in records if r.get("val_loss") is not None] == [5, 10]
    assert (tmp_path / "training.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"plot: {tmp_path / 'training.png'}" in proc.stdout


def test_vit_quickstart_trains(tmp_path):
    """examples/vit_cpu_quickstart.sh as written (its command line), shortened: the shipped images through
    DataLoader workers on two CPU ranks, the loss falls over 60 steps, validation improves, summary and plot written."""
    proc = as_written("examples/vit_cpu_quickstart.sh", "--train-iters", "60", "--eval-interval", "30",
                      "--log-dir", tmp_path)
    assert noise(proc.stdout + proc.stderr) == []
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 61)) and all(math.isfinite(r["loss"]) for r in records)
    first, last = (sum(r["loss"] for r in part) / 10 for part in (records[:10], records[-10:]))
    assert last < first - 0.02, (first, last)  # measured: 1.616 -> 1.578 (one step's noise is about 0.03)
    val = [r["val_loss"] for r in records if r.get("val_loss") is not None]
    assert len(val) == 2 and val[1] < val[0] and 0.0 <= records[-1]["val_top1"] <= 1.0, val
    assert "final val top-1" in proc.stdout and (tmp_path / "training.png").is_file()
    assert "top-5" not in proc.stdout and all("val_top5" not in r for r in records)  # 5 classes: always 100%
    # Throughput in images, not in tokens (patches): the progress bar and the summary
    assert " img/s" in proc.stderr + proc.stdout and "images/s" in proc.stdout and "tokens/s" not in proc.stdout
    assert all(r["tokens_per_sec"] is None and r["samples_per_sec"] > 0 for r in records)


def test_moe_quickstart_trains(tmp_path):
    """examples/moe_cpu_quickstart.sh as written (its command line), shortened and profiled (PROFILE=1's flag):
    the tiny MoE under TP2 + SP x EP2 on four CPU ranks, loss falls, router statistics logged every step (aux loss ~1
    when balanced, load around the balanced share) and plotted. No library line between ours: torch's deprecation
    of the collectives megatron-core's dispatcher calls, kineto's profiler_start/stop (platform/quiet.py)."""
    proc = as_written("examples/moe_cpu_quickstart.sh", "--train-iters", "8", "--eval-interval", "8",
                      "--log-dir", tmp_path, "--profile", "--profile-step-end", "4")
    assert noise(proc.stdout + proc.stderr) == []
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 9))
    assert records[-1]["loss"] < records[0]["loss"] - 0.3 and records[-1]["val_loss"] is not None
    for r in records:
        assert 0.5 < r["moe_aux_loss"] < 4.0 and r["moe_z_loss"] > 0
        assert 0.0 <= r["moe_load_min"] <= 1.0 <= r["moe_load_max"] <= 4.0 and r["moe_load_cv"] >= 0
    assert "busiest expert / balanced share" in proc.stdout


def test_gpt2_quickstart_trains(tmp_path):
    """examples/gpt2_cpu_quickstart.sh as written (its command line), shortened: the shipped Shakespeare sample
    tokenized by the shipped tiny GPT-2 tokenizer (cached), TP2 + SP on two CPU ranks; the loss falls and validation
    runs."""
    proc = as_written("examples/gpt2_cpu_quickstart.sh", "--train-iters", "10", "--eval-interval", "10",
                      "--lr-warmup-iters", "2", "--log-dir", tmp_path, "--data-cache-dir", tmp_path / "cache")
    assert noise(proc.stdout + proc.stderr) == []
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 11))
    assert records[-1]["loss"] < records[0]["loss"] - 0.5 and records[-1]["val_loss"] is not None
    assert json.loads((tmp_path / "summary.json").read_text())["run"]["family"] == "gpt2"
