"""One sink for per-step metrics: JSONL, TensorBoard, wandb and a progress bar, then a summary and a plot at the end."""

from __future__ import annotations

import collections
import json
import math
import netrc
import os
import sys
import urllib.parse
from typing import List, Optional

from tqdm import tqdm

from megatron_ext.observability.metrics import suggest_micro_batch_size



def _keep_steps_up_to(path: str, step: int) -> List[dict]:
    """A resumed run's metrics.jsonl continues the file it left: the records of the steps up to its checkpoint's
    are kept (and returned), later ones (steps taken after the last save, which the resumed run takes again)
    dropped."""
    if not os.path.exists(path):
        return []
    kept, lines = [], []
    with open(path) as f:
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:  # the torn last line of a killed run
                continue
            if record.get("step", 0) <= step:
                kept.append(record)
                lines.append(line.rstrip("\n") + "\n")
    with open(path + ".tmp", "w") as f:
        f.writelines(lines)
    os.replace(path + ".tmp", path)
    return kept

class MetricsLogger:
    """Created with ``enabled=True`` on the logging rank only; elsewhere every method is a no-op, so the loop calls
    it unconditionally. Records are flat dicts with at least ``step``; None values are fine (JSON null)."""

    def __init__(self, log_dir: Optional[str] = None, tensorboard_dir: Optional[str] = None,
                 wandb_project: Optional[str] = None, wandb_exp_name: Optional[str] = None,
                 config: Optional[dict] = None, enabled: bool = True, total_steps: Optional[int] = None,
                 batching: Optional[dict] = None, run_info: Optional[dict] = None, samples: str = "samples",
                 resumed_at: int = 0):
        self.enabled = enabled
        self.batching = batching  # micro_batch_size, num_microbatches, memory_capacity: for the summary's hint
        self.run_info = run_info  # world size, mesh, engine, model...: summary.json's "run", for compare_runs.py
        self.samples = samples  # "images" for image models: throughput is reported in images/s
        self.log_dir = log_dir
        self.records: List[dict] = []
        self.earlier: List[dict] = []  # a resumed run's records before its checkpoint (metrics.jsonl's), for the plot
        self._jsonl = self._tensorboard = self._wandb_run = self._progress = None
        if not enabled:
            return
        if log_dir:
            os.makedirs(log_dir, exist_ok=True)
            path = os.path.join(log_dir, "metrics.jsonl")
            if resumed_at:
                self.earlier = _keep_steps_up_to(path, resumed_at)
            self._jsonl = open(path, "a" if resumed_at else "w")
        if tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter
            self._tensorboard = SummaryWriter(tensorboard_dir)
        if wandb_project:
            self._wandb_run = _start_wandb(wandb_project, wandb_exp_name, config, log_dir or tensorboard_dir)
        self._progress = tqdm(total=total_steps, initial=resumed_at, desc="train", unit="step", dynamic_ncols=True)

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def log(self, record: dict) -> None:
        """Write one step's record everywhere; the JSONL line is flushed so a crash loses nothing already logged."""
        if not self.enabled:
            return
        record = {key: value.item() if hasattr(value, "item") else value for key, value in record.items()}
        self.records.append(record)
        if self._jsonl:
            self._jsonl.write(_json(record) + "\n")
            self._jsonl.flush()
        scalars = {key: value for key, value in record.items()
                   if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)}
        if self._tensorboard:
            for key, value in scalars.items():
                self._tensorboard.add_scalar(key, value, record["step"])
        if self._wandb_run:
            self._wandb_run.log(scalars, step=record["step"])
        if "loss" in record:
            self._progress.set_postfix_str(_progress_text(record, self.samples), refresh=False)
            self._progress.update(max(0, record["step"] - self._progress.n))

    def write(self, line: str) -> None:
        """Print a line above the progress bar instead of through it."""
        if self.enabled:
            tqdm.write(line)

    def close(self) -> Optional[str]:
        """Print the run's summary; with ``log_dir`` write summary.json and training.png (unless
        MEGATRON_EXT_PLOT=0) and return the plot's path."""
        if not self.enabled:
            return None
        self.enabled = False
        self._progress.close()
        summary = summarize(self.records, self.batching)
        print(format_summary(summary, self.samples), flush=True)
        if self._jsonl:
            self._jsonl.close()
        if self._tensorboard:
            self._tensorboard.close()
        if self._wandb_run:
            self._wandb_run.summary.update({key: value for key, value in summary.items() if value is not None})
            self._wandb_run.finish()
        if not self.log_dir:
            return None
        if self.run_info is not None:
            summary = dict(summary, run=self.run_info)
        with open(os.path.join(self.log_dir, "summary.json"), "w") as f:
            f.write(_json(summary, indent=2) + "\n")
        if os.environ.get("MEGATRON_EXT_PLOT") == "0":  # sweeps and tests: a third of a short run's wall time
            return None
        plot_path = os.path.join(self.log_dir, "training.png")
        plot_training(self.earlier + self.records, plot_path, self.samples)  # the whole run across its resumes
        print(f"plot: {plot_path}", flush=True)
        return plot_path


