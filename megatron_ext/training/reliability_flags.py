"""Flags for long runs on shared clusters: preemption signals, a time limit, bad steps, checkpoint retention,
collective timeouts and replicas whose weights drifted apart. Torch-free, like ``arguments``: every check runs before any process group exists."""

from __future__ import annotations

import argparse
import dataclasses
import signal
from typing import Optional, Tuple

from megatron_ext.errors import ConfigError
from megatron_ext.flag_types import positive_int


@dataclasses.dataclass(frozen=True)
class ReliabilitySettings:
    exit_signals: Tuple[str, ...] = ("SIGTERM", "SIGUSR1")  # finish the step, save, exit 0 on every rank
    exit_duration_mins: Optional[float] = None  # the same, once the run has trained this long
    on_nan: str = "stop"  # a non-finite loss or gradient: "stop" (exit 1, nothing new saved) or "skip" the update
    loss_spike_factor: Optional[float] = None  # log steps whose loss exceeds this x the running mean
    save_retain: Optional[int] = None  # keep the newest N checkpoints under --save (None: all)
    distributed_timeout_minutes: float = 10.0  # what a collective may take before the job ends
    weight_hash_interval: Optional[int] = None  # compare the DP replicas' weights every N steps (training/replicas.py)


def add_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("reliability (preemption, bad steps, hangs)")
    g.add_argument("--exit-signals", default="SIGTERM,SIGUSR1",
                   help="signals that make every rank finish the step, save (with --save) and exit 0: comma-separated "
                        "names, or 'none' (Slurm: sbatch --signal=B:USR1@120 and forward it, see docs/reliability.md)")
    g.add_argument("--exit-duration-in-mins", type=float, default=None,
                   help="save and exit 0 once training has run this long (Megatron-LM's flag)")
    g.add_argument("--on-nan", default="stop", choices=["stop", "skip"],
                   help="a NaN/Inf loss or gradient: stop = exit 1 without saving it; skip = drop that update")
    g.add_argument("--loss-spike-factor", type=float, default=None,
                   help="log a warning when a step's loss exceeds this factor x the running mean (e.g. 3)")
    g.add_argument("--save-retain", type=int, default=None, help="keep only the newest N checkpoints under --save")
    g.add_argument("--distributed-timeout-minutes", type=float, default=10.0,
                   help="a collective that does not complete within this ends the job with a message")
    g.add_argument("--check-weight-hash-across-dp-replicas-interval", type=positive_int, default=None, metavar="N",
                   help="every N steps compare every weight's fingerprint (on the device) across the data-parallel "
                        "replicas and stop, unsaved, on a difference (silent data corruption); Megatron-LM's flag "
                        "(megatron engine, ZeRO-0/1/2)")


def settings_from_args(args: argparse.Namespace) -> ReliabilitySettings:
    """ConfigError (one line, with the fix) for values that cannot be."""
    names = () if args.exit_signals.strip().lower() == "none" else tuple(
        s.strip().upper() for s in args.exit_signals.split(",") if s.strip())
    for name in names:
        full = name if name.startswith("SIG") else f"SIG{name}"
        if not isinstance(getattr(signal, full, None), signal.Signals) or full in ("SIGKILL", "SIGSTOP"):
            raise ConfigError(f"--exit-signals: {name!r} is not a signal a process can catch; use names such as "
                              "SIGTERM,SIGUSR1 or 'none'")
    names = tuple(n if n.startswith("SIG") else f"SIG{n}" for n in names)
    positive = (("--exit-duration-in-mins", args.exit_duration_in_mins),
                ("--distributed-timeout-minutes", args.distributed_timeout_minutes))
    for flag, value in positive:
        if value is not None and not value > 0:
            raise ConfigError(f"{flag} must be > 0 (minutes), got {value}")
    if args.distributed_timeout_minutes > 525600:  # a timedelta beyond ~1e12 minutes overflows in init_process_group
        raise ConfigError(f"--distributed-timeout-minutes must be at most 525600 (a year), got "
                          f"{args.distributed_timeout_minutes}")
    if args.loss_spike_factor is not None and not args.loss_spike_factor > 1:
        raise ConfigError(f"--loss-spike-factor must be > 1 (a multiple of the running mean), got "
                          f"{args.loss_spike_factor}")
    if getattr(args, "async_save", False) and not args.save:
        raise ConfigError("--async-save needs --save DIR (where the checkpoints go)")
    if args.save_retain is not None:
        if args.save_retain < 1:
            raise ConfigError(f"--save-retain must be >= 1 (checkpoints kept), got {args.save_retain}")
        if not args.save:
            raise ConfigError("--save-retain needs --save DIR")
    interval = args.check_weight_hash_across_dp_replicas_interval
    sharded = args.engine == "fsdp" or (args.engine == "deepspeed" and args.zero_stage == 3)
    if interval is not None and sharded:
        what = "--engine fsdp" if args.engine == "fsdp" else "ZeRO-3"
        raise ConfigError(f"--check-weight-hash-across-dp-replicas-interval compares data-parallel replicas' "
                          f"weights; {what} shards them (no replicas); drop the flag, or use the megatron engine or "
                          "ZeRO-0/1/2")
    return ReliabilitySettings(exit_signals=names, exit_duration_mins=args.exit_duration_in_mins,
                               on_nan=args.on_nan, loss_spike_factor=args.loss_spike_factor,
                               save_retain=args.save_retain,
                               distributed_timeout_minutes=args.distributed_timeout_minutes,
                               weight_hash_interval=interval)
