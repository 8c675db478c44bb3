"""Multi-node launches proven on one machine: two torchrun "nodes" under a stubbed Slurm (sbatch -> srun ->
examples/slurm/node_task.sh -> examples/cpu_quickstart.sh -> torchrun --nnodes 2) train the TP2 x PP2 job with the
losses of one 4-rank node, and a SIGUSR1 to the batch script saves on every rank, requeues, and the checkpoint
resumes; the sbatch's node/rank mapping from Slurm's environment; the deepspeed launcher's hostfile path through
DeepSpeed's own parser, up to the pdsh command it would run (nothing is run over ssh); every launcher in examples/
that starts torchrun gives it the SHUTDOWN_TIMEOUT budget.

Slurm is stubbed by executables on PATH: ``scontrol`` (hostnames from FAKE_HOSTNAMES, requeues logged) and
``srun`` (one background task per node with the step environment Slurm sets; signals passed on to the tasks, as
srun does).
"""

import base64
import glob
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time

import pytest

from support import flag_values
from support import REPO
from support.ranks import free_port, run_ranks
from support.launcher_commands import EXAMPLES, clean_env, commands, fake_bin, parse_command, run, supervised
from megatron_ext.arguments import parse
from test_launchers import SBATCH, check_mesh

QUICKSTART = os.path.join(EXAMPLES, "cpu_quickstart.sh")
TRACKER = "latest_checkpointed_iteration.txt"
SCONTROL = ('if [ "$1 $2" = "show hostnames" ]; then\n'
            '  [ "$3" = "$SLURM_JOB_NODELIST" ] && printf "%s\\n" $FAKE_HOSTNAMES\n'
            'else echo "$*" >> "$SLURM_LOG"; fi\n')
SRUN = f'''echo "srun $*" >> "$SLURM_LOG"
env | grep -E '^(GPUS_PER_NODE|NNODES|MASTER_ADDR)=' | sort >> "$SLURM_LOG"
while [ "${{1#-}}" != "$1" ]; do shift; done  # srun's own options
source {REPO}/examples/slurm/_wait.sh
set -m  # each task in its own process group: a signal for the step reaches every process of a task, as in Slurm
pids=()
for ((node = 0; node < SLURM_JOB_NUM_NODES; node++)); do
  SLURM_NODEID=$node SLURM_PROCID=$node SLURM_LOCALID=0 SLURM_NTASKS=$SLURM_JOB_NUM_NODES SLURM_STEP_ID=0 "$@" &
  pids+=($!)
done
# FAKE_SIGNAL_SCOPE=tasks: only the task processes (the node_task.sh shells) get it
trap 'interrupted=1; echo "srun: USR1 to the tasks" >> "$SLURM_LOG"
  for pid in "${{pids[@]}}"; do kill -USR1 -- "$([ "$FAKE_SIGNAL_SCOPE" = tasks ] || echo -)$pid"; done' USR1
status=0
for pid in "${{pids[@]}}"; do wait_through_traps "$pid" || status=$?; done
exit $status
'''