def summarize(records: List[dict], batching: Optional[dict] = None) -> dict:
    """The run in a few numbers. Speeds average over steps after the first, which pays for warm-up (allocator,
    kernel selection, compilation), and outside the profiler's window (--profile), unless nothing else is left.
    With ``batching`` (micro_batch_size, num_microbatches, memory_capacity), the largest micro-batch that surely fits
    the device."""
    train = [r for r in records if "loss" in r]
    steady = [r for r in train[1:] if not r.get("profiled")] or train[1:] or train
    losses = [r["loss"] for r in train if r["loss"] is not None]
    val_losses = [r["val_loss"] for r in records if r.get("val_loss") is not None]

    def mean(key):
        values = [r[key] for r in steady if r.get(key) is not None]
        return sum(values) / len(values) if values else None

    mem_peak = max((r["mem_peak"] for r in records if r.get("mem_peak") is not None), default=None)
    saves = {key: [r[key] for r in records if r.get(key) is not None]
             for key in ("save_staging_time", "save_total_time")}
    suggestion = suggest_micro_batch_size(mem_peak, batching["memory_capacity"], batching["micro_batch_size"],
                                          batching["num_microbatches"]) if batching else None
    last_eval = next((r for r in reversed(records) if r.get("val_loss") is not None), {})
    parts = {name: mean(f"{name}_time") for name in SPLIT}
    step_time = mean("step_time")
    time_split = {name: value / step_time for name, value in parts.items()
                  if value is not None and step_time} or None
    return dict(steps=len(train), final_loss=train[-1]["loss"] if train else None, min_loss=min(losses, default=None),
                final_val_loss=val_losses[-1] if val_losses else None,
                final_val_top1=last_eval.get("val_top1"), final_val_top5=last_eval.get("val_top5"),
                final_val_math_accuracy=next((r["val_math_accuracy"] for r in reversed(records)
                                              if r.get("val_math_accuracy") is not None), None),
                mean_step_time=step_time, time_split=time_split,
                tokens_per_sec=mean("tokens_per_sec"), samples_per_sec=mean("samples_per_sec"), mfu=mean("mfu"),
                mem_peak=mem_peak, suggested_micro_batch_size=suggestion, saves=len(saves["save_staging_time"]),
                save_blocking_time=sum(r.get("save_blocking_time", 0.0) for r in records) if saves["save_staging_time"]
                else None, **{f"mean_{key}": sum(v) / len(v) if v else None for key, v in saves.items()},
                profiled_steps=_span([r["step"] for r in train if r.get("profiled")]),
                **_stragglers(steady),
                moe_load_max=train[-1].get("moe_load_max") if train else None,
                moe_load_cv=train[-1].get("moe_load_cv") if train else None,
                **{f"final_{key}": last_eval.get(key) if key.startswith("val_") else train[-1].get(key) if train
                   else None for key in DPO})


def _stragglers(steady: List[dict]) -> dict:
    """The rank most often slowest (the longest busy time: the step less its waits for others), how often, and by
    how much the slowest rank's busy time exceeds the fastest's on average; None on one rank (nothing to compare)."""
    steps = [r for r in steady if r.get("busy_time_min") and r.get("busy_time_max", 0) > r["busy_time_min"]]
    if not steps:
        return dict(slowest_rank=None, slowest_rank_share=None, busy_spread=None)
    rank, count = collections.Counter(r["slowest_rank"] for r in steps).most_common(1)[0]
    spread = sum(r["busy_time_max"] / r["busy_time_min"] - 1 for r in steps) / len(steps)
    return dict(slowest_rank=rank, slowest_rank_share=count / len(steps), busy_spread=spread)


