"""Benchmark a megatron_ext ViT run beside transformers' ViTForImageClassification: images/s, MFU, peak memory.

    python bench/bench_vit.py --model tiny --num-classes 10 --micro-batch-size 8 --bench-steps 8 --warmup-steps 2 \
        --bench-out bench/results/cpu_vit_tiny.json
    python bench/bench_vit.py --model vit-huge-14 --bf16 --micro-batch-size 64 \
        --bench-out bench/results/h100_vit-huge-14.json

Ours is pretrain_vit.main in this process (the real engine, any pretrain_vit.py flag, synthetic --mock-data
images, 1000 classes unless --num-classes), so what is measured is the training job. ``--baseline hf`` (the
default) then trains transformers' ViTForImageClassification of the same shape, classes, dtype and batches on the
same device: SDPA attention, torch AdamW (fused on CUDA, as ../shared/notes/gpu-facts.md's peer anchors) with the
run's settings, gradient checkpointing when --recompute-granularity full. Parameters stay in the run's dtype there,
while the megatron engine keeps fp32 master weights, as in bench_qwen.py. The first --warmup-steps steps are left
out of the averages. ``--profile-ops N``: torch.profiler over one step of each side, the last warm-up step (past
the first, so no one-time work; left out of the averages, so the profiler's overhead is too) or, with fewer than two,
the first measured one; the top N operators by self time (device time on a GPU, CPU time on CPU) go into the JSON's
rows (``profile_ops``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import platform
import shlex
import sys
from types import SimpleNamespace
from typing import Optional, Sequence

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import pretrain_vit  # noqa: E402  (needs REPO on the path)
from bench.bench_qwen import (_given, device_name, gather_megatron, parse_bench_argv, sdpa_backend,  # noqa: E402
                              result_row, split_ms)
from bench.peers import our_numerics, train_peer  # noqa: E402
from megatron_ext import arguments  # noqa: E402
from megatron_ext.cli import run_main  # noqa: E402
from megatron_ext.errors import ConfigError  # noqa: E402

ATTENTION = "sdpa"  # both sides: torch scaled_dot_product_attention
NUM_CLASSES = 1000  # without --num-classes: the ImageNet-1k head of the published classifiers and the peer anchors


def split_argv(argv: Sequence[str]):
    """The benchmark's flags and the pretrain_vit.py command line they imply; every refusal is one line, before
    any process group."""
    profile = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    profile.add_argument("--profile-ops", type=int, default=0, metavar="N",
                         help="torch.profiler over one step of each side: its top N operators in the JSON")
    profiling, argv = profile.parse_known_args(argv)
    if profiling.profile_ops < 0:
        raise ConfigError(f"--profile-ops {profiling.profile_ops}: the number of operators to list, >= 0")
    parser = arguments.build_parser(__doc__.splitlines()[0], family="vit")
    parser._add_action(profile._actions[0])  # (listed in --help)
    bench, rest = parse_bench_argv(argv, parser, steps=12, baseline="hf",
                                   peer="transformers' ViTForImageClassification")
    bench.profile_ops = profiling.profile_ops
    if _given("--data-path", rest):
        raise ConfigError("--data-path: bench_vit.py times the model on synthetic images (--mock-data); an image "
                          "loader's speed is a separate question")
    forward = [*rest, "--train-iters", str(bench.bench_steps)]
    if not _given("--mock-data", rest):
        forward.append("--mock-data")
    if not _given("--num-classes", rest):  # both sides need the number; pretrain_vit's own default is the data's
        forward += ["--num-classes", str(NUM_CLASSES)]
    return bench, forward


def image_row(row: dict, parameters: Optional[int]) -> dict:
    """bench_qwen's row, counted in images (its "tokens" here are images), plus the model's parameter count."""
    return dict(images_per_sec=row.pop("tokens_per_sec"), **row, parameters=parameters)


def megatron_parameters(run: arguments.RunConfig) -> Optional[int]:
    """Parameters of ours with the run's shape, built on the meta device (no memory). Without TP/PP every rank holds
    the whole model; a sharded mesh reports None."""
    import torch

    from megatron_ext.models.vit import model as vit

    if run.mesh.tp * run.mesh.pp != 1:
        return None
    config = vit.transformer_config(run.shape, run.mesh, initialize=False)
    with torch.device("meta"):
        return sum(p.numel() for p in vit.ViTClassifier(config, run.shape, run.model.num_classes).parameters())


def run_transformers(run: arguments.RunConfig, device, steps: int, tick=None):
    """ViTForImageClassification trained on the batches --mock-data fed ours (``peers.train_peer``): its step
    times, losses, peak memory, parameter counts and numerics. ``tick``: called as each step after the first starts."""
    import torch.nn.functional as F
    from transformers import ViTConfig, ViTForImageClassification

    from megatron_ext.data.sources import MockImages
    from megatron_ext.models.vit import model as vit
    from megatron_ext.models.spec import params_dtype

    args, shape, dtype = SimpleNamespace(**run.flags()), run.shape, params_dtype(run)
    config = ViTConfig(
        hidden_size=shape.hidden_size, num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_attention_heads, intermediate_size=shape.ffn_hidden_size, hidden_act="gelu",
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, layer_norm_eps=shape.layer_norm_eps,
        image_size=shape.image_size, patch_size=shape.patch_size, num_channels=shape.num_channels, qkv_bias=True,
        num_labels=args.num_classes, attn_implementation=ATTENTION)
    data = MockImages(image_size=shape.image_size, num_classes=args.num_classes, channels=shape.num_channels,
                      global_batch_size=args.global_batch_size, micro_batch_size=args.micro_batch_size,
                      dp_rank=0, dp_size=1, seed=args.seed)

    def micro_loss(model, micro):  # uint8 images normalised on the device, as ours (vit.forward_step)
        pixels = vit.device_pixels(micro["pixels"].to(device, non_blocking=True), shape.image_size,
                                   *vit.HF_MEAN_STD)
        logits = model(pixel_values=pixels.to(dtype)).logits
        return F.cross_entropy(logits.float(), micro["labels"].to(device, non_blocking=True),
                               label_smoothing=args.label_smoothing)

    def batches(step):
        if tick and step > 1:  # the previous step has ended
            tick()
        return data.train_microbatches()

    return train_peer(run, device, steps, ViTForImageClassification, config, batches, micro_loss)


@contextlib.contextmanager
def profiled_step(step: int, top_n: int, out: dict):
    """Profile optimizer step ``step`` (1-based) of what runs inside; ``tick()`` marks each step's start. The top
    ``top_n`` operators by self time land in ``out["profile_ops"]`` (ms in that step)."""
    import torch
    from torch.profiler import ProfilerActivity, profile, schedule

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    prof = profile(activities=activities, schedule=schedule(wait=step - 1, warmup=0, active=1, repeat=1))
    with prof:
        yield prof.step
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    events = sorted((e for e in prof.key_averages() if not e.key.startswith("ProfilerStep")),
                    key=lambda e: -getattr(e, key))[:top_n]
    out["profile_ops"] = dict(step=step, time="device" if cuda else "cpu", ops=[
        dict(op=e.key, count=e.count, self_ms=round(getattr(e, key) / 1000.0, 4)) for e in events])


@contextlib.contextmanager
def ticking_engine(tick):
    """Our engine's optimizer steps call ``tick`` after each (``training.run.build_engine`` wrapped)."""
    from megatron_ext.training import run as training_run

    build = training_run.build_engine

    def build_ticking(*args, **kwargs):
        engine = build(*args, **kwargs)
        step = engine.optimizer_step
        engine.optimizer_step = lambda *a, **k: (step(*a, **k), tick())[0]
        return engine

    training_run.build_engine = build_ticking
    try:
        yield
    finally:
        training_run.build_engine = build


