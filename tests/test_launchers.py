"""The Qwen2.5-3B launchers (examples/qwen3b_*.sh, examples/slurm/qwen3b.sbatch), without GPUs or Slurm.

Each launcher's DRY_RUN=1 line is parsed back with shlex; its torchrun options must give the intended world and
its finetune_qwen.py flags must pass ``arguments.parse`` for that world with the mesh the script's name promises.
"""

import glob
import os
import re
import shlex
import stat
import subprocess

import pytest

from conftest import REPO
from megatron_ext.arguments import parse
from megatron_ext.errors import ConfigError

EXAMPLES = os.path.join(REPO, "examples")
LAUNCHERS = sorted(glob.glob(os.path.join(EXAMPLES, "qwen3b_*.sh")))
SBATCH = os.path.join(EXAMPLES, "slurm", "qwen3b.sbatch")
# Variables _launch.sh reads: cleared so the caller's environment cannot change what is tested.
LAUNCH_ENV = ("NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "GPUS_PER_NODE", "DATA_PATH", "TOKENIZER",
              "SEQ_LENGTH", "MICRO_BATCH_SIZE", "GLOBAL_BATCH_SIZE", "TRAIN_ITERS", "LR", "MIN_LR",
              "LR_WARMUP_ITERS", "SAVE_INTERVAL", "EVAL_INTERVAL", "RUN_DIR", "CHECKPOINT_DIR", "DRY_RUN")
TORCHRUN_OPTS = ("--nnodes", "--node-rank", "--master-addr", "--master-port", "--nproc-per-node")


def name(path):
    return os.path.basename(path)[:-len(".sh")]


def gpus_per_node(path):
    return int(re.search(r"_(\d+)gpu$", name(path)).group(1))


def clean_env(**env):
    base = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    return dict(base, **{k: str(v) for k, v in env.items()})


