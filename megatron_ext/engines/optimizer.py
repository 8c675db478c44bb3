"""The optimizer every engine runs: AdamW under Megatron-LM's learning-rate schedule, its flags (Megatron-LM's names)
and their checks, which run before any process group exists (torch-free until a schedule is built)."""

from __future__ import annotations

import argparse
import dataclasses
import functools
from typing import Optional, Tuple

from megatron_ext.errors import ConfigError
from megatron_ext.flag_types import fraction, nonneg_float, nonneg_int, positive_float, positive_int

DECAY_STYLES = ("cosine", "linear", "constant", "inverse-square-root", "WSD")  # megatron-core's, Megatron-LM's names
WSD_DECAY_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")


@dataclasses.dataclass
class OptimizerSettings:
    lr: float = 1e-4
    min_lr: float = 0.0
    weight_decay: float = 0.0
    clip_grad: float = 1.0
    # The schedule's lengths count steps, or samples when samples_per_step is the global batch (Megatron-LM's
    # --train-samples and --lr-*-samples: the scheduler then advances by the global batch every step).
    samples_per_step: int = 1
    warmup_iters: int = 0
    decay_iters: int = 1
    decay_style: str = "cosine"
    wsd_decay_iters: Optional[int] = None  # WSD: the last steps before decay_iters, where it anneals to min_lr
    wsd_decay_style: str = "exponential"
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    loss_scale: Optional[float] = None  # fp16 only: static scale; None = dynamic, starting at initial_loss_scale
    initial_loss_scale: float = 2.0**32
    override_schedule: bool = False  # resuming: this schedule replaces the checkpoint's (resume_schedule)
    rampup: Optional[object] = None  # training/rampup.Rampup: the schedule advances by each step's own batch

    def lr_schedule(self, optimizer):
        """megatron-core's scheduler over ``optimizer`` (any engine's): linear warm-up from 0 over ``warmup_iters``,
        then ``decay_style`` down to ``min_lr`` at ``decay_iters``, where it stays (WSD: ``lr`` until its last
        ``wsd_decay_iters`` steps, ``wsd_decay_style`` down from there); weight decay constant."""
        return _scheduler_class()(
            self.samples_per_step, optimizer, init_lr=0.0 if self.warmup_iters else self.lr, max_lr=self.lr,
            min_lr=self.min_lr,
            lr_warmup_steps=self.warmup_iters, lr_decay_steps=max(self.decay_iters, self.warmup_iters + 1),
            lr_decay_style=self.decay_style, start_wd=self.weight_decay, end_wd=self.weight_decay, wd_incr_steps=1,
            wd_incr_style="constant", override_opt_param_scheduler=self.override_schedule,
            use_checkpoint_opt_param_scheduler=not self.override_schedule,
            wsd_decay_steps=self.wsd_decay_iters, lr_wsd_decay_style=self.wsd_decay_style, rampup=self.rampup)


@functools.cache
def _scheduler_class():
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    class Schedule(OptimizerParamScheduler):
        """megatron-core's, counting ``samples_per_step`` per optimizer step, with that unit and WSD's two settings
        in its state (megatron-core's leaves them out, so a resume with another annealing phase would pass
        unnoticed)."""

        def __init__(self, samples_per_step: int, *args, rampup=None, **kwargs):
            self.samples_per_step, self.rampup = samples_per_step, rampup
            super().__init__(*args, **kwargs)

        def step(self, increment: int) -> None:
            # (with a batch-size ramp-up the schedule counts samples: num_steps is the samples consumed so far)
            batch = self.rampup.batch_at(self.num_steps) if self.rampup and increment else self.samples_per_step
            super().step(increment * batch)

        def load_state_dict(self, state_dict: dict) -> None:
            # megatron-core replays the saved count through step(), which here multiplies it by the samples a step
            # (a schedule in samples came back 64x further on at 64 a step): the count is restored as saved
            state = dict(state_dict)
            saved = state.pop("num_iters", None)
            saved = state["num_steps"] if saved is None else saved
            super().load_state_dict(dict(state, num_steps=0))
            self.num_steps = saved
            super().step(0)

        def state_dict(self) -> dict:
            return dict(super().state_dict(), wsd_decay_steps=self.wsd_decay_steps,
                        lr_wsd_decay_style=self.lr_wsd_decay_style, samples_per_step=self.samples_per_step)

    return Schedule


# The schedule's state -> the flag that sets it
_SCHEDULE_FLAGS = {"max_lr": "--lr", "min_lr": "--min-lr", "lr_warmup_steps": "--lr-warmup-iters",
                   "lr_decay_steps": "--lr-decay-iters", "lr_decay_style": "--lr-decay-style",
                   "start_wd": "--weight-decay", "wsd_decay_steps": "--lr-wsd-decay-iters",
                   "lr_wsd_decay_style": "--lr-wsd-decay-style"}


