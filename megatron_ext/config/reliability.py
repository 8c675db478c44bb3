"""Long runs on shared clusters: preemption signals, a time limit, bad steps, checkpoint retention, collective
timeouts and replicas whose weights drifted apart (training/guard.py, training/replicas.py act on them)."""

from __future__ import annotations

import dataclasses
import signal
from typing import Optional, Tuple

from megatron_ext.config import Section, option
from megatron_ext.errors import ConfigError
from megatron_ext.flag_types import positive_int


def signal_names(text) -> Tuple[str, ...]:
    """``--exit-signals``: comma-separated names (``TERM`` or ``SIGTERM``), or 'none'."""
    if isinstance(text, tuple):
        return text
    names = () if text.strip().lower() == "none" else tuple(
        s.strip().upper() for s in text.split(",") if s.strip())
    for name in names:
        full = name if name.startswith("SIG") else f"SIG{name}"
        if not isinstance(getattr(signal, full, None), signal.Signals) or full in ("SIGKILL", "SIGSTOP"):
            raise ConfigError(f"--exit-signals: {name!r} is not a signal a process can catch; use names such as "
                              "SIGTERM,SIGUSR1 or 'none'")
    return tuple(n if n.startswith("SIG") else f"SIG{n}" for n in names)


@dataclasses.dataclass
class Reliability(Section):
    GROUP = "reliability (preemption, bad steps, hangs)"
    exit_signals: Tuple[str, ...] = option(
        "SIGTERM,SIGUSR1", help="signals that make every rank finish the step, save (with --save) and exit 0: "
        "comma-separated names, or 'none' (Slurm: sbatch --signal=B:USR1@120 and forward it, see docs/reliability.md)")
    exit_duration_mins: Optional[float] = option(
        None, flags=("--exit-duration-in-mins",), type=float,
        help="save and exit 0 once training has run this long (Megatron-LM's flag)")
    on_nan: str = option("stop", choices=("stop", "skip"),
                         help="a NaN/Inf loss or gradient: stop = exit 1 without saving it; skip = drop that update")
    loss_spike_factor: Optional[float] = option(
        None, type=float, help="log a warning when a step's loss exceeds this factor x the running mean (e.g. 3)")
    save_retain: Optional[int] = option(None, type=int, help="keep only the newest N checkpoints under --save")
    distributed_timeout_minutes: float = option(
        10.0, type=float, help="a collective that does not complete within this ends the job with a message")
    weight_hash_interval: Optional[int] = option(
        None, flags=("--check-weight-hash-across-dp-replicas-interval",), type=positive_int, metavar="N",
        help="every N steps compare every weight's fingerprint (on the device) across the data-parallel replicas and "
             "stop, unsaved, on a difference (silent data corruption); Megatron-LM's flag (megatron engine, "
             "ZeRO-0/1/2)")

    def __post_init__(self):
        self.exit_signals = signal_names(self.exit_signals)

    def check(self, run) -> None:
        for flag, value in (("--exit-duration-in-mins", self.exit_duration_mins),
                            ("--distributed-timeout-minutes", self.distributed_timeout_minutes)):
            if value is not None and not value > 0:
                raise ConfigError(f"{flag} must be > 0 (minutes), got {value}")
        if self.distributed_timeout_minutes > 525600:  # a timedelta beyond ~1e12 minutes overflows in init
            raise ConfigError(f"--distributed-timeout-minutes must be at most 525600 (a year), got "
                              f"{self.distributed_timeout_minutes}")
        if self.loss_spike_factor is not None and not self.loss_spike_factor > 1:
            raise ConfigError(f"--loss-spike-factor must be > 1 (a multiple of the running mean), got "
                              f"{self.loss_spike_factor}")
        if self.save_retain is not None:
            if self.save_retain < 1:
                raise ConfigError(f"--save-retain must be >= 1 (checkpoints kept), got {self.save_retain}")
            if not run.checkpoint.save:
                raise ConfigError("--save-retain needs --save DIR")
        engine = run.engine
        if self.weight_hash_interval is not None and engine.shards_weights:
            what = "--engine fsdp" if engine.engine == "fsdp" else "ZeRO-3"
            raise ConfigError(f"--check-weight-hash-across-dp-replicas-interval compares data-parallel replicas' "
                              f"weights; {what} shards them (no replicas); drop the flag, or use the megatron engine "
                              "or ZeRO-0/1/2")