def slurm_env(tmp_path, nodes, hosts, **env):
    """The environment of a batch script Slurm started on the first of ``nodes`` hosts, with stub scontrol/srun."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    return dict(PATH=fake_bin(bin_dir, scontrol=SCONTROL, srun=SRUN), SLURM_LOG=tmp_path / "slurm.log",
                FAKE_HOSTNAMES=" ".join(hosts), SLURM_JOB_ID=4242, SLURM_JOB_NUM_NODES=nodes, SLURM_NNODES=nodes,
                SLURM_JOB_NODELIST=f"gpu-[01-{nodes:02d}]", SLURM_NODEID=0, SLURM_PROCID=0, SLURM_LOCALID=0,
                SLURM_NTASKS=nodes, SLURM_CPUS_PER_TASK=1, SLURM_SUBMIT_DIR=REPO, NODE_RANK=7, **env)


def sbatch_directives():
    return [line.split()[1] for line in open(SBATCH) if line.startswith("#SBATCH ")]


def test_sbatch_is_preemptible():
    directives = sbatch_directives()
    assert "--signal=B:USR1@300" in directives and "--requeue" in directives and "--open-mode=append" in directives
    for path in (SBATCH, os.path.join(EXAMPLES, "slurm", "node_task.sh")):
        subprocess.run(["bash", "-n", path], check=True, timeout=30)
    assert os.access(os.path.join(EXAMPLES, "slurm", "node_task.sh"), os.X_OK)


@pytest.mark.parametrize("gpus_per_node", [None, 8], ids=["from-slurm", "set"])
def test_slurm_environment_maps_to_nodes_and_ranks(gpus_per_node, tmp_path):
    """SLURM_JOB_NODELIST's first host is MASTER_ADDR, SLURM_NODEID each task's NODE_RANK, SLURM_GPUS_ON_NODE the
    ranks per node unless GPUS_PER_NODE is set; --save and --load are CHECKPOINT_DIR on every node."""
    env = slurm_env(tmp_path, 2, ["gpu-01", "gpu-02"], SLURM_GPUS_ON_NODE=4, DRY_RUN=1,
                    CHECKPOINT_DIR="/shared/ckpt", MASTER_PORT=6001,
                    **({"GPUS_PER_NODE": gpus_per_node} if gpus_per_node else {}))
    proc = subprocess.run(["bash", SBATCH, "examples/qwen3b_4d_8gpu.sh", "--train-iters", "3"], cwd=REPO,
                          env=clean_env(**env), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    printed = sorted(commands(proc.stdout), key=lambda c: int(c.opts["--node-rank"]))
    per_node = gpus_per_node or 4
    assert [c.opts["--node-rank"] for c in printed] == ["0", "1"]
    for command in printed:
        assert (command.opts["--nnodes"], command.opts["--master-addr"], command.opts["--master-port"],
                command.opts["--nproc-per-node"]) == ("2", "gpu-01", "6001", str(per_node))
        assert command.flags == printed[0].flags and command.flags[-2:] == ["--train-iters", "3"]
    run_config = parse(printed[0].flags, world_size=2 * per_node)
    check_mesh(os.path.join(EXAMPLES, "qwen3b_4d_8gpu.sh"), run_config)
    assert flag_values(run_config).save == flag_values(run_config).load == "/shared/ckpt"
    log = (tmp_path / "slurm.log").read_text().splitlines()
    srun = shlex.split(log[0])
    assert srun[:5] == ["srun", "--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=1", "--kill-on-bad-exit=1"]
    assert srun[-3:] == ["examples/qwen3b_4d_8gpu.sh", "--train-iters", "3"] and srun[-4].endswith("node_task.sh")
    assert f"GPUS_PER_NODE={per_node}" in log
    assert all(c.opts["--shutdown-timeout"] == "300" for c in printed)  # the Qwen launchers' save budget
    assert "master gpu-01:6001, --save /shared/ckpt, restart 0" in proc.stderr
    assert not any("requeue" in line for line in log)


RANK_PY = """import os, signal, sys, time
node, rank, tmp, save, at_signal = os.environ["NODE_RANK"], *sys.argv[1:]
def finish(signum, frame):  # what a training rank does: finish the step, save, exit 0
    with open(os.path.join(tmp, "ranks.log"), "a") as log:
        log.write(f"node {node} rank {rank} got USR1\\n")
    with open(os.path.join(save, "%s"), "w") as tracker:
        tracker.write(at_signal)
    sys.exit(0)
signal.signal(signal.SIGUSR1, finish)
open(os.path.join(tmp, f"ready.{node}.{rank}"), "w").close()
while True:
    time.sleep(0.05)