def resume_schedule(scheduler, saved: dict) -> None:
    """Continue the checkpoint's learning-rate schedule at its step. Flags that describe another schedule are refused
    in one line (megatron-core would silently keep the checkpoint's: a run resumed with a longer --train-iters
    trained at --min-lr from the old end on), unless --override-opt-param-scheduler makes this run's the schedule
    from that step on."""
    unit, was_unit = scheduler.samples_per_step, saved.get("samples_per_step", 1)
    if unit != was_unit and not scheduler.override_opt_param_scheduler:
        raise ConfigError(f"the checkpoint under --load counted its schedule in {_unit_name(was_unit)}, this run in "
                          f"{_unit_name(unit)}: give the checkpoint's kind of flags, or --override-opt-param-scheduler")
    names = {key: flag.replace("-iters", "-samples") if unit > 1 else flag for key, flag in _SCHEDULE_FLAGS.items()}
    changed = [(names[key], saved[key], getattr(scheduler, key)) for key in _SCHEDULE_FLAGS
               if key in saved and saved[key] != getattr(scheduler, key)]
    if changed and not scheduler.override_opt_param_scheduler:
        was = " ".join(f"{flag} {old}" for flag, old, _ in changed)
        now = " ".join(f"{flag} {new}" for flag, _, new in changed)
        default = "".join(f" ({decay} defaults to {length})" for decay, length in (
            ("--lr-decay-iters", "--train-iters"), ("--lr-decay-samples", "--train-samples")) if decay in was)
        raise ConfigError(f"the checkpoint under --load was training with {was}, this run asks for {now}{default}: "
                          "pass the checkpoint's values to continue its schedule, or --override-opt-param-scheduler "
                          f"to follow this run's from step {saved.get('num_steps', '?')}")
    scheduler.load_state_dict(saved)
    if unit != was_unit:  # overridden: the same point of training in this run's unit
        scheduler.num_steps = saved["num_steps"] // was_unit * unit
        scheduler.step(0)


def _unit_name(samples_per_step: int) -> str:
    return "steps" if samples_per_step == 1 else f"samples ({samples_per_step} a step)"


def add_flags(p: argparse.ArgumentParser) -> None:
    defaults = OptimizerSettings()
    g = p.add_argument_group("optimizer (AdamW on every engine)")
    g.add_argument("--lr", type=nonneg_float, default=defaults.lr)
    g.add_argument("--min-lr", type=nonneg_float, default=defaults.min_lr)
    g.add_argument("--lr-warmup-iters", type=nonneg_int, default=None, help="linear warm-up steps from 0 (default 0)")
    g.add_argument("--lr-decay-iters", type=positive_int, default=None,
                   help="steps from the start to the end of the decay, at --min-lr after (default: --train-iters)")
    g.add_argument("--lr-warmup-fraction", type=fraction, default=None,
                   help="the warm-up as a share of the decay's length, instead of --lr-warmup-iters/-samples")
    g.add_argument("--lr-warmup-samples", type=nonneg_int, default=None, help="with --train-samples: in samples")
    g.add_argument("--lr-decay-samples", type=positive_int, default=None,
                   help="with --train-samples: in samples (default: --train-samples)")
    g.add_argument("--lr-wsd-decay-samples", type=positive_int, default=None, help="with --train-samples: in samples")
    g.add_argument("--lr-decay-style", default=defaults.decay_style, choices=DECAY_STYLES,
                   help="WSD: warm-up, --lr until the last --lr-wsd-decay-iters steps before --lr-decay-iters, then "
                        "--lr-wsd-decay-style down to --min-lr")
    g.add_argument("--lr-wsd-decay-iters", type=positive_int, default=None,
                   help="WSD: the annealing phase's steps (it ends at --lr-decay-iters)")
    g.add_argument("--lr-wsd-decay-style", default=None, choices=WSD_DECAY_STYLES,
                   help=f"WSD: the annealing phase's shape (default {defaults.wsd_decay_style})")
    g.add_argument("--override-opt-param-scheduler", "--override-opt_param-scheduler", action="store_true",
                   help="resuming: this run's --lr, --min-lr, --lr-warmup-iters, --lr-decay-iters, --lr-decay-style "
                        "(and WSD's), and --weight-decay replace the checkpoint's schedule from its step on")
    g.add_argument("--weight-decay", type=nonneg_float, default=defaults.weight_decay)
    g.add_argument("--clip-grad", type=nonneg_float, default=defaults.clip_grad,
                   help="global grad-norm clip; 0 disables")
    g.add_argument("--adam-beta1", type=fraction, default=defaults.adam_beta1)
    g.add_argument("--adam-beta2", type=fraction, default=defaults.adam_beta2,
                   help=f"default {defaults.adam_beta2} (Megatron-LM's and torch's: 0.999)")
    g.add_argument("--adam-eps", type=positive_float, default=defaults.adam_eps)
    g.add_argument("--loss-scale", type=positive_float, default=None, help="fp16: static loss scale (default: dynamic)")
    g.add_argument("--initial-loss-scale", type=positive_float, default=defaults.initial_loss_scale,
                   help="fp16: first dynamic loss scale")


