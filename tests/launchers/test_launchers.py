"""The Qwen launchers (examples/qwen3b_*.sh, qwen1.5moe_*.sh, qwen3_*.sh, examples/slurm/qwen3b.sbatch), without GPUs,
Slurm or ssh.

Each launcher's DRY_RUN=1 line is parsed back with shlex; its torchrun or deepspeed-launcher options must give the
intended world and its finetune_qwen.py flags must pass ``arguments.parse`` for that world with the mesh the
script's name promises (the parsing: launcher_commands.py; ``check_mesh`` also serves test_multinode.py).
"""

import dataclasses
import glob
import os
import re
import shlex
import stat
import subprocess

import pytest

from support import flag_values
from support import REPO
from support.launcher_commands import EXAMPLES, clean_env, commands, dry_run, exec_with_stubs, fake_bin, run, write_hostfile
from megatron_ext.arguments import parse
from megatron_ext.errors import ConfigError
from megatron_ext.models.qwen.shape import PRESETS

# Qwen2.5-3B (dense, and upcycled to MoE for 5D) and the Qwen1.5-MoE-A2.7B variant of the 5D launcher; the
# continued-pretraining launcher runs pretrain_gpt.py (tests/launchers/test_gpt_launchers.py).
LAUNCHERS = sorted(p for p in glob.glob(os.path.join(EXAMPLES, "qwen3b_*.sh"))
                   + glob.glob(os.path.join(EXAMPLES, "qwen1.5moe_*.sh")) + glob.glob(os.path.join(EXAMPLES, "qwen3_*.sh"))
                   if "_cpt_" not in p)
SBATCH = os.path.join(EXAMPLES, "slurm", "qwen3b.sbatch")
HOSTFILE_EXAMPLE = os.path.join(EXAMPLES, "hostfile.example")
DEEPSPEED_NAMES = ("qwen3b_2d_pipeline_deepspeed_2gpu", "qwen3b_zero3_offload_1gpu")
QWEN3 = {"qwen3_8b_4d_8gpu": "qwen3-8b", "qwen3_30b_a3b_8gpu": "qwen3-30b-a3b"}  # their presets
# (--seq-length, --global-batch-size) a launcher sets other than _launch.sh's 4096 and 64: the long-context one.
LONG_CONTEXT = {"qwen3b_cp_8gpu": (32768, 8), "qwen3b_dpo_8gpu": (2048, 64), "qwen3b_reward_8gpu": (2048, 64),
                "qwen3b_kto_8gpu": (2048, 64)}
DPO, KTO = "qwen3b_dpo_8gpu", "qwen3b_kto_8gpu"  # from the published instruct model, on a published preference set,
PAIRS = (DPO, KTO, "qwen3b_reward_8gpu")  # samples unpacked; the same for the reward model
PREFERENCE_DATA = {KTO: "trl-lib/kto-mix-14k"}  # (the others: trl-lib/ultrafeedback_binarized)


def name(path):
    return os.path.basename(path)[:-len(".sh")]


def layout(path):
    """The part of the name between ``qwen3b_`` (``qwen1.5moe_``, ``qwen3_8b_``) and ``_<N>gpu``: 1d_ddp, 2d_pp, 3d,
    5d, ...; ``ep`` for Qwen3-30B-A3B's."""
    if name(path).startswith("qwen3_30b_a3b"):
        return "ep"
    return re.fullmatch(r"(?:qwen3b|qwen1\.5moe|qwen3_8b)_(.+)_\d+gpu", name(path)).group(1)


def gpus_per_node(path):
    return int(re.search(r"_(\d+)gpu$", name(path)).group(1))


def process_launcher(path):
    return "deepspeed" if name(path) in DEEPSPEED_NAMES else "torchrun"


TORCHRUN_LAUNCHERS = [p for p in LAUNCHERS if process_launcher(p) == "torchrun"]
DEEPSPEED_LAUNCHERS = [p for p in LAUNCHERS if process_launcher(p) == "deepspeed"]


