#!/usr/bin/env bash
# One Slurm task per node, started by srun from examples/slurm/qwen3b.sbatch: runs a torchrun launcher
# (examples/*.sh) on this node as node NODE_RANK=$SLURM_NODEID, with the signals arranged for preemption:
#   SIGUSR1 (the sbatch's --signal, passed on by srun): the training ranks finish their step, save and exit 0.
#     The launcher's torchrun (python -m megatron_ext.launch) passes USR1 on once it runs; it starts here with USR1
#     ignored so that one arriving earlier cannot kill it, and its ranks ignore USR1 until the training loop
#     handles it (a USR1 before that is lost; the sbatch still requeues). Slurm signals every process of the step,
#     and this task also passes USR1 to the launcher's children itself: a rank that gets it twice saves once.
#   SIGTERM (time limit, scancel, preemption): Slurm sends it to every process of the step; the launcher also passes
#     it to its ranks and waits SHUTDOWN_TIMEOUT seconds (its --shutdown-timeout) before killing them.
# Exits with the launcher's status: 0 when every rank on this node exited 0 (after a signal too: they saved).
set -uo pipefail
launcher=${1:?usage: node_task.sh examples/<launcher>.sh [flags]}
shift
export NODE_RANK=${SLURM_NODEID:?not a Slurm task: SLURM_NODEID is unset}

trap '' USR1  # inherited by torchrun (and its ranks until the training loop installs its handler)
bash "$launcher" "$@" &
pid=$!  # torchrun's: every launcher execs it
source "$(dirname "${BASH_SOURCE[0]}")/_wait.sh"
trap 'interrupted=1; pkill -USR1 -P "$pid" 2>/dev/null || true' USR1
trap 'interrupted=1' TERM  # torchrun and its ranks got it too: wait for them
wait_through_traps "$pid"