def _span(steps: List[int]) -> Optional[str]:
    return None if not steps else str(steps[0]) if len(steps) == 1 else f"{steps[0]}-{steps[-1]}"


# DPO's and reward models' last values in the summary (objectives/dpo.py, objectives/reward.py; TRL's names): the last
# step's, or the last evaluation's
DPO = ("rewards/accuracies", "rewards/margins", "val_rewards/accuracies", "val_rewards/margins", "accuracy", "margin",
       "val_accuracy", "val_margin")


# The step's parts (observability.regions; "other": host work between them, schedules, syncs), as the summary names
# them.
SPLIT = dict(data="data", forward="forward", backward="backward", pipeline_comm="pipeline comm",
             grad_reduce="grad reduce", optimizer="optimizer", gc="gc", other="other")


def format_summary(summary: dict, samples: str = "samples") -> str:
    """A two-column table; unknown values print as n/a. Image runs count images, not tokens (patches)."""
    rows = [("steps", "steps", "{:d}"), ("final loss", "final_loss", "{:.4f}"), ("min loss", "min_loss", "{:.4f}"),
            ("final val loss", "final_val_loss", "{:.4f}"), ("final val top-1", "final_val_top1", "{:.1%}"),
            ("final val top-5", "final_val_top5", "{:.1%}"),
            ("final val math accuracy", "final_val_math_accuracy", "{:.1%}"),
            ("profiled steps", "profiled_steps", "{} (left out of the times and speeds below)"),
            ("mean step time (after step 1)", "mean_step_time", "{:.3f} s"),
            ("tokens/s", "tokens_per_sec", "{:,.0f}"), (f"{samples}/s", "samples_per_sec", "{:,.2f}"),
            ("MFU", "mfu", "{:.1%}"), ("peak memory", "mem_peak", "{:.2f} GiB"),
            ("slowest rank", "slowest_rank", "{:d}"),
            ("save: training waited", "save_blocking_time", "{:.2f} s in all"),
            ("save: staging", "mean_save_staging_time", "{:.2f} s per save"),
            ("save: staged to committed", "mean_save_total_time", "{:.2f} s per save"),
            ("fits --micro-batch-size", "suggested_micro_batch_size", "{:d} (fewer, larger kernels)"),
            ("busiest expert / balanced share", "moe_load_max", "{:.2f}x"), ("expert load CV", "moe_load_cv", "{:.2f}"),
            *((f"final {key}", f"final_{key}", "{:.1%}" if "accurac" in key else "{:.4f}") for key in DPO)]
    lines = ["training summary"]
    for label, key, fmt in rows:
        value = summary.get(key)
        if key == "tokens_per_sec" and samples == "images":
            continue
        if key in ("suggested_micro_batch_size", "profiled_steps", "final_val_top1", "final_val_top5", "final_val_math_accuracy",
                   "moe_load_max", "moe_load_cv", "save_blocking_time", "mean_save_staging_time",
                   "mean_save_total_time", *(f"final_{key}" for key in DPO)) and value is None:
            continue  # rows only some runs have (accuracy: classifiers, --eval-generate-samples; MoE: router load)
        if key == "mem_peak" and value is not None:
            value /= 2 ** 30
        if key == "slowest_rank":
            if value is None:
                continue
            fmt += (f" (in {summary['slowest_rank_share']:.0%} of steps; busy {summary['busy_spread']:.0%} longer "
                    "than the fastest rank's)")
        lines.append(f"  {label:<30} {'n/a' if value is None else fmt.format(value)}")
        if key == "mean_step_time" and summary.get("time_split"):
            split = " ".join(f"{SPLIT[name]} {share:.0%}" for name, share in summary["time_split"].items()
                             if share >= 0.005)
            lines.append(f"  {'  of which':<30} {split}")
    return "\n".join(lines)