def format_table(rows: dict, ratio: Optional[float]) -> str:
    header = f"{'':<14}{'images/s':>12}{'MFU':>8}{'step time':>12}{'peak memory':>14}{'parameters':>14}"
    lines = [header, "-" * len(header)]
    for name, row in rows.items():
        mfu = "n/a" if row["mfu"] is None else f"{row['mfu']:.1%}"
        mem = "n/a" if row["mem_peak_gib"] is None else f"{row['mem_peak_gib']:.2f} GiB"
        params = "n/a" if row["parameters"] is None else f"{row['parameters']:,}"
        lines.append(f"{name:<14}{row['images_per_sec']:>12,.1f}{mfu:>8}{row['step_time']:>10.3f} s{mem:>14}"
                     f"{params:>14}")
    if ratio is not None:
        lines.append(f"megatron_ext / transformers images/s: {ratio:.2f}x")
    lines += [f"numerics, {side}: {row['numerics']}" for side, row in rows.items() if row.get("numerics")]
    return "\n".join(lines)


def write_json(path: str, report: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
        f.write("\n")
    print(f"results: {path}", flush=True)


def main(argv: Optional[Sequence[str]] = None) -> None:
    bench, forward = split_argv(sys.argv[1:] if argv is None else argv)
    ops: dict = dict(megatron_ext={}, transformers={})
    step = bench.warmup_steps if bench.warmup_steps >= 2 else bench.warmup_steps + 1
    profiled = functools.partial(profiled_step, step, bench.profile_ops) if bench.profile_ops else None
    run = arguments.parse(forward, family="vit")
    args, shape, mesh = SimpleNamespace(**run.flags()), run.shape, run.mesh
    if bench.baseline and run.lora is not None:
        raise ConfigError("--baseline hf trains every weight, unlike --lora-rank; use --baseline none with LoRA")

    with sdpa_backend(bench.sdpa_backend), \
            (profiled(ops["megatron_ext"]) if profiled else contextlib.nullcontext(None)) as tick, \
            (ticking_engine(tick) if tick else contextlib.nullcontext()):
        records = pretrain_vit.main(forward)

    import megatron.core
    import torch
    import torch.distributed as dist
    import transformers

    from megatron_ext import parallel
    from megatron_ext.observability import flops
    from megatron_ext.models.spec import params_dtype

    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    dtype = params_dtype(run)
    flops_per_image = flops.vit_training_flops_per_image(shape, args.num_classes)
    peak = flops.peak_flops(device, dtype, args.peak_tflops)
    common = dict(warmup=bench.warmup_steps, tokens_per_step=args.global_batch_size, flops_per_token=flops_per_image,
                  peak=peak)

    step_times, losses, mem_peak, split = gather_megatron(records)
    rows = {"megatron_ext": image_row(result_row(step_times, losses, mem_peak, devices=mesh.world, **common),
                                      megatron_parameters(run))}
    rows["megatron_ext"].update(split_ms=split_ms(split, bench.warmup_steps), numerics=our_numerics(run, dtype))
    if bench.baseline:
        with profiled(ops["transformers"]) if profiled else contextlib.nullcontext(None) as tick:
            out = run_transformers(run, device, bench.bench_steps, tick)
        rows["transformers"] = dict(image_row(result_row(out["step_times"], out["losses"], out["mem_peak"], devices=1,
                                                         **common), out["parameters"]), numerics=out["numerics"])
    for name, row in rows.items():
        row.update(ops[name])
    ratio = (rows["megatron_ext"]["images_per_sec"] / rows["transformers"]["images_per_sec"]
             if "transformers" in rows else None)

    if dist.get_rank() == 0:
        print(format_table(rows, ratio), flush=True)
        if bench.bench_out:  # "rows", not "results": bench/table.py collects bench_qwen.py's JSON only
            write_json(bench.bench_out, dict(
                benchmark="bench_vit", device=device_name(device), dtype=str(dtype).replace("torch.", ""),
                model=args.hf_config or args.model, shape=dict(dataclasses.asdict(shape), seq_length=shape.seq_length),
                num_classes=args.num_classes, attention=ATTENTION, data="mock",
                mesh=dict(dataclasses.asdict(mesh), dp=mesh.dp, describe=mesh.describe()),
                engine=args.engine if args.engine == "megatron" else f"deepspeed zero-{args.zero_stage}",
                micro_batch_size=args.micro_batch_size, global_batch_size=args.global_batch_size,
                num_microbatches=run.num_microbatches, images_per_step=args.global_batch_size,
                recompute_granularity=args.recompute_granularity, sdpa_backend=bench.sdpa_backend,
                bench_steps=bench.bench_steps,
                warmup_steps=bench.warmup_steps, flops_per_image=flops_per_image,
                peak_tflops_per_device=None if peak is None else peak / 1e12, rows=rows, ratio_images_per_sec=ratio,
                command=shlex.join(sys.argv),
                versions=dict(python=platform.python_version(), torch=torch.__version__,
                              megatron_core=megatron.core.__version__, transformers=transformers.__version__)))
    parallel.teardown()


if __name__ == "__main__":
    run_main(main)