def check_mesh(path, run_config):
    mesh, args = run_config.mesh, flag_values(run_config)
    kind = layout(path)
    if kind in ("2d_pipeline_deepspeed", "zero3_offload"):
        assert args.engine == "deepspeed" and not args.use_distributed_optimizer
    else:
        assert args.engine == "megatron"
    if kind == "1d_ddp":
        assert (mesh.tp, mesh.pp, mesh.dp) == (1, 1, mesh.world)
        assert args.use_distributed_optimizer == (gpus_per_node(path) == 8)
    elif kind == "2d_pp":
        assert mesh.pp > 1 and mesh.tp == 1 and mesh.dp == mesh.world // mesh.pp
    elif kind == "2d_pipeline_deepspeed":  # DeepSpeed's pipeline engine: ZeRO-1 at most
        assert (mesh.tp, mesh.pp, mesh.vpp, mesh.dp) == (1, 2, None, mesh.world // 2) and args.zero_stage == 1
        assert args.recompute_granularity == "full" and (36 // mesh.pp) % args.recompute_num_layers == 0
    elif kind == "zero3_offload":
        assert (mesh.tp, mesh.pp, mesh.dp) == (1, 1, mesh.world) and args.zero_stage == 3
        assert args.offload_optimizer == args.offload_param == "cpu"
    elif kind == "lora":  # DP only; rank-16 adapters on every linear, exported merged and as a PEFT adapter
        assert (mesh.tp, mesh.pp, mesh.dp) == (1, 1, mesh.world)
        assert args.use_distributed_optimizer == (gpus_per_node(path) == 8)
        lora = run_config.lora
        assert (lora.rank, lora.alpha, lora.targets) == (16, 32.0, ("qkv", "proj", "fc1", "fc2"))
        assert args.save_peft == f"runs/{name(path)}/adapter"
    elif kind == "dpo":  # DP only, the distributed optimizer; TRL's sigmoid loss, beta 0.1
        assert (mesh.tp, mesh.pp, mesh.dp) == (1, 1, mesh.world) and args.use_distributed_optimizer
        dpo = run_config.objective
        assert (dpo.NAME, dpo.losses, dpo.beta, dpo.label_smoothing) == ("dpo", ("sigmoid",), 0.1, 0.0)
    elif kind == "kto":  # DP only, the distributed optimizer; TRL's KTO loss, beta 0.1, equal weights
        assert (mesh.tp, mesh.pp, mesh.dp) == (1, 1, mesh.world) and args.use_distributed_optimizer
        kto = run_config.objective
        assert (kto.NAME, kto.loss, kto.beta, kto.desirable_weight, kto.undesirable_weight) == ("kto", "kto", 0.1, 1.0,
                                                                                                1.0)
    elif kind == "reward":  # DP only, the distributed optimizer; a score head, TRL's loss without centring
        assert (mesh.tp, mesh.pp, mesh.dp) == (1, 1, mesh.world) and args.use_distributed_optimizer
        reward = run_config.objective
        assert run_config.shape.head == "score" and (reward.NAME, reward.center_rewards_coefficient) == ("reward", None)
    elif kind in ("3d", "4d"):
        assert mesh.tp > 1 and mesh.pp > 1 and mesh.dp > 1
    elif kind == "cp":  # long context: TP2 + SP x CP4, the optimizer sharded over DP x CP
        assert (mesh.tp, mesh.cp, mesh.pp) == (2, 4, 1) and mesh.sequence_parallel and args.use_distributed_optimizer
        assert args.recompute_granularity == "full" and args.seq_length == 32768
    elif kind == "5d":  # DP x PP2 x TP2 + SP x EP, experts folded over DP x TP with expert TP 1 (alltoall)
        assert (mesh.tp, mesh.pp, mesh.etp, mesh.cp) == (2, 2, 1, 1) and mesh.sequence_parallel and mesh.dp > 1
        assert mesh.ep in (2, 4) and run_config.shape.moe is not None and run_config.moe.dispatcher == "alltoall"
        assert args.use_distributed_optimizer and args.recompute_granularity == "full"
    elif kind == "ep":  # Qwen3-30B-A3B: EP8 across the node, grouped experts, every rank a data-parallel one
        assert (mesh.tp, mesh.pp, mesh.cp, mesh.ep, mesh.etp) == (1, 1, 1, 8, 1) and mesh.dp == mesh.world
        assert run_config.shape.moe.num_experts == 128 and run_config.shape.qk_norm
        assert run_config.moe.grouped_gemm is not False and run_config.moe.dispatcher == "alltoall"
        assert (run_config.moe.aux_loss_scope, run_config.moe.aux_loss_coeff) == ("model", 1e-3)
        assert args.use_distributed_optimizer and args.recompute_granularity == "full"
    else:
        pytest.fail(f"no mesh expectations for {name(path)}")
    if kind == "4d":
        assert mesh.sequence_parallel and mesh.vpp and mesh.vpp > 1 and args.use_distributed_optimizer
        assert run_config.num_microbatches % mesh.pp == 0  # the interleaved schedule's grouping
    assert mesh.cp == (4 if kind == "cp" else 1) and (mesh.ep > 1) == (kind in ("5d", "ep"))


def test_there_are_eighteen_launchers():
    assert [name(p) for p in LAUNCHERS] == [
        "qwen1.5moe_5d_8gpu", "qwen3_30b_a3b_8gpu", "qwen3_8b_4d_8gpu", "qwen3b_1d_ddp_2gpu", "qwen3b_1d_ddp_8gpu",
        "qwen3b_2d_pipeline_deepspeed_2gpu", "qwen3b_2d_pp_2gpu", "qwen3b_2d_pp_8gpu", "qwen3b_3d_8gpu",
        "qwen3b_4d_8gpu", "qwen3b_5d_8gpu", "qwen3b_cp_8gpu", "qwen3b_dpo_8gpu", "qwen3b_kto_8gpu", "qwen3b_lora_1gpu",
        "qwen3b_lora_8gpu", "qwen3b_reward_8gpu", "qwen3b_zero3_offload_1gpu"]
    assert [name(p) for p in DEEPSPEED_LAUNCHERS] == sorted(DEEPSPEED_NAMES)


@pytest.mark.parametrize("path", LAUNCHERS + [SBATCH, os.path.join(EXAMPLES, "_launch.sh")], ids=os.path.basename)
def test_bash_syntax_and_mode(path):
    subprocess.run(["bash", "-n", path], check=True, timeout=30)
    text = open(path).read()
    if path in LAUNCHERS:
        assert os.stat(path).st_mode & stat.S_IXUSR, f"{path} is not executable"
        lines = text.splitlines()
        assert lines[0] == "#!/usr/bin/env bash"
        assert lines[1].startswith(("# Qwen2.5-3B SFT, ", "# Qwen1.5-MoE-A2.7B SFT, ", "# Qwen3-8B SFT, ",
                                    "# Qwen3-30B-A3B SFT ", "# Qwen2.5-3B LoRA SFT ", "# qwen3b_lora_1gpu.sh on ",
                                    "# Qwen2.5-3B DPO after SFT, ", "# Qwen2.5-3B KTO after SFT, ",
                                    "# Qwen2.5-3B reward model, "))
        assert "set -euo pipefail" in lines and 'source "$(dirname "$0")/_launch.sh"' in lines
        assert text.rstrip().endswith('"$@"')
        # The process launcher's command line lives in _launch.sh; the script calls one of its two functions.
        assert "torchrun" not in text and not re.search(r"^\s*(exec\s+)?deepspeed\b", text, re.M)
        calls = re.findall(r"^(launch|launch_deepspeed) ", text, re.M)
        assert calls == ["launch_deepspeed" if process_launcher(path) == "deepspeed" else "launch"], calls


def shutdown_budget(path) -> int:
    """torchrun's grace after a SIGTERM, sized for each family's checkpoint (examples/_launch.sh)."""
    base = name(path)
    budgets = {"qwen3_30b_a3b_8gpu": 900, "qwen3_8b_4d_8gpu": 600}
    return budgets.get(base) or (600 if "moe" in base else 300 if base.startswith("qwen") else 180
                                 if base.startswith("vit") else 120)


@pytest.mark.parametrize("path", LAUNCHERS, ids=name)
def test_single_node_defaults(path, tmp_path):
    command = dry_run(path, cwd=tmp_path)
    world = gpus_per_node(path)
    assert command.launcher == process_launcher(path)
    if command.launcher == "torchrun":
        assert command.opts == {"--nnodes": "1", "--node-rank": "0", "--master-addr": "127.0.0.1",
                                "--master-port": "29500", "--nproc-per-node": str(world),
                                "--shutdown-timeout": str(shutdown_budget(path))}
    else:  # one node: no hostfile, the deepspeed launcher starts the ranks here
        assert command.opts == {"--num_nodes": "1", "--num_gpus": str(world), "--master_addr": "127.0.0.1",
                                "--master_port": "29500"}
    assert command.world == world
    run_config = parse(command.flags, world_size=world)
    check_mesh(path, run_config)
    args = flag_values(run_config)
    assert (args.engine == "deepspeed") == (command.launcher == "deepspeed")
    seq_length, global_batch = LONG_CONTEXT.get(name(path), (4096, 64))
    moe_a27b, qwen3 = name(path).startswith("qwen1.5moe"), QWEN3.get(name(path))
    model = qwen3 or ("qwen1.5-moe-a2.7b" if moe_a27b else "qwen2.5-3b-moe" if layout(path) == "5d" else "qwen2.5-3b")
    # The published weights, parsed from their published config.json (conftest's hub cache); the 5D launcher
    # upcycles the dense model into its MoE preset while loading.
    published = {"qwen3-8b": "Qwen/Qwen3-8B", "qwen3-30b-a3b": "Qwen/Qwen3-30B-A3B"}.get(qwen3) or (
        "Qwen/Qwen1.5-MoE-A2.7B" if moe_a27b else "Qwen/Qwen2.5-3B-Instruct" if name(path) in PAIRS else
        "Qwen/Qwen2.5-3B")
    head = "score" if layout(path) == "reward" else "lm"
    assert args.pretrained == published and run_config.shape == dataclasses.replace(PRESETS[model], head=head)
    assert (args.bf16, args.seq_length, args.pack_sequences) == (True, seq_length, name(path) not in PAIRS)
    assert args.global_batch_size == global_batch
    # the fused output layer and loss (the H200's 1.17x against 1.05x); reward models have no vocabulary output
    assert args.cross_entropy_loss_fusion == (layout(path) != "reward")
    data = PREFERENCE_DATA.get(name(path), "trl-lib/ultrafeedback_binarized") if name(path) in PAIRS \
        else "meta-math/MetaMathQA"
    assert (args.data_path, args.tokenizer) == (data, published)
    assert args.save_hf == f"runs/{name(path)}/hf"
    # PRETRAINED=none: a random init of the launcher's preset, with the published tokenizer.
    scratch = parse(dry_run(path, cwd=tmp_path, PRETRAINED="none").flags, world_size=world)
    assert (flag_values(scratch).pretrained, flag_values(scratch).model, scratch.shape) == (
        None, model, dataclasses.replace(PRESETS[model], head=head))
    assert flag_values(scratch).tokenizer == (published if qwen3 or name(path) in PAIRS else "Qwen/Qwen2.5-3B")
    lr = 2e-4 if layout(path) == "lora" else {DPO: 5e-7, KTO: 1e-6}.get(name(path), 1e-5)  # adapters start at zero
    assert (args.lr, args.lr_decay_style, args.clip_grad) == (lr, "cosine", 1.0) and args.lr_warmup_iters > 0
    assert args.recompute_granularity in ("selective", "full")
    assert args.save == args.load == f"runs/{name(path)}/checkpoints"
    assert (args.log_dir, args.tensorboard_dir) == (f"runs/{name(path)}/logs", f"runs/{name(path)}/tensorboard")


@pytest.mark.parametrize("path", TORCHRUN_LAUNCHERS, ids=name)
def test_second_node_of_two_with_pass_through_flags(path, tmp_path):
    command = dry_run(path, "--train-iters", "7", "--seed", "5", cwd=tmp_path,
                      NNODES=2, NODE_RANK=1, MASTER_ADDR="node0", MASTER_PORT=6000)
    opts = command.opts
    assert (opts["--nnodes"], opts["--node-rank"], opts["--master-addr"], opts["--master-port"]) == \
        ("2", "1", "node0", "6000")
    assert command.world == 2 * gpus_per_node(path)
    flags = command.flags
    assert flags[-4:] == ["--train-iters", "7", "--seed", "5"]  # appended last, so they override
    run_config = parse(flags, world_size=command.world)
    check_mesh(path, run_config)
    assert (flag_values(run_config).train_iters, flag_values(run_config).seed) == (7, 5)
    # The global batch stays as set; DP doubles.
    assert flag_values(run_config).global_batch_size == LONG_CONTEXT.get(name(path), (4096, 64))[1]


@pytest.mark.parametrize("path", DEEPSPEED_LAUNCHERS, ids=name)
def test_two_nodes_under_the_deepspeed_launcher(path, tmp_path):
    """One launcher call for both nodes: --hostfile is passed, NODE_RANK is ignored, the first two hosts run."""
    hostfile = write_hostfile(tmp_path, gpus_per_node(path))
    command = dry_run(path, "--train-iters", "7", "--seed", "5", cwd=tmp_path, NNODES=2, NODE_RANK=1,
                      HOSTFILE=hostfile, MASTER_ADDR="node0", MASTER_PORT=6000)
    assert command.opts == {"--num_nodes": "2", "--num_gpus": str(gpus_per_node(path)), "--master_addr": "node0",
                            "--master_port": "6000", "--hostfile": hostfile}
    assert command.world == 2 * gpus_per_node(path)
    assert command.flags[-4:] == ["--train-iters", "7", "--seed", "5"]
    run_config = parse(command.flags, world_size=command.world)
    check_mesh(path, run_config)
    assert (flag_values(run_config).train_iters, flag_values(run_config).seed) == (7, 5)
    assert flag_values(run_config).global_batch_size == 64 and run_config.mesh.dp == 2 * gpus_per_node(path) // \
        run_config.mesh.pp
    # Without MASTER_ADDR, rank 0's host: the first one the hostfile lists.
    assert dry_run(path, cwd=tmp_path, NNODES=2, HOSTFILE=hostfile).opts["--master_addr"] == "gpu-a"


def test_hostfile_example_is_relative_to_the_repo_root(tmp_path):
    path = os.path.join(EXAMPLES, "qwen3b_2d_pipeline_deepspeed_2gpu.sh")
    command = dry_run(path, cwd=tmp_path, NNODES=2, HOSTFILE="examples/hostfile.example")
    hosts = [line.split() for line in open(HOSTFILE_EXAMPLE) if line.strip() and not line.startswith("#")]
    assert len(hosts) >= 2 and all(len(h) == 2 and re.fullmatch(r"slots=\d+", h[1]) for h in hosts)
    assert (command.opts["--hostfile"], command.opts["--master_addr"]) == ("examples/hostfile.example", hosts[0][0])
    check_mesh(path, parse(command.flags, world_size=command.world))


@pytest.mark.parametrize("path", DEEPSPEED_LAUNCHERS, ids=name)
@pytest.mark.parametrize("hostfile", [None, "no/such/hostfile"], ids=["unset", "missing"])
def test_deepspeed_launcher_on_many_nodes_needs_a_hostfile(path, hostfile, tmp_path):
    env = clean_env(NNODES=2, DRY_RUN=1, **({"HOSTFILE": hostfile} if hostfile else {}))
    proc = subprocess.run(["bash", path], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode != 0 and proc.stdout == ""
    (message,) = proc.stderr.strip().splitlines()
    assert "HOSTFILE" in message and message.startswith(os.path.basename(path) + ": ")


def test_environment_overrides(tmp_path):
    path = os.path.join(EXAMPLES, "qwen3b_3d_8gpu.sh")
    command = dry_run(path, cwd=tmp_path, GPUS_PER_NODE=4, SEQ_LENGTH=8192, MICRO_BATCH_SIZE=2,
                      GLOBAL_BATCH_SIZE=32, DATA_PATH="/data/my math.jsonl", TOKENIZER="/models/qwen2.5-3b",
                      RUN_DIR="/runs/a", CHECKPOINT_DIR="/ckpt/a", CE_FUSION=0)
    assert command.opts["--nproc-per-node"] == "4"
    run_config = parse(command.flags, world_size=4)
    args = flag_values(run_config)
    assert (run_config.mesh.tp, run_config.mesh.pp, run_config.mesh.dp) == (2, 2, 1)
    assert (args.seq_length, args.micro_batch_size, args.global_batch_size) == (8192, 2, 32)
    assert (args.data_path, args.tokenizer) == ("/data/my math.jsonl", "/models/qwen2.5-3b")
    assert not args.cross_entropy_loss_fusion
    assert (args.save, args.load, args.log_dir, args.tensorboard_dir) == \
        ("/ckpt/a", "/ckpt/a", "/runs/a/logs", "/runs/a/tensorboard")


@pytest.mark.parametrize("launcher", ["qwen3b_4d_8gpu.sh", "vit_huge_zero3_2gpu.sh"])
def test_profile_switches_the_profiler_on(launcher, tmp_path):
    """PROFILE=1 adds --profile (traces under the run's log dir) and, unless RUN_DIR says otherwise, runs in
    runs/<name>-profile, so it never replaces the plain run (the CPU quickstarts too); flags given to the launcher
    still win."""
    path = os.path.join(EXAMPLES, launcher)
    plain, profiled = (dry_run(path, cwd=tmp_path, **env).flags for env in ({}, {"PROFILE": 1}))
    assert "--profile" not in plain and "--profile" in profiled
    for flag in ("--log-dir", "--save", "--save-hf"):
        assert profiled[profiled.index(flag) + 1] == plain[plain.index(flag) + 1].replace(
            f"runs/{name(path)}/", f"runs/{name(path)}-profile/"), flag
    for quickstart in ("cpu_quickstart", "moe_cpu_quickstart", "gpt2_cpu_quickstart", "vit_cpu_quickstart"):
        flags = shlex.split(run(["bash", os.path.join(EXAMPLES, f"{quickstart}.sh")], tmp_path, DRY_RUN=1, PROFILE=1))
        assert flags[flags.index("--log-dir") + 1] == f"runs/{quickstart}-profile" and "--profile" in flags
    command = dry_run(path, cwd=tmp_path, PROFILE=1, RUN_DIR="/runs/p")
    flags = command.flags + ["--profile-ranks", "0", "1"]
    family = "vit" if launcher.startswith("vit") else "qwen"
    run_config = parse(flags, world_size=int(command.opts.get("--nproc-per-node") or command.opts["--num_gpus"]),
                       family=family)
    assert run_config.profile.directory == "/runs/p/logs/traces" and run_config.profile.ranks == (0, 1)


def test_a_world_the_global_batch_does_not_divide_is_refused(tmp_path):
    """NNODES=3 x 8 GPUs under TP2 x PP2 gives DP6, and 64 sequences are not whole micro-batches of 1 x 6."""
    command = dry_run(os.path.join(EXAMPLES, "qwen3b_4d_8gpu.sh"), cwd=tmp_path, NNODES=3)
    assert command.world == 24
    with pytest.raises(ConfigError, match="--global-batch-size 64"):
        parse(command.flags, world_size=24)


def test_the_deepspeed_launchers_local_rank_flag_is_accepted(tmp_path):
    """The deepspeed launcher appends --local_rank=N to every process's argv; ranks still come from the env."""
    command = dry_run(os.path.join(EXAMPLES, "qwen3b_2d_pipeline_deepspeed_2gpu.sh"), cwd=tmp_path)
    plain = parse(command.flags, world_size=2)
    run_config = parse([*command.flags, "--local_rank=1"], world_size=2)
    assert flag_values(run_config).local_rank == 1 and flag_values(plain).local_rank is None
    assert run_config.mesh == plain.mesh and run_config.num_microbatches == plain.num_microbatches
    assert flag_values(parse([*command.flags, "--local-rank", "0"], world_size=2)).local_rank == 0


@pytest.mark.parametrize("launcher, env", [
    ("qwen3b_2d_pp_8gpu.sh", {}),
    ("qwen3b_zero3_offload_1gpu.sh", {}),
    ("qwen3b_2d_pipeline_deepspeed_2gpu.sh", {"NNODES": 2, "HOSTFILE": "examples/hostfile.example"}),
], ids=["torchrun", "deepspeed", "deepspeed-2-nodes"])
def test_without_dry_run_execs_the_process_launcher_from_the_repo_root(launcher, env, tmp_path):
    """A stub python (our torchrun supervisor's)/deepspeed on PATH shows what is exec'd and where: the repo root, whatever the caller's cwd,
    with exactly the DRY_RUN line's argv."""
    path = os.path.join(EXAMPLES, launcher)
    assert exec_with_stubs(path, tmp_path, **env).launcher == process_launcher(path)


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
    printed = commands(out)
    assert [c.launcher for c in printed] == ["torchrun"] * 4
    assert [c.opts["--node-rank"] for c in printed] == ["0", "1", "2", "3"]
    for command in printed:
        opts = command.opts
        assert (opts["--nnodes"], opts["--master-addr"], opts["--master-port"], opts["--nproc-per-node"]) == \
            ("4", "gpu07", "29500", "8")
        assert command.flags == printed[0].flags and command.flags[-2:] == ["--train-iters", "3"]
    assert printed[0].world == 4 * 8
    check_mesh(os.path.join(EXAMPLES, "qwen3b_4d_8gpu.sh"), parse(printed[0].flags, world_size=printed[0].world))
    assert "--ntasks-per-node=1" in srun_log.read_text().split()
