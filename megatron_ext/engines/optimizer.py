"""The optimizer every engine runs: AdamW under Megatron-LM's learning-rate schedule, its flags (Megatron-LM's names)
and their checks, which run before any process group exists (torch-free until a schedule is built)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Tuple

from megatron_ext.config import Section, option
from megatron_ext.errors import ConfigError
from megatron_ext.flag_types import fraction, nonneg_float, nonneg_int, positive_float, positive_int

DECAY_STYLES = ("cosine", "linear", "constant", "inverse-square-root", "WSD")  # megatron-core's, Megatron-LM's names
WSD_DECAY_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")


@dataclasses.dataclass
class OptimizerSettings(Section):
    """AdamW and its schedule. The schedule's lengths count steps, or samples when ``samples_per_step`` is the global
    batch (Megatron-LM's --train-samples and --lr-*-samples: the scheduler then advances by the global batch every
    step); ``check`` resolves them from whichever flags were given."""

    GROUP = "optimizer (AdamW on every engine)"
    lr: float = option(1e-4, type=nonneg_float)
    min_lr: float = option(0.0, type=nonneg_float)
    lr_warmup_iters: Optional[int] = option(None, type=nonneg_int, help="linear warm-up steps from 0 (default 0)")
    lr_decay_iters: Optional[int] = option(
        None, type=positive_int, help="steps from the start to the end of the decay, at --min-lr after (default: "
        "--train-iters)")
    lr_warmup_fraction: Optional[float] = option(
        None, type=fraction, help="the warm-up as a share of the decay's length, instead of --lr-warmup-iters/-samples")
    lr_warmup_samples: Optional[int] = option(None, type=nonneg_int, help="with --train-samples: in samples")
    lr_decay_samples: Optional[int] = option(None, type=positive_int,
                                             help="with --train-samples: in samples (default: --train-samples)")
    lr_wsd_decay_samples: Optional[int] = option(None, type=positive_int, help="with --train-samples: in samples")
    decay_style: str = option(
        "cosine", flags=("--lr-decay-style",), choices=DECAY_STYLES,
        help="WSD: warm-up, --lr until the last --lr-wsd-decay-iters steps before --lr-decay-iters, then "
             "--lr-wsd-decay-style down to --min-lr")
    lr_wsd_decay_iters: Optional[int] = option(None, type=positive_int,
                                               help="WSD: the annealing phase's steps (it ends at --lr-decay-iters)")
    wsd_decay_style: Optional[str] = option(None, flags=("--lr-wsd-decay-style",), choices=WSD_DECAY_STYLES,
                                            help="WSD: the annealing phase's shape (default exponential)")
    override_schedule: bool = option(
        False, flags=("--override-opt-param-scheduler", "--override-opt_param-scheduler"),
        help="resuming: this run's --lr, --min-lr, --lr-warmup-iters, --lr-decay-iters, --lr-decay-style (and WSD's), "
             "and --weight-decay replace the checkpoint's schedule from its step on")
    weight_decay: float = option(0.0, type=nonneg_float)
    clip_grad: float = option(1.0, type=nonneg_float, help="global grad-norm clip; 0 disables")
    adam_beta1: float = option(0.9, type=fraction)
    adam_beta2: float = option(0.95, type=fraction, help="default 0.95 (Megatron-LM's and torch's: 0.999)")
    adam_eps: float = option(1e-8, type=positive_float)
    loss_scale: Optional[float] = option(None, type=positive_float,
                                         help="fp16: static loss scale (default: dynamic)")
    initial_loss_scale: float = option(2.0**32, type=positive_float, help="fp16: first dynamic loss scale")
    # what check() resolves (the schedule in its unit), or what a test sets directly
    samples_per_step: int = option(1, cli=False)
    warmup_iters: int = option(0, cli=False)
    decay_iters: int = option(1, cli=False)
    wsd_decay_iters: Optional[int] = option(None, cli=False)
    rampup: Optional[object] = option(None, cli=False)  # config/rampup.Rampup: each step's own batch

    def check(self, run) -> None:
        """The learning-rate schedule as a whole (the ranges of single flags are their types'): sets the run's
        --train-iters and this schedule's lengths in its unit."""
        training = run.training
        flags, warmup, decay, wsd_length = self._lengths(training)
        length_flag, warmup_flag, decay_flag, wsd_flag = flags
        unit = "samples" if length_flag == "--train-samples" else "steps"
        if self.min_lr > self.lr:
            raise ConfigError(f"--min-lr {self.min_lr} is above --lr {self.lr}; the schedule decays from --lr down "
                              "to --min-lr: use --min-lr <= --lr")
        if self._given(decay_flag, training) is not None and decay <= warmup:
            raise ConfigError(f"{decay_flag} {decay} ends the decay before {warmup_flag} {warmup} ends the warm-up; "
                              f"use {decay_flag} > {warmup_flag}")
        wsd = self.decay_style == "WSD"
        for flag, value in ((wsd_flag, wsd_length), ("--lr-wsd-decay-style", self.wsd_decay_style)):
            if value is not None and not wsd:
                raise ConfigError(f"{flag} shapes WSD's annealing phase, but --lr-decay-style is {self.decay_style}; "
                                  f"add --lr-decay-style WSD or drop {flag}")
        if wsd and wsd_length is None:
            raise ConfigError(f"--lr-decay-style WSD needs {wsd_flag} N: the last N {unit} before {decay_flag} anneal "
                              "to --min-lr")
        stable = max(decay - warmup, 0)
        if wsd and wsd_length > stable:
            raise ConfigError(f"{wsd_flag} {wsd_length} is longer than the {stable} {unit} from the warm-up's end to "
                              f"{decay_flag} (default {length_flag}); use at most that many")
        self.samples_per_step = training.global_batch_size if unit == "samples" else 1
        self.warmup_iters, self.decay_iters, self.wsd_decay_iters = warmup, decay, wsd_length

    def _given(self, flag: str, training):
        name = flag[2:].replace("-", "_")
        return getattr(training, name) if name in ("train_iters", "train_samples") else getattr(self, name)

    def _lengths(self, training) -> Tuple[Tuple[str, ...], int, int, Optional[int]]:
        """The unit's flags (``UNITS``) and the warm-up, decay and WSD lengths in it; sets the run's train_iters
        (--train-samples // --global-batch-size with samples)."""
        unit = "samples" if training.train_samples is not None else "steps"
        for flag, counterpart in zip(*(UNITS[u] for u in UNITS if u != unit), UNITS[unit]):
            if self._given(flag, training) is None:
                continue
            if flag in ("--train-iters", "--train-samples"):
                raise ConfigError("--train-iters and --train-samples both give the run's length; keep one")
            raise ConfigError(f"{flag} counts {'steps' if unit == 'samples' else 'samples'}, but the run's length is "
                              f"{UNITS[unit][0]}: use {counterpart}" + ("" if unit == "samples" else
                                                                        ", or give --train-samples"))
        _, warmup_flag, decay_flag, wsd_flag = UNITS[unit]
        if unit == "samples":
            training.train_iters = training.train_samples // training.global_batch_size
            if not training.train_iters:
                raise ConfigError(f"--train-samples {training.train_samples} is less than one --global-batch-size "
                                  f"{training.global_batch_size}; train on more samples")
        elif training.train_iters is None:
            training.train_iters = 10
        warmup = self._given(warmup_flag, training)
        decay = self._given(decay_flag, training) or (training.train_samples if unit == "samples"
                                                      else training.train_iters)
        if self.lr_warmup_fraction is not None:
            if warmup is not None:
                raise ConfigError(f"--lr-warmup-fraction and {warmup_flag} both give the warm-up; keep one")
            warmup = int(self.lr_warmup_fraction * decay)
        return UNITS[unit], warmup or 0, decay, self._given(wsd_flag, training)

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
            wsd_decay_steps=self.wsd_decay_iters, lr_wsd_decay_style=self.wsd_decay_style or "exponential",
            rampup=self.rampup)


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


# A run's length and schedule in steps, or in samples (Megatron-LM's two kinds of flags; never mixed)
UNITS = {"steps": ("--train-iters", "--lr-warmup-iters", "--lr-decay-iters", "--lr-wsd-decay-iters"),
         "samples": ("--train-samples", "--lr-warmup-samples", "--lr-decay-samples", "--lr-wsd-decay-samples")}