""" % TRACKER


def fake_job(tmp_path, train_iters, at_signal):
    """A launcher in <tmp>/examples (beside a link to the real examples/slurm) whose "torchrun" starts two python
    "ranks" that, on SIGUSR1, write the tracker with ``at_signal`` and exit 0, as training ranks do. The "torchrun"
    is a plain bash: it dies of SIGUSR1 unless node_task.sh starts it with the signal ignored."""
    examples = tmp_path / "examples"
    examples.mkdir()
    (examples / "slurm").symlink_to(os.path.join(EXAMPLES, "slurm"))
    save = tmp_path / "ckpt"
    save.mkdir()
    (tmp_path / "rank.py").write_text(RANK_PY)
    rank = f"{shlex.quote(sys.executable)} {tmp_path}/rank.py"
    (examples / "fake.sh").write_text(
        f'[ "${{DRY_RUN:-0}}" = 0 ] || {{ echo "torchrun x.py --save {save} --train-iters 1 '
        f'--train-iters={train_iters}"; exit 0; }}\n'
        f"exec bash -c '{rank} 0 {tmp_path} {save} {at_signal} & {rank} 1 {tmp_path} {save} {at_signal} & wait'\n")
    return examples / "fake.sh", save


@pytest.mark.parametrize("scope", ["step", "tasks"])
@pytest.mark.parametrize("at_signal, requeued", [(3, True), (6, False)], ids=["mid-run", "at-the-end"])
def test_usr1_reaches_every_rank_and_requeues_an_unfinished_run(at_signal, requeued, scope, tmp_path):
    """USR1 to the batch script -> srun -> every process of the step (Slurm's way) or only each node's task, which
    passes it to torchrun's children; "torchrun" survives it either way; the job is requeued when the tracker is
    below --train-iters (the last one given: 6), and not when it reached it."""
    launcher, save = fake_job(tmp_path, 6, at_signal)
    env = clean_env(**slurm_env(tmp_path, 2, ["node-a", "node-b"], FAKE_SIGNAL_SCOPE=scope))
    batch = subprocess.Popen(["bash", SBATCH, str(launcher)], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while len(list(tmp_path.glob("ready.*"))) < 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    batch.send_signal(signal.SIGUSR1)
    out, err = batch.communicate(timeout=30)
    assert batch.returncode == 0, err
    assert set((tmp_path / "ranks.log").read_text().splitlines()) == {
        f"node {n} rank {r} got USR1" for n in (0, 1) for r in (0, 1)}
    log = (tmp_path / "slurm.log").read_text()
    assert ("requeue 4242" in log) == requeued and "srun: USR1 to the tasks" in log
    assert f"--save {save}," in err
    if requeued:  # and "torchrun" survived the signal: every task exited 0
        assert f"requeueing job 4242: it resumes from iteration {at_signal} (srun exited 0)" in err
    else:
        assert f"the run is done (iteration {at_signal} of 6): not requeued" in err


STEPS = 6


def losses(log_dir):
    return {r["step"]: r["loss"] for r in map(json.loads, (log_dir / "metrics.jsonl").read_text().splitlines())}


def quickstart_flags(*extra, **env):
    """examples/cpu_quickstart.sh's finetune_qwen.py flags (its DRY_RUN line) and its torchrun options."""
    proc = subprocess.run(["bash", QUICKSTART, *extra], env=clean_env(DRY_RUN=1, **env), capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    command = parse_command(proc.stdout)
    return command.flags, command.opts


def test_cpu_quickstart_takes_the_launchers_node_variables():
    flags, opts = quickstart_flags("--seed", "3")
    assert opts == {"--nnodes": "1", "--node-rank": "0", "--master-addr": "127.0.0.1", "--master-port": "29531",
                    "--nproc-per-node": "4", "--shutdown-timeout": "60"} and flags[-2:] == ["--seed", "3"]
    _, opts = quickstart_flags(NNODES=2, NODE_RANK=1, MASTER_ADDR="10.0.0.1", MASTER_PORT=7, GPUS_PER_NODE=2)
    assert opts == {"--nnodes": "2", "--node-rank": "1", "--master-addr": "10.0.0.1", "--master-port": "7",
                    "--nproc-per-node": "2", "--shutdown-timeout": "60"}


def test_every_launcher_that_starts_torchrun_passes_the_shutdown_budget(tmp_path):
    """Every script in examples/ is dry-run (DRY_RUN=1): each torchrun line it prints, whoever writes it (_launch.sh
    or the script itself), passes --shutdown-timeout from SHUTDOWN_TIMEOUT, its default at least a minute (torchrun's
    own 30 s cuts a save short). A script whose code starts torchrun must print such a line; the Slurm scripts start
    launchers, never torchrun itself without it. A new launcher that forgets it fails here."""
    scripts = sorted(p for p in glob.glob(os.path.join(EXAMPLES, "*.sh")) if not p.endswith("/_launch.sh"))
    starts = re.compile(r"(^|[\s;&|(])(\S*/)?torchrun\s+-", re.M)

    def stem(path):
        return os.path.basename(path)[:-len(".sh")]

    def code(path):  # the script without its comments
        return "\n".join(re.sub(r"(^|\s)#.*", "", line) for line in open(path).read().splitlines())

    printed = {}
    for budget in (None, 77):
        env = {} if budget is None else {"SHUTDOWN_TIMEOUT": budget}
        for path in scripts:
            for line in run(["bash", path], tmp_path, DRY_RUN=1, **env).splitlines():
                argv = shlex.split(line)
                if supervised(argv):  # torchrun's agent and options, under our supervisor
                    argv = argv[2:]
                elif os.path.basename(argv[0]) != "torchrun":
                    continue
                opts = argv[1:next(i for i, a in enumerate(argv) if a.endswith(".py"))]
                assert "--shutdown-timeout" in opts, f"{stem(path)}: {line}"
                value = int(opts[opts.index("--shutdown-timeout") + 1])
                assert value == budget if budget else value >= 60, f"{stem(path)}: {line}"
                printed[stem(path)] = value
    assert len(printed) >= 20
    for path in scripts:
        if starts.search(code(path)) or re.search(r"^\s*(launch|launch_vit|launch_gpt|_torchrun) ", code(path), re.M):
            assert stem(path) in printed, f"{path} starts torchrun, but DRY_RUN=1 printed no line"
    for path in glob.glob(os.path.join(EXAMPLES, "slurm", "*")):
        for command in re.findall(r"(?:^|[\s;&|(])(?:\S*/)?torchrun\s+-.*", code(path)):
            assert "--shutdown-timeout" in command, f"{path}: {command}"


def test_two_slurm_nodes_equal_one_node_and_resume_after_usr1(tmp_path):
    """The TP2 x PP2 quickstart on two "nodes" of 2 CPU ranks (the sbatch on stub Slurm: two real torchrun --nnodes 2
    at once, rendezvous at 127.0.0.1) gives the per-step losses of the same flags on one node of 4 ranks. A SIGUSR1
    to the batch script after step 1 makes every rank finish its step, save and exit 0, and the job is requeued; the
    same flags with --load then finish the run (on one node of 4) with the uninterrupted run's losses."""
    extra = ["--train-iters", str(STEPS), "--eval-interval", "100"]
    flags, _ = quickstart_flags(*extra)
    run_ranks(4, ["finetune_qwen.py", *flags, "--log-dir", str(tmp_path / "ref")])
    reference = losses(tmp_path / "ref")
    assert sorted(reference) == list(range(1, STEPS + 1))

    ckpt = tmp_path / "ckpt"
    resumable = ["--save", str(ckpt), "--load", str(ckpt)]
    env = slurm_env(tmp_path, 2, ["127.0.0.1", "127.0.0.2"], SLURM_GPUS_ON_NODE=2, MASTER_PORT=free_port(),
                    OMP_NUM_THREADS=1, PYTHONWARNINGS="ignore")
    batch = subprocess.Popen(["bash", SBATCH, QUICKSTART, *extra, *resumable, "--log-dir", str(tmp_path / "run1")],
                             cwd=REPO, env=clean_env(**env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
    metrics = tmp_path / "run1" / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.exists() and metrics.read_text().strip()) and batch.poll() is None:
        assert time.monotonic() < deadline, "no step within 300 s"
        time.sleep(0.05)
    batch.send_signal(signal.SIGUSR1)
    out, _ = batch.communicate(timeout=300)
    assert batch.returncode == 0, out[-6000:]
    saved = int((ckpt / TRACKER).read_text())
    assert 1 <= saved < STEPS, out[-6000:]
    assert f"requeueing job 4242: it resumes from iteration {saved} (srun exited 0)" in out
    assert "requeue 4242" in (tmp_path / "slurm.log").read_text()
    assert sorted(re.findall(r"rank (\d) received SIGUSR1", out)) == ["0", "1", "2", "3"]
    first = losses(tmp_path / "run1")
    assert sorted(first) == list(range(1, saved + 1))

    run_ranks(4, ["finetune_qwen.py", *flags, *resumable, "--log-dir", str(tmp_path / "run2")])
    second = losses(tmp_path / "run2")
    assert sorted(second) == list(range(saved + 1, STEPS + 1))
    for step, loss in {**first, **second}.items():
        assert loss == pytest.approx(reference[step], rel=1e-5), (step, loss, reference[step])
    print(f"two nodes stopped at step {saved}; max |rel diff| vs one node: "
          f"{max(abs(l / reference[s] - 1) for s, l in {**first, **second}.items()):.2e}")


def deepspeed_plan(command, tmp_path):
    """What the deepspeed launcher would do with this command line, through DeepSpeed's own code up to the point
    where it would ssh: (the pdsh argv it would run, {host: [global ranks]} as deepspeed.launcher.launch assigns
    them on each node)."""
    from deepspeed.launcher import runner
    from deepspeed.launcher.multinode_runner import PDSHRunner

    args = runner.parse_args(command.argv[1:])
    assert (args.user_script, args.user_args) == (command.script, command.flags)
    pool = runner.fetch_hostfile(args.hostfile)
    active = runner.parse_inclusion_exclusion(pool, args.include, args.exclude)
    active = runner.apply_num_nodes_and_gpus(active, args.num_nodes, args.num_gpus)
    world_info = runner.encode_world_info(active)
    pdsh, _, env = PDSHRunner(args, world_info).get_cmd(dict(os.environ), active)
    decoded = json.loads(base64.urlsafe_b64decode(world_info))
    ranks, next_rank = {}, 0  # launch.py: node after node, one rank per listed GPU
    for host, gpus in decoded.items():
        ranks[host] = list(range(next_rank, next_rank + len(gpus)))
        next_rank += len(gpus)
    assert env["PDSH_RCMD_TYPE"] == "ssh"
    return pdsh, ranks


def test_deepspeed_hostfile_path_up_to_pdsh(tmp_path):
    path = os.path.join(EXAMPLES, "qwen3b_2d_pipeline_deepspeed_2gpu.sh")
    proc = subprocess.run(["bash", path, "--train-iters", "7"], cwd=tmp_path, capture_output=True, text=True,
                          env=clean_env(DRY_RUN=1, NNODES=2, HOSTFILE="examples/hostfile.example"), timeout=30)
    assert proc.returncode == 0, proc.stderr
    (command,) = commands(proc.stdout)
    cwd = os.getcwd()
    os.chdir(REPO)  # the launcher runs from the repo root: relative --hostfile
    try:
        pdsh, ranks = deepspeed_plan(command, tmp_path)
    finally:
        os.chdir(cwd)
    assert ranks == {"node0": [0, 1], "node1": [2, 3]} and command.world == 4
    assert pdsh[:5] == ["pdsh", "-S", "-f", "1024", "-w"] and pdsh[5] == "node0,node1"
    remote = " ".join(pdsh[6:])
    assert f"cd {REPO};" in remote and "-m deepspeed.launcher.launch" in remote and "--node_rank=%n" in remote
    assert "--master_addr=node0" in remote and "--master_port=29500" in remote and "finetune_qwen.py" in remote
    check_mesh(path, parse(command.flags, world_size=4))

    # Three hosts, two nodes: the first two run; MASTER_ADDR overrides the first host.
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# rack 1\ngpu-a slots=8\n\n  gpu-b slots=8  \ngpu-c slots=8\n")
    proc = subprocess.run(["bash", path], cwd=tmp_path, capture_output=True, text=True, timeout=30,
                          env=clean_env(DRY_RUN=1, NNODES=2, GPUS_PER_NODE=4, HOSTFILE=hostfile,
                                        MASTER_ADDR="10.1.1.1"))
    (command,) = commands(proc.stdout)
    pdsh, ranks = deepspeed_plan(command, tmp_path)
    assert ranks == {"gpu-a": [0, 1, 2, 3], "gpu-b": [4, 5, 6, 7]} and pdsh[5] == "gpu-a,gpu-b"
    assert "--master_addr=10.1.1.1" in " ".join(pdsh)


BAD_HOSTFILES = {
    "missing": (None, "is not a readable file (relative paths are from the repo root)", None),
    "directory": ("DIR", "is not a readable file (relative paths are from the repo root)", None),
    "empty": ("# no hosts\n\n", "lists 0 host(s); NNODES=2 needs 2", "empty"),
    "bad-line": ("gpu-a slots=2\ngpu-b 2\n", 'line 2, "gpu-b 2", is not "<host> slots=<GPUs>"', "bad entry"),
    "duplicate": ("gpu-a slots=2\ngpu-a slots=2\n", "lists gpu-a twice (line 2)", "multiple entries"),
    "too-few": ("gpu-a slots=2\n", "lists 1 host(s); NNODES=2 needs 2", None),
    "few-slots": ("gpu-a slots=2\ngpu-b slots=1\n", "gives gpu-b slots=1, fewer than GPUS_PER_NODE=2", None),
}


@pytest.mark.parametrize("case", BAD_HOSTFILES)
def test_a_bad_hostfile_is_one_line_before_deepspeed_starts(case, tmp_path):
    """The launcher refuses, in one line naming the file, what DeepSpeed would refuse (its own parser agrees) or
    silently get wrong (fewer hosts than NNODES, fewer slots than GPUS_PER_NODE)."""
    from deepspeed.launcher import runner

    text, message, deepspeed_error = BAD_HOSTFILES[case]
    hostfile = tmp_path / "hosts"
    if text == "DIR":
        hostfile.mkdir()
    elif text is not None:
        hostfile.write_text(text)
    path = os.path.join(EXAMPLES, "qwen3b_2d_pipeline_deepspeed_2gpu.sh")
    proc = subprocess.run(["bash", path], cwd=tmp_path, capture_output=True, text=True, timeout=30,
                          env=clean_env(DRY_RUN=1, NNODES=2, HOSTFILE=hostfile))
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip() == f"qwen3b_2d_pipeline_deepspeed_2gpu.sh: HOSTFILE={hostfile} {message}"
    if deepspeed_error:
        with pytest.raises(ValueError, match=deepspeed_error):
            runner.fetch_hostfile(str(hostfile))
