"""The launchers' printed commands, for the launcher tests (test_launchers.py, test_vit_launchers.py,
test_gpt_launchers.py, test_multinode.py, ...): a DRY_RUN=1 line parsed back with shlex into the process launcher, its
options and the entry script's flags; launchers run with a clean environment, stub process launchers and hostfiles.
"""

import os
import shlex
import subprocess
from typing import Dict, List, NamedTuple

from support import REPO

EXAMPLES = os.path.join(REPO, "examples")
# Variables _launch.sh reads: cleared so the caller's environment cannot change what is tested.
LAUNCH_ENV = ("NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "GPUS_PER_NODE", "HOSTFILE", "DATA_PATH",
              "TOKENIZER", "SEQ_LENGTH", "MICRO_BATCH_SIZE", "GLOBAL_BATCH_SIZE", "TRAIN_ITERS", "LR", "MIN_LR",
              "LR_WARMUP_ITERS", "SAVE_INTERVAL", "EVAL_INTERVAL", "RUN_DIR", "CHECKPOINT_DIR", "DRY_RUN",
              "NUM_CLASSES", "NUM_WORKERS", "WEIGHT_DECAY", "CKPT", "PROFILE", "PRETRAINED", "MODEL", "SHUTDOWN_TIMEOUT",
              "EVAL_GENERATE_SAMPLES", "PACK_SEQUENCES", "DPO_BETA", "DPO_LOSS")
# torchrun is started as our supervisor (megatron_ext/launch.py: torchrun's agent and options, one line per failure).
SUPERVISED = ["python", "-m", "megatron_ext.launch"]
# Each process launcher's options before the entry script, in this order, then the optional ones.
LAUNCHER_OPTS = {
    "torchrun": ("--nnodes", "--node-rank", "--master-addr", "--master-port", "--nproc-per-node", "--shutdown-timeout"),
    "deepspeed": ("--num_nodes", "--num_gpus", "--master_addr", "--master_port"),
}
OPTIONAL_OPTS = {"torchrun": (), "deepspeed": ("--hostfile",)}  # --hostfile: only with NNODES > 1
# (nodes, processes per node) options of each process launcher.
WORLD_OPTS = {"torchrun": ("--nnodes", "--nproc-per-node"), "deepspeed": ("--num_nodes", "--num_gpus")}


class Command(NamedTuple):
    """One printed command: ``launcher <opts> <script> <flags>``."""

    launcher: str  # torchrun or deepspeed
    opts: Dict[str, str]
    flags: List[str]
    script: str = "finetune_qwen.py"  # or pretrain_vit.py

    @property
    def world(self) -> int:
        nodes, per_node = WORLD_OPTS[self.launcher]
        return int(self.opts[nodes]) * int(self.opts[per_node])

    @property
    def argv(self) -> List[str]:
        launcher = SUPERVISED if self.launcher == "torchrun" else [self.launcher]
        return [*launcher, *(a for kv in self.opts.items() for a in kv), self.script, *self.flags]


def supervised(argv) -> bool:
    """``python -m megatron_ext.launch ...`` (any python: the CPU quickstarts name .venv's)."""
    return os.path.basename(argv[0]) == "python" and argv[1:len(SUPERVISED)] == SUPERVISED[1:]


def parse_command(line):
    argv = shlex.split(line)
    if supervised(argv):  # torchrun under our supervisor, with torchrun's options
        argv = ["torchrun", *argv[len(SUPERVISED):]]
    launcher = argv[0]
    assert launcher in LAUNCHER_OPTS, line
    script = next(i for i, a in enumerate(argv) if a in ("finetune_qwen.py", "pretrain_vit.py", "pretrain_gpt.py"))
    opts = argv[1:script]
    assert len(opts) % 2 == 0, opts
    names, required = opts[::2], LAUNCHER_OPTS[launcher]
    assert tuple(names[:len(required)]) == required, opts
    assert set(names[len(required):]) <= set(OPTIONAL_OPTS[launcher]) and len(set(names)) == len(names), opts
    return Command(launcher, dict(zip(names, opts[1::2])), argv[script + 1:], argv[script])


def clean_env(**env):
    base = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    return dict(base, **{k: str(v) for k, v in env.items()})


def run(cmd, cwd, **env):
    proc = subprocess.run(cmd, cwd=cwd, env=clean_env(**env), capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, f"{cmd} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def commands(stdout):
    """Every printed command, parsed."""
    return [parse_command(line) for line in stdout.strip().splitlines()]


def dry_run(path, *extra, cwd, **env):
    (command,) = commands(run(["bash", path, *extra], cwd, DRY_RUN=1, **env))
    return command


def write_hostfile(tmp_path, gpus):
    hostfile = tmp_path / "my hosts"  # a space, to check the quoting
    hostfile.write_text(f"# comment\n\ngpu-a slots={gpus}\ngpu-b slots={gpus}\ngpu-c slots={gpus}\n")
    return str(hostfile)


def fake_bin(tmp_path, **scripts):
    for tool, body in scripts.items():
        (tmp_path / tool).write_text("#!/usr/bin/env bash\n" + body)
        (tmp_path / tool).chmod(0o755)
    return f"{tmp_path}:{os.environ['PATH']}"


def exec_with_stubs(path, tmp_path, **env):
    """Run ``path --seed 9`` with stub torchrun/deepspeed that print their cwd and argv: the repo root and exactly
    the DRY_RUN line's argv. Returns that parsed line."""
    stub = 'echo "$PWD"; printf "%s\\n" "$(basename "$0")" "$@"\n'
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    path_env = fake_bin(bin_dir, python=stub, deepspeed=stub)
    cwd, *argv = run(["bash", path, "--seed", "9"], tmp_path, PATH=path_env, **env).splitlines()
    command = dry_run(path, "--seed", "9", cwd=tmp_path, **env)
    assert cwd == REPO and os.path.isfile(os.path.join(cwd, command.script))
    assert argv == command.argv
    return command
