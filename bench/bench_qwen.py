"""Benchmark a megatron_ext Qwen run: tokens/s, MFU and peak memory, optionally beside transformers peers.

    python bench/bench_qwen.py --model tiny --seq-length 256 --micro-batch-size 2 --global-batch-size 8 \
        --baseline hf --bench-out bench/results/cpu_tiny.json
    python bench/bench_qwen.py --model qwen3-30b-a3b --num-layers 2 --bf16 --seq-length 4096 \
        --micro-batch-size 1 --global-batch-size 8 --baseline hf liger
    torchrun --nproc-per-node 8 bench/bench_qwen.py --model qwen2.5-1.5b --bf16 --seq-length 4096 \
        --tensor-model-parallel-size 2 --global-batch-size 64

Takes every finetune_qwen.py flag (any mesh under torchrun) plus the benchmark's own, and runs finetune_qwen.main in
this process, so what is measured is exactly the training job. Data is synthetic (--mock-data) unless --data-path is
given. ``--baseline hf liger`` then trains each peer (bench/peers.py: the family's transformers class, SDPA, torch
AdamW; PEFT LoRA when ours has LoRA; the same with Liger kernels) of the same shape, dtype, batch and sequence
length on the same device, each a row with its ratio and numerics; a peer that cannot run here is a row saying why.
The first --warmup-steps steps of each run (allocator, kernel selection) are left out of the averages.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import platform
import shlex
import sys
from types import SimpleNamespace
from typing import Callable, List, Optional, Sequence

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import finetune_qwen  # noqa: E402  (needs REPO on the path)
from megatron_ext import arguments  # noqa: E402
from megatron_ext.cli import run_main  # noqa: E402
from megatron_ext.errors import ConfigError  # noqa: E402
from bench.peers import PEERS, our_numerics, run_qwen_peer  # noqa: E402

GIB = 2 ** 30


def add_bench_flags(parser: argparse.ArgumentParser, steps: int = 20, baseline: str = "none",
                    peer: str = "transformers' Qwen2ForCausalLM (SDPA, AdamW)",
                    peers: Sequence[str] = ("hf",)) -> argparse.ArgumentParser:
    g = parser.add_argument_group("benchmark")
    g.add_argument("--bench-steps", type=int, default=steps, help="optimizer steps per run (sets --train-iters)")
    g.add_argument("--warmup-steps", type=int, default=3, help="first steps left out of the averages")
    g.add_argument("--baseline", nargs="+", default=[baseline], choices=["none", *peers],
                   help=f"hf: also train {peer} here" + (", liger: the same with Liger kernels" if "liger" in peers
                                                         else "") + "; one process only")
    g.add_argument("--bench-out", default=None, help="write the results as JSON to this path (rank 0)")
    g.add_argument("--sdpa-backend", default="torch", choices=["torch", "cudnn"],
                   help="cudnn: our attention asks torch's SDPA for cuDNN's kernel first (torch's own order, kept by "
                        "the baseline, tries flash first); an experiment for Hopper GPUs, a default once measured")
    return parser


@contextlib.contextmanager
def sdpa_backend(name: str):
    """torch's SDPA kernel order for what runs inside (``--sdpa-backend``); every backend stays allowed."""
    if name == "torch":
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    with sdpa_kernel(order, set_priority=True):
        yield


def _given(flag: str, argv: Sequence[str]) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def parse_bench_argv(argv: Sequence[str], entry_parser: argparse.ArgumentParser, **defaults):
    """The benchmark's own flags (``add_bench_flags(**defaults)``) and the rest, for the entry script. The checks
    every benchmark shares run here, before any process group, so a bad combination is one line on every rank."""
    add_bench_flags(entry_parser, **defaults).parse_args(argv)  # --help, unknown flags
    bench, rest = add_bench_flags(argparse.ArgumentParser(add_help=False, allow_abbrev=False),
                                  **defaults).parse_known_args(argv)
    for flag in ("--train-iters", "--exit-interval"):
        if _given(flag, rest):
            raise ConfigError(f"{flag} would change the number of steps the benchmark runs; use --bench-steps")
    if bench.warmup_steps < 0 or bench.bench_steps <= bench.warmup_steps:
        raise ConfigError(f"--bench-steps {bench.bench_steps} must exceed --warmup-steps {bench.warmup_steps} "
                          "(which must be >= 0), or nothing is measured")
    if "none" in bench.baseline and len(bench.baseline) > 1:
        raise ConfigError(f"--baseline {' '.join(bench.baseline)}: none or peers, not both")
    bench.baseline = [p for p in PEERS if p in bench.baseline]  # the order they run in; none: []
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if bench.baseline and world != 1:
        raise ConfigError(f"--baseline {' '.join(bench.baseline)} runs transformers on one device, but WORLD_SIZE "
                          f"is {world}; launch one process or use --baseline none")
    return bench, rest


