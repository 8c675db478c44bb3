"""The ViT launchers (examples/vit_*.sh), without GPUs or ssh, on test_launchers.py's helpers.

Each DRY_RUN=1 line is parsed back; its world must be the one the name promises (``_<N>gpu``), and its
pretrain_vit.py flags must pass ``arguments.parse(..., family="vit")`` for that world with the model, data, engine
and ZeRO stage the name promises, on one node and on two.
"""

import json
import os
import re
import shlex
import stat
import subprocess
from unittest import mock

import pytest
import torch

from megatron_ext.arguments import parse
from megatron_ext.errors import ConfigError
from megatron_ext.models.vit.shape import VIT_PRESETS

from support import flag_values
from support import hf_fixtures
from support.launcher_commands import EXAMPLES, clean_env, dry_run, exec_with_stubs, write_hostfile

QUICKSTART = os.path.join(EXAMPLES, "vit_cpu_quickstart.sh")
# name -> (preset, engine, ZeRO stage or None, ZeRO++)
EXPECTED = {
    "vit_base_lora_1gpu": ("vit-base-16", "megatron", None, False),
    "vit_huge_ddp_2gpu": ("vit-huge-14", "megatron", None, False),
    "vit_huge_zero2_2gpu": ("vit-huge-14", "deepspeed", 2, False),
    "vit_huge_zero3_2gpu": ("vit-huge-14", "deepspeed", 3, False),
    "vit_huge_zeropp_2gpu": ("vit-huge-14", "deepspeed", 3, True),
}
LAUNCHERS = [os.path.join(EXAMPLES, f"{name}.sh") for name in EXPECTED]
DEEPSPEED = [p for p in LAUNCHERS if EXPECTED[os.path.basename(p)[:-3]][1] == "deepspeed"]
TORCHRUN = [p for p in LAUNCHERS if p not in DEEPSPEED]
GIB = 2 ** 30


def name(path):
    return os.path.basename(path)[:-len(".sh")]


def gpus_per_node(path):
    return int(re.search(r"_(\d+)gpu$", name(path)).group(1))


def parse_vit(flags, world, gpus_per_machine=None):
    """``arguments.parse`` for pretrain_vit.py, as the entry script calls it; with ``gpus_per_machine``, as on the
    launcher's machines (CUDA with that many GPUs each, whatever this machine has: ZeRO++'s quantization depends
    on the topology)."""
    if gpus_per_machine is None:
        return parse(flags, world_size=world, family="vit")
    with mock.patch.object(torch.cuda, "is_available", return_value=True), \
            mock.patch.object(torch.cuda, "device_count", return_value=gpus_per_machine):
        return parse(flags, world_size=world, family="vit")