def run(cmd, cwd, **env):
    proc = subprocess.run(cmd, cwd=cwd, env=clean_env(**env), capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, f"{cmd} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def torchrun_lines(stdout):
    """Every printed command: (torchrun options, flags after finetune_qwen.py)."""
    commands = []
    for line in stdout.strip().splitlines():
        argv = shlex.split(line)
        assert argv[0] == "torchrun", line
        script = argv.index("finetune_qwen.py")
        opts = argv[1:script]
        assert opts[::2] == list(TORCHRUN_OPTS), opts
        commands.append((dict(zip(opts[::2], opts[1::2])), argv[script + 1:]))
    return commands


def dry_run(path, *extra, cwd, **env):
    (command,) = torchrun_lines(run(["bash", path, *extra], cwd, DRY_RUN=1, **env))
    return command


def check_mesh(path, run_config):
    mesh, args = run_config.mesh, run_config.args
    kind = re.match(r"qwen3b_(\dd)_", name(path)).group(1)
    if kind == "1d":
        assert (mesh.tp, mesh.pp, mesh.dp) == (1, 1, mesh.world)
        assert args.use_distributed_optimizer == (gpus_per_node(path) == 8)
    elif kind == "2d":
        assert mesh.pp > 1 and mesh.tp == 1 and mesh.dp == mesh.world // mesh.pp
    else:
        assert mesh.tp > 1 and mesh.pp > 1 and mesh.dp > 1
    if kind == "4d":
        assert mesh.sequence_parallel and mesh.vpp and mesh.vpp > 1 and args.use_distributed_optimizer
        assert run_config.num_microbatches % mesh.pp == 0  # the interleaved schedule's grouping
    assert mesh.cp == 1 and mesh.ep == 1


def test_there_are_six_launchers():
    assert [name(p) for p in LAUNCHERS] == ["qwen3b_1d_ddp_2gpu", "qwen3b_1d_ddp_8gpu", "qwen3b_2d_pp_2gpu",
                                            "qwen3b_2d_pp_8gpu", "qwen3b_3d_8gpu", "qwen3b_4d_8gpu"]


@pytest.mark.parametrize("path", LAUNCHERS + [SBATCH, os.path.join(EXAMPLES, "_launch.sh")], ids=os.path.basename)
def test_bash_syntax_and_mode(path):
    subprocess.run(["bash", "-n", path], check=True, timeout=30)
    text = open(path).read()
    if path in LAUNCHERS:
        assert os.stat(path).st_mode & stat.S_IXUSR, f"{path} is not executable"
        lines = text.splitlines()
        assert lines[0] == "#!/usr/bin/env bash" and lines[1].startswith("# Qwen2.5-3B SFT, ")
        assert "set -euo pipefail" in lines and "torchrun" not in text  # shared logic lives in _launch.sh
        assert 'source "$(dirname "$0")/_launch.sh"' in lines and text.rstrip().endswith('"$@"')


@pytest.mark.parametrize("path", LAUNCHERS, ids=name)
def test_single_node_defaults(path, tmp_path):
    opts, flags = dry_run(path, cwd=tmp_path)
    world = gpus_per_node(path)
    assert opts == {"--nnodes": "1", "--node-rank": "0", "--master-addr": "127.0.0.1", "--master-port": "29500",
                    "--nproc-per-node": str(world)}
    run_config = parse(flags, world_size=world)
    check_mesh(path, run_config)
    args = run_config.args
    assert (args.model, args.bf16, args.seq_length, args.pack_sequences) == ("qwen2.5-3b", True, 4096, True)
    assert (args.data_path, args.tokenizer) == ("meta-math/MetaMathQA", "Qwen/Qwen2.5-3B")
    assert (args.lr, args.lr_decay_style, args.clip_grad) == (1e-5, "cosine", 1.0) and args.lr_warmup_iters > 0
    assert args.recompute_granularity in ("selective", "full")
    assert args.save == args.load == f"runs/{name(path)}/checkpoints"
    assert (args.log_dir, args.tensorboard_dir) == (f"runs/{name(path)}/logs", f"runs/{name(path)}/tensorboard")


@pytest.mark.parametrize("path", LAUNCHERS, ids=name)
def test_second_node_of_two_with_pass_through_flags(path, tmp_path):
    opts, flags = dry_run(path, "--train-iters", "7", "--seed", "5", cwd=tmp_path,
                          NNODES=2, NODE_RANK=1, MASTER_ADDR="node0", MASTER_PORT=6000)
    assert (opts["--nnodes"], opts["--node-rank"], opts["--master-addr"], opts["--master-port"]) == \
        ("2", "1", "node0", "6000")
    world = int(opts["--nnodes"]) * int(opts["--nproc-per-node"])
    assert world == 2 * gpus_per_node(path)
    assert flags[-4:] == ["--train-iters", "7", "--seed", "5"]  # appended last, so they override
    run_config = parse(flags, world_size=world)
    check_mesh(path, run_config)
    assert (run_config.args.train_iters, run_config.args.seed) == (7, 5)
    assert run_config.args.global_batch_size == 64  # the global batch stays as set; DP doubles


def test_environment_overrides(tmp_path):
    path = os.path.join(EXAMPLES, "qwen3b_3d_8gpu.sh")
    opts, flags = dry_run(path, cwd=tmp_path, GPUS_PER_NODE=4, SEQ_LENGTH=8192, MICRO_BATCH_SIZE=2,
                          GLOBAL_BATCH_SIZE=32, DATA_PATH="/data/my math.jsonl", TOKENIZER="/models/qwen2.5-3b",
                          RUN_DIR="/runs/a", CHECKPOINT_DIR="/ckpt/a")
    assert opts["--nproc-per-node"] == "4"
    run_config = parse(flags, world_size=4)
    args = run_config.args
    assert (run_config.mesh.tp, run_config.mesh.pp, run_config.mesh.dp) == (2, 2, 1)
    assert (args.seq_length, args.micro_batch_size, args.global_batch_size) == (8192, 2, 32)
    assert (args.data_path, args.tokenizer) == ("/data/my math.jsonl", "/models/qwen2.5-3b")
    assert (args.save, args.load, args.log_dir, args.tensorboard_dir) == \
        ("/ckpt/a", "/ckpt/a", "/runs/a/logs", "/runs/a/tensorboard")


def test_a_world_the_global_batch_does_not_divide_is_refused(tmp_path):
    """NNODES=3 x 8 GPUs under TP2 x PP2 gives DP6, and 64 sequences are not whole micro-batches of 1 x 6."""
    _, flags = dry_run(os.path.join(EXAMPLES, "qwen3b_4d_8gpu.sh"), cwd=tmp_path, NNODES=3)
    with pytest.raises(ConfigError, match="--global-batch-size 64"):
        parse(flags, world_size=24)


def fake_bin(tmp_path, **scripts):
    for tool, body in scripts.items():
        (tmp_path / tool).write_text("#!/usr/bin/env bash\n" + body)
        (tmp_path / tool).chmod(0o755)
    return f"{tmp_path}:{os.environ['PATH']}"


def test_without_dry_run_execs_torchrun_from_the_repo_root(tmp_path):
    """A stub torchrun on PATH shows what is exec'd and where: the repo root, whatever the caller's cwd."""
    path_env = fake_bin(tmp_path, torchrun='echo "$PWD"; printf "%s\\n" "$@"\n')
    path = os.path.join(EXAMPLES, "qwen3b_2d_pp_8gpu.sh")
    cwd, *argv = run(["bash", path, "--seed", "9"], tmp_path, PATH=path_env).splitlines()
    assert cwd == REPO and os.path.isfile(os.path.join(cwd, "finetune_qwen.py"))
    opts, flags = dry_run(path, "--seed", "9", cwd=tmp_path)
    assert argv == [a for kv in opts.items() for a in kv] + ["finetune_qwen.py"] + flags


def test_sbatch_runs_one_torchrun_per_node(tmp_path):
    """Slurm stubbed: srun runs its command once per node with SLURM_NODEID set, as one task per node does."""
    srun_log = tmp_path / "srun.log"
    path_env = fake_bin(
        tmp_path,
        srun='echo "$*" >> "$SRUN_LOG"\n'
             'while [ "${1#-}" != "$1" ]; do shift; done  # srun\'s own options\n'
             'for ((node = 0; node < SLURM_JOB_NUM_NODES; node++)); do SLURM_NODEID=$node "$@"; done\n',
        scontrol='[ "$1 $2 $3" = "show hostnames gpu[07-10]" ] && printf "%s\\n" gpu07 gpu08 gpu09 gpu10\n')
    out = run(["bash", SBATCH, "examples/qwen3b_4d_8gpu.sh", "--train-iters", "3"], REPO, PATH=path_env,
              DRY_RUN=1, SRUN_LOG=srun_log, SLURM_JOB_NUM_NODES=4, SLURM_JOB_NODELIST="gpu[07-10]",
              SLURM_CPUS_PER_TASK=32, NODE_RANK=5)
    commands = torchrun_lines(out)
    assert [opts["--node-rank"] for opts, _ in commands] == ["0", "1", "2", "3"]
    for opts, flags in commands:
        assert (opts["--nnodes"], opts["--master-addr"], opts["--master-port"], opts["--nproc-per-node"]) == \
            ("4", "gpu07", "29500", "8")
        assert flags == commands[0][1] and flags[-2:] == ["--train-iters", "3"]
    check_mesh("qwen3b_4d_8gpu.sh", parse(commands[0][1], world_size=4 * 8))
    assert "--ntasks-per-node=1" in srun_log.read_text().split()