def split_argv(argv: Sequence[str]):
    """The benchmark's own flags, and the finetune_qwen.py command line they imply."""
    bench, rest = parse_bench_argv(argv, arguments.build_parser(__doc__.splitlines()[0]), peers=PEERS,
                                   peer="transformers' model of the family (SDPA, AdamW; PEFT LoRA with --lora-rank)")
    forward = [*rest, "--train-iters", str(bench.bench_steps)]
    if not _given("--data-path", rest) and not _given("--mock-data", rest):
        forward.append("--mock-data")
    return bench, forward


def result_row(step_times: List[float], losses: List[Optional[float]], mem_peak: Optional[int], *, warmup: int,
               tokens_per_step: int, devices: int, flops_per_token: float, peak: Optional[float]) -> dict:
    """Throughput from the mean step time after warm-up (total tokens over total time, not a mean of rates)."""
    from megatron_ext.observability import flops

    measured = step_times[warmup:]
    step_time = sum(measured) / len(measured)
    tokens_per_sec = tokens_per_step / step_time
    return dict(tokens_per_sec=tokens_per_sec, mfu=flops.mfu(tokens_per_sec / devices, flops_per_token, peak),
                step_time=step_time, mem_peak_gib=None if mem_peak is None else mem_peak / GIB,
                measured_steps=len(measured), first_loss=losses[0], final_loss=losses[-1])


PARTS = ("data", "forward", "backward", "pipeline_comm", "grad_reduce", "optimizer", "other")  # metrics.jsonl's


def gather_megatron(records: List[dict]):
    """Step times and losses of the rank that logs (last pipeline stage), peak memory of the fullest rank, and that
    rank's step-time split per step (``PARTS``, seconds: CUDA events on a GPU)."""
    import torch.distributed as dist

    from megatron_ext.training.loop import is_logging_rank

    split = [{part: r.get(f"{part}_time") or 0.0 for part in PARTS} for r in records]
    mine = (is_logging_rank(), [r["step_time"] for r in records], [r["loss"] for r in records],
            max(r["mem_peak"] for r in records), split)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    _, step_times, losses, _, split = next(entry for entry in everyone if entry[0])
    return step_times, losses, max(entry[3] for entry in everyone), split


def split_ms(split: List[dict], warmup: int) -> dict:
    """The mean milliseconds per part over the measured steps (what the step time's mean is taken over)."""
    measured = split[warmup:]
    return {part: round(1e3 * sum(s[part] for s in measured) / len(measured), 2) for part in PARTS}


def device_name(device) -> str:
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    return f"cpu: {model}, {torch.get_num_threads()} torch threads"


def format_table(results: dict, ratios: dict) -> str:
    """Rows with a parameter count get a parameters column (and a trainable one with LoRA); a skipped peer's row
    says why; the ratio to each peer and each side's numerics follow."""
    params = any("parameters" in row for row in results.values())
    lora = any(row.get("trainable", row.get("parameters")) != row.get("parameters") for row in results.values())
    header = f"{'':<20}{'tokens/s':>14}{'MFU':>8}{'step time':>12}{'peak memory':>14}"
    header += (f"{'parameters':>14}" if params else "") + (f"{'trainable':>14}" if lora else "")
    lines = [header, "-" * len(header)]
    for name, row in results.items():
        if "skipped" in row:
            lines.append(f"{name:<20}skipped: {row['skipped']}")
            continue
        mfu = "n/a" if row["mfu"] is None else f"{row['mfu']:.1%}"
        mem = "n/a" if row["mem_peak_gib"] is None else f"{row['mem_peak_gib']:.2f} GiB"
        count, trained = ("n/a" if row.get(k) is None else f"{row[k]:,}" for k in ("parameters", "trainable"))
        lines.append(f"{name:<20}{row['tokens_per_sec']:>14,.0f}{mfu:>8}{row['step_time']:>10.3f} s{mem:>14}"
                     + (f"{count:>14}" if params else "") + (f"{trained:>14}" if lora else ""))
    lines += [f"megatron_ext / {side} tokens/s: {ratio:.2f}x" for side, ratio in ratios.items()]
    lines += [f"numerics, {side}: {row['numerics']}" for side, row in results.items() if row.get("numerics")]
    return "\n".join(lines)