def check_run(path, run, world):
    """The model, data, engine and memory the launcher's name and README promise."""
    preset, engine, stage, zeropp = EXPECTED[name(path)]
    args, mesh = flag_values(run), run.mesh
    assert run.shape == VIT_PRESETS[preset] and args.bf16 and args.num_workers > 0
    assert (mesh.world, mesh.tp, mesh.pp, mesh.dp) == (world, 1, 1, world)
    assert args.engine == engine and not args.use_distributed_optimizer
    if engine == "deepspeed":
        assert (args.zero_stage, args.zeropp) == (stage, zeropp)
        # DeepSpeed quantizes weights over a data-parallel group of 2+, gradients only between machines
        assert args.zero_quantized_weights == (zeropp and mesh.dp > 1)
        assert args.zero_quantized_gradients == (zeropp and world // gpus_per_node(path) > 1)
    # Every run starts from the published in21k backbone (its config.json gives the shape), resumes on a rerun and
    # ends with a Hugging Face export.
    assert args.save == args.load == f"runs/{name(path)}/checkpoints" and not args.finetune
    assert args.save_hf == f"runs/{name(path)}/hf"
    if preset == "vit-base-16":  # LoRA fine-tuning
        assert args.pretrained == "google/vit-base-patch16-224-in21k"
        assert (args.data_path, args.num_classes) == ("uoft-cs/cifar100", 100)
        assert (run.lora.rank, run.lora.alpha, run.lora.targets, run.lora.dropout) == (16, 16.0, ("qkv",), 0.1)
        assert args.recompute_granularity == "full"
    else:  # fine-tuning every weight on Food-101
        assert args.pretrained == "google/vit-huge-patch14-224-in21k"
        assert (args.data_path, args.num_classes) == ("ethz/food101", 101)
        assert run.lora is None and args.recompute_granularity is None
        # README's estimate: 18 B/param of model state (DDP's worst case) + 0.36 GB activations per image < 80 GB.
        params = 631e6
        assert (18 * params + args.micro_batch_size * 0.36e9) / GIB < 0.6 * 80
    assert (args.log_dir, args.tensorboard_dir) == (f"runs/{name(path)}/logs", f"runs/{name(path)}/tensorboard")
    assert args.lr_warmup_iters > 0 and args.clip_grad == 1.0 and args.eval_interval > 0


@pytest.mark.parametrize("path", LAUNCHERS + [QUICKSTART], ids=name)
def test_bash_syntax_and_mode(path):
    subprocess.run(["bash", "-n", path], check=True, timeout=30)
    assert os.stat(path).st_mode & stat.S_IXUSR, f"{path} is not executable"
    text = open(path).read()
    lines = text.splitlines()
    assert lines[0] == "#!/usr/bin/env bash" and lines[1].startswith("# ViT")
    assert "set -euo pipefail" in lines
    assert any(line.startswith('source "$(dirname "$0")/_launch.sh"') for line in lines)
    assert text.rstrip().endswith('"$@"') and max(map(len, lines)) <= 120
    if path != QUICKSTART:  # the process launcher's command line lives in _launch.sh
        assert "torchrun" not in text
        calls = re.findall(r"^(launch\w*) ", text, re.M)
        assert calls == ["launch_vit_deepspeed" if path in DEEPSPEED else "launch_vit"], calls


def test_every_vit_launcher_is_tested():
    found = {name(p) for p in os.scandir(EXAMPLES) if p.name.startswith("vit_") and p.name.endswith(".sh")}
    assert found == set(EXPECTED) | {"vit_cpu_quickstart"}


@pytest.mark.parametrize("path", LAUNCHERS, ids=name)
def test_single_node_defaults(path, tmp_path):
    command = dry_run(path, cwd=tmp_path)
    world = gpus_per_node(path)
    assert (command.script, command.world) == ("pretrain_vit.py", world)
    assert command.launcher == ("deepspeed" if path in DEEPSPEED else "torchrun")
    if command.launcher == "deepspeed":  # one node: no hostfile
        assert "--hostfile" not in command.opts
    check_run(path, parse_vit(command.flags, world, world), world)


@pytest.mark.parametrize("path", TORCHRUN, ids=name)
def test_second_node_of_two_with_pass_through_flags(path, tmp_path):
    command = dry_run(path, "--train-iters", "7", "--seed", "5", cwd=tmp_path,
                      NNODES=2, NODE_RANK=1, MASTER_ADDR="node0", MASTER_PORT=6000)
    opts = command.opts
    assert (opts["--nnodes"], opts["--node-rank"], opts["--master-addr"]) == ("2", "1", "node0")
    assert command.flags[-4:] == ["--train-iters", "7", "--seed", "5"]
    run = parse_vit(command.flags, command.world, gpus_per_node(path))
    check_run(path, run, 2 * gpus_per_node(path))
    assert (flag_values(run).train_iters, flag_values(run).seed) == (7, 5)


@pytest.mark.parametrize("path", DEEPSPEED, ids=name)
def test_two_nodes_under_the_deepspeed_launcher(path, tmp_path):
    hostfile = write_hostfile(tmp_path, gpus_per_node(path))
    command = dry_run(path, "--seed", "5", cwd=tmp_path, NNODES=2, HOSTFILE=hostfile)
    assert command.opts["--hostfile"] == hostfile and command.opts["--master_addr"] == "gpu-a"
    run = parse_vit(command.flags, command.world, gpus_per_node(path))
    check_run(path, run, 2 * gpus_per_node(path))
    assert flag_values(run).seed == 5 and flag_values(run).global_batch_size % (flag_values(run).micro_batch_size * run.mesh.dp) == 0


def test_environment_overrides(tmp_path):
    path = os.path.join(EXAMPLES, "vit_base_lora_1gpu.sh")
    local = tmp_path / "in21k"  # a downloaded copy: PRETRAINED takes a directory as well as a hub id
    local.mkdir()
    (local / "config.json").write_text(json.dumps(hf_fixtures.PUBLISHED["google/vit-base-patch16-224-in21k"]))
    command = dry_run(path, cwd=tmp_path, PRETRAINED=str(local), DATA_PATH="/data/cifar", NUM_CLASSES=20,
                      MICRO_BATCH_SIZE=64, GLOBAL_BATCH_SIZE=128, LR=1e-3, NUM_WORKERS=2, RUN_DIR="/runs/b")
    run = parse_vit(command.flags, 1, 1)
    args = flag_values(run)
    assert run.shape == VIT_PRESETS["vit-base-16"]
    assert (args.pretrained, args.data_path, args.num_classes, args.num_workers) == (str(local), "/data/cifar", 20, 2)
    assert (args.micro_batch_size, args.global_batch_size, args.lr) == (64, 128, 1e-3)
    assert (args.save, args.log_dir, args.save_hf) == ("/runs/b/checkpoints", "/runs/b/logs", "/runs/b/hf")


def test_a_world_the_global_batch_does_not_divide_is_refused(tmp_path):
    """Three nodes of 2 GPUs: DP6 x 64 images do not divide the global batch of 512."""
    command = dry_run(os.path.join(EXAMPLES, "vit_huge_ddp_2gpu.sh"), cwd=tmp_path, NNODES=3)
    with pytest.raises(ConfigError, match="--global-batch-size 512"):
        parse_vit(command.flags, command.world, 2)


@pytest.mark.parametrize("path", [LAUNCHERS[1], DEEPSPEED[0]], ids=name)
def test_without_dry_run_execs_the_process_launcher_from_the_repo_root(path, tmp_path):
    assert exec_with_stubs(path, tmp_path).script == "pretrain_vit.py"


def test_cpu_quickstart(tmp_path):
    proc = subprocess.run(["bash", QUICKSTART, "--seed", "3"], cwd=tmp_path, env=clean_env(DRY_RUN=1),
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    argv = shlex.split(proc.stdout)
    script = argv.index("pretrain_vit.py")
    assert argv[:3] == [".venv/bin/python", "-m", "megatron_ext.launch"]  # torchrun, supervised
    assert argv[3:script] == ["--nproc-per-node", "2", "--master-port", "29532", "--shutdown-timeout", "60"]
    assert os.path.isfile(os.path.join(EXAMPLES, "..", argv[script + 1 + argv[script + 1:].index("--data-path") + 1]))
    args = flag_values(parse_vit(argv[script + 1:], 2))
    assert (args.model, args.num_classes, args.distributed_backend, args.seed) == ("tiny", 5, "gloo", 3)
    assert args.log_dir == "runs/vit_cpu_quickstart" and args.train_iters * args.global_batch_size >= 3 * 270