# A run's length and schedule in steps, or in samples (Megatron-LM's two kinds of flags; never mixed)
UNITS = {"steps": ("--train-iters", "--lr-warmup-iters", "--lr-decay-iters", "--lr-wsd-decay-iters"),
         "samples": ("--train-samples", "--lr-warmup-samples", "--lr-decay-samples", "--lr-wsd-decay-samples")}


def _given(args: argparse.Namespace, flag: str):
    return getattr(args, flag[2:].replace("-", "_"))


def _lengths(args: argparse.Namespace) -> Tuple[Tuple[str, ...], int, int, Optional[int]]:
    """The unit's flags (``UNITS``) and the warm-up, decay and WSD lengths in it; sets ``args.train_iters``
    (--train-samples // --global-batch-size with samples)."""
    unit = "samples" if args.train_samples is not None else "steps"
    for flag, counterpart in zip(*(UNITS[u] for u in UNITS if u != unit), UNITS[unit]):
        if _given(args, flag) is None:
            continue
        if flag in ("--train-iters", "--train-samples"):
            raise ConfigError("--train-iters and --train-samples both give the run's length; keep one")
        raise ConfigError(f"{flag} counts {'steps' if unit == 'samples' else 'samples'}, but the run's length is "
                          f"{UNITS[unit][0]}: use {counterpart}" + ("" if unit == "samples" else
                                                                    ", or give --train-samples"))
    _, warmup_flag, decay_flag, wsd_flag = UNITS[unit]
    if unit == "samples":
        args.train_iters = args.train_samples // args.global_batch_size
        if not args.train_iters:
            raise ConfigError(f"--train-samples {args.train_samples} is less than one --global-batch-size "
                              f"{args.global_batch_size}; train on more samples")
    elif args.train_iters is None:
        args.train_iters = 10
    warmup = _given(args, warmup_flag)
    decay = _given(args, decay_flag) or (args.train_samples if unit == "samples" else args.train_iters)
    if args.lr_warmup_fraction is not None:
        if warmup is not None:
            raise ConfigError(f"--lr-warmup-fraction and {warmup_flag} both give the warm-up; keep one")
        warmup = int(args.lr_warmup_fraction * decay)
    return UNITS[unit], warmup or 0, decay, _given(args, wsd_flag)


def check(args: argparse.Namespace) -> None:
    """What the ranges of single flags (their ``type=``) cannot see: the learning-rate schedule as a whole. Sets
    ``args.train_iters`` and ``args.schedule`` (samples per step, warm-up, decay and WSD lengths: ``_lengths``)."""
    flags, warmup, decay, wsd_length = _lengths(args)
    length_flag, warmup_flag, decay_flag, wsd_flag = flags
    unit = "samples" if length_flag == "--train-samples" else "steps"
    if args.min_lr > args.lr:
        raise ConfigError(f"--min-lr {args.min_lr} is above --lr {args.lr}; the schedule decays from --lr down to "
                          "--min-lr: use --min-lr <= --lr")
    if _given(args, decay_flag) is not None and decay <= warmup:
        raise ConfigError(f"{decay_flag} {decay} ends the decay before {warmup_flag} {warmup} ends the warm-up; use "
                          f"{decay_flag} > {warmup_flag}")
    wsd = args.lr_decay_style == "WSD"
    for flag, value in ((wsd_flag, wsd_length), ("--lr-wsd-decay-style", args.lr_wsd_decay_style)):
        if value is not None and not wsd:
            raise ConfigError(f"{flag} shapes WSD's annealing phase, but --lr-decay-style is {args.lr_decay_style}; "
                              f"add --lr-decay-style WSD or drop {flag}")
    if wsd and wsd_length is None:
        raise ConfigError(f"--lr-decay-style WSD needs {wsd_flag} N: the last N {unit} before {decay_flag} anneal to "
                          "--min-lr")
    stable = max(decay - warmup, 0)
    if wsd and wsd_length > stable:
        raise ConfigError(f"{wsd_flag} {wsd_length} is longer than the {stable} {unit} from the warm-up's end to "
                          f"{decay_flag} (default {length_flag}); use at most that many")
    args.schedule = dict(per_step=args.global_batch_size if unit == "samples" else 1, warmup=warmup, decay=decay,
                         wsd=wsd_length)


def settings_from_args(args: argparse.Namespace) -> OptimizerSettings:
    return OptimizerSettings(
        lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay, clip_grad=args.clip_grad,
        samples_per_step=args.schedule["per_step"], warmup_iters=args.schedule["warmup"],
        decay_iters=args.schedule["decay"], decay_style=args.lr_decay_style, wsd_decay_iters=args.schedule["wsd"],
        wsd_decay_style=args.lr_wsd_decay_style or OptimizerSettings.wsd_decay_style, adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2, adam_eps=args.adam_eps, loss_scale=args.loss_scale,
        initial_loss_scale=args.initial_loss_scale, override_schedule=args.override_opt_param_scheduler,
        rampup=getattr(args, "rampup", None))