def plot_training(records: List[dict], path: str, samples: str = "samples") -> None:
    """Loss (with validation points), tokens/s and, for classifiers and --eval-generate-samples, accuracy (for MoE
    models, router load) against step, profiled steps shaded, as a PNG; the Agg canvas needs no display and leaves pyplot's global backend alone."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    classifier = any(r.get(key) is not None for r in records for key in ("top1", "val_top1", "val_math_accuracy"))
    router = not classifier and any(r.get("moe_load_max") is not None for r in records)
    third = classifier or router
    # Fixed margins: the constrained layout engine drew the figure twice and doubled the cost (~0.4 s a run).
    fig = Figure(figsize=(16 if third else 11, 4))
    fig.subplots_adjust(left=0.06 if third else 0.08, right=0.985, bottom=0.13, top=0.92, wspace=0.22)
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 3 if third else 2)
    loss_ax, speed_ax = axes[:2]
    loss_ax.plot(*_series(records, "loss"), label="train")
    val_steps, val_losses = _series(records, "val_loss")
    if val_steps:
        loss_ax.plot(val_steps, val_losses, "o", label="validation")
    loss_ax.set(xlabel="step", ylabel="loss", title="loss")
    loss_ax.legend()
    speed = "samples_per_sec" if samples == "images" else "tokens_per_sec"
    speed_ax.plot(*_series(records, speed))
    speed_ax.set(xlabel="step", ylabel="images/s" if samples == "images" else "tokens/s", title="throughput")
    if classifier:
        for key, style, label in (("top1", "-", "train top-1"), ("val_top1", "o-", "val top-1"),
                                  ("val_top5", "s--", "val top-5"), ("val_math_accuracy", "o-", "val math")):
            steps, values = _series(records, key)
            if steps:
                axes[2].plot(steps, values, style, label=label)
        axes[2].set(xlabel="step", ylabel="accuracy", title="accuracy", ylim=(-0.03, 1.05))  # markers at 1 whole
        axes[2].legend()
    if router:  # MoE: how evenly the router spreads tokens (1 and 0 when perfectly balanced)
        for key, label in (("moe_load_max", "busiest expert / balanced share"), ("moe_load_cv", "load CV")):
            axes[2].plot(*_series(records, key), label=label)
        axes[2].set(xlabel="step", title="router load")
        axes[2].set_ylim(bottom=0)
        axes[2].legend()
    profiled = [r["step"] for r in records if r.get("profiled")]
    if profiled:  # the profiler's steps run slower: shaded, and left out of the summary's speeds
        for ax in axes:
            ax.axvspan(min(profiled) - 0.5, max(profiled) + 0.5, color="tab:orange", alpha=0.15,
                       label="profiled" if ax is speed_ax else None)
        speed_ax.legend()
    for ax in axes:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.savefig(path, dpi=100)


def _series(records: List[dict], key: str):
    points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
    return [step for step, _ in points], [value for _, value in points]


def _progress_text(record: dict, samples: str = "samples") -> str:
    speed = (f"{record['samples_per_sec']:,.1f} img/s" if samples == "images" and record.get("samples_per_sec")
             else f"{record['tokens_per_sec']:,.0f} tok/s" if record.get("tokens_per_sec") is not None else None)
    parts = [f"loss {record['loss']:.4f}" if record.get("loss") is not None else None, speed,
             f"MFU {record['mfu']:.1%}" if record.get("mfu") is not None else None]
    return " | ".join(part for part in parts if part)


def _json(obj: dict, **kwargs) -> str:
    """Strict JSON: NaN and infinities, which json.dumps would write bare, become null."""
    return json.dumps({key: None if isinstance(value, float) and not math.isfinite(value) else value
                       for key, value in obj.items()}, **kwargs)


def _start_wandb(project: str, name: Optional[str], config: Optional[dict], directory: Optional[str]):
    """A wandb run, or None after one warning line: an optional sink must never stop a training run.

    The mode comes from WANDB_MODE; without it, a run with no credentials goes offline instead of prompting.
    """
    try:
        import wandb

        mode = os.environ.get("WANDB_MODE") or ("online" if _wandb_credentials_configured() else "offline")
        return wandb.init(project=project, name=name, config=config, dir=directory, mode=mode)
    except Exception as e:  # ImportError, auth and network failures alike
        print(f"warning: wandb logging disabled ({type(e).__name__}: {e})", file=sys.stderr, flush=True)
        return None


def _wandb_credentials_configured() -> bool:
    """An API key in the environment or in .netrc, where ``wandb login`` stores it."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    host = urllib.parse.urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False