def run_benchmark(bench, forward: List[str], *, family: str, entry: Callable, peer: Callable,
                  model: Optional[Callable] = None, parameters: Optional[Callable] = None,
                  extra: Optional[dict] = None) -> None:
    """What every token benchmark does: ours is ``entry(forward)`` (the training job itself, any mesh), then each
    --baseline peer ``peer(run, device, steps, kind)`` on the same device (its side's name and bench/peers.py
    ``train_peer``'s result, or ``skipped`` with the reason); on rank 0 the table and the JSON bench/table.py
    collects. ``parameters(run)`` counts ours, ``model(args)`` names the run in the JSON, ``extra`` adds fields."""
    run = arguments.parse(forward, family=family)
    args, shape, mesh = SimpleNamespace(**run.flags()), run.shape, run.mesh

    with sdpa_backend(bench.sdpa_backend):
        records = entry(forward)

    import megatron.core
    import torch
    import torch.distributed as dist
    import transformers

    from megatron_ext import parallel
    from megatron_ext.observability import flops
    from megatron_ext.models.spec import params_dtype

    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    dtype = params_dtype(run)
    tokens_per_step = args.global_batch_size * args.seq_length
    flops_per_token = flops.training_flops_per_token(shape, args.seq_length)
    peak = flops.peak_flops(device, dtype, args.peak_tflops)
    common = dict(warmup=bench.warmup_steps, tokens_per_step=tokens_per_step, flops_per_token=flops_per_token,
                  peak=peak)

    step_times, losses, mem_peak, split = gather_megatron(records)
    results = {"megatron_ext": result_row(step_times, losses, mem_peak, devices=mesh.world, **common)}
    results["megatron_ext"]["split_ms"] = split_ms(split, bench.warmup_steps)
    if parameters is not None:
        results["megatron_ext"]["parameters"] = parameters(run)
    results["megatron_ext"]["numerics"] = our_numerics(run, dtype)
    ratios = {}
    for kind in bench.baseline:  # each peer its side: step times, losses, peak, counts, numerics; or why not
        out = peer(run, device, bench.bench_steps, kind)
        side = out.pop("side")
        if "skipped" in out:
            results[side] = dict(skipped=out["skipped"])
            continue
        results[side] = dict(result_row(out.pop("step_times"), out.pop("losses"), out.pop("mem_peak"), devices=1,
                                        **common), **out)
        ratios[side] = results["megatron_ext"]["tokens_per_sec"] / results[side]["tokens_per_sec"]
    ratio = ratios.get("transformers", ratios.get("peft"))  # ours against the plain peer, as before peers were many

    if dist.get_rank() == 0:
        print(format_table(results, ratios), flush=True)
        if bench.bench_out:
            report = dict(
                **(extra or {}), device=device_name(device), dtype=str(dtype).replace("torch.", ""),
                model=model(args) if model else args.hf_config or args.model, shape=dataclasses.asdict(shape),
                mesh=dict(dataclasses.asdict(mesh), dp=mesh.dp, describe=mesh.describe()),
                data="mock" if args.mock_data else args.data_path,
                pack_sequences=getattr(args, "pack_sequences", False),
                seq_length=args.seq_length, global_batch_size=args.global_batch_size,
                micro_batch_size=args.micro_batch_size, num_microbatches=run.num_microbatches,
                tokens_per_step=tokens_per_step, recompute_granularity=args.recompute_granularity,
                engine=args.engine if args.engine == "megatron" else f"deepspeed zero-{args.zero_stage}",
                gradient_accumulation_fusion=args.gradient_accumulation_fusion and args.engine == "megatron",
                cross_entropy_loss_fusion=args.cross_entropy_loss_fusion, sdpa_backend=bench.sdpa_backend,
                bench_steps=bench.bench_steps, warmup_steps=bench.warmup_steps, flops_per_token=flops_per_token,
                peak_tflops_per_device=None if peak is None else peak / 1e12, results=results,
                baseline=bench.baseline, ratio_tokens_per_sec=ratio, ratios=ratios,
                command=shlex.join(sys.argv),
                versions=dict(python=platform.python_version(), torch=torch.__version__,
                              megatron_core=megatron.core.__version__, transformers=transformers.__version__))
            os.makedirs(os.path.dirname(os.path.abspath(bench.bench_out)), exist_ok=True)
            with open(bench.bench_out, "w") as f:
                json.dump(report, f, indent=2)
                f.write("\n")
            print(f"results: {bench.bench_out}", flush=True)
    parallel.teardown()


def main(argv: Optional[Sequence[str]] = None) -> None:
    bench, forward = split_argv(sys.argv[1:] if argv is None else argv)
    run_benchmark(bench, forward, family="qwen", entry=finetune_qwen.main, peer=run_qwen_peer)


if __name__ == "__main__":
    run_main(main)
