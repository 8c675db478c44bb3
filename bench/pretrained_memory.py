"""Peak host memory per rank of --pretrained (loading published weights into the shards) and --save-hf (exporting
them), on 1 rank, TP2 and ZeRO-3 DP2, for a Qwen2.5-1.5B-shaped checkpoint of random bf16 weights written locally.

    python bench/pretrained_memory.py --model qwen2.5-1.5b --workdir /tmp/pretrained_memory \
        --out bench/results/pretrained_memory_cpu.json

Each layout runs in fresh ranks (torchrun), each rank on the real code path: ``arguments.parse`` and
``training/run.py``'s model build (the mesh's chunks, or ZeRO-3's partitioned construction) with the weights
streamed in, then ``convert/export.save_hf``. A rank records its resident memory after start-up (imports, process
groups) and its peak (VmHWM) during the load and during the export, the peak reset in between
(``/proc/self/clear_refs``). "load" and "export" are those peaks minus the start-up figure: what the weights cost.
glibc's mmap threshold is fixed (``MALLOC_MMAP_THRESHOLD_``) so freed tensors return to the system: with its default
dynamic threshold, freed 10-30 MB buffers stay in the heap, and resident memory, run to run, varies by a model copy.
The issue's target: at 2 ranks, each rank's load and export at most ``TARGET`` x the 1-rank figure.
"""

import argparse
import json
import os
import subprocess
from types import SimpleNamespace
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
GIB = 2 ** 30
TARGET = 0.6  # per rank at 2 ranks, x the 1-rank figure
LAYOUTS = {"1 rank": (1, []), "TP2": (2, ["--tensor-model-parallel-size", "2"]),
           "ZeRO-3 DP2": (2, ["--engine", "deepspeed", "--zero-stage", "3"])}


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def worker(hf_dir: str, out_dir: str, result: str, flags) -> None:
    """One rank: start-up, load, export; writes its figures to ``result``.RANK.json."""
    import time
    import types

    import torch
    import torch.distributed as dist

    from megatron_ext import arguments, parallel
    from megatron_ext.convert import export
    from megatron_ext.models.qwen import model as qwen
    from megatron_ext.training import run as run_module

    run = arguments.parse(["--pretrained", hf_dir, "--bf16", "--mock-data", "--seq-length", "128", *flags])
    run_module.start(run)
    args, shape = SimpleNamespace(**run.flags()), run.shape
    config = qwen.transformer_config(shape, run.mesh, params_dtype=run_module.params_dtype(run))
    vocab = qwen.padded_vocab_size(shape.vocab_size, args.make_vocab_size_divisible_by, run.mesh.tp)
    meta = dict(model_shape=__import__("dataclasses").asdict(shape), model_type="qwen2",
                hf_config=json.load(open(os.path.join(hf_dir, "config.json"))))
    dist.barrier()
    base = _status("VmRSS")
    _reset_peak()
    start = time.perf_counter()
    chunks, _ = run_module._build_chunks(run, lambda **kw: qwen.build_qwen(config, shape, vocab_size=vocab, **kw),
                                         meta, ())
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    load_peak = _status("VmHWM")
    gpu_peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
    dist.barrier()
    _reset_peak()
    if args.engine == "deepspeed":  # what save_hf reads of a DeepSpeed engine: the chunk, and the stage
        engine = types.SimpleNamespace(megatron_chunk=chunks[0], model=chunks,
                                       engine=types.SimpleNamespace(zero_optimization_stage=lambda: 3))
    else:
        engine = types.SimpleNamespace(model=chunks)
    export.save_hf(engine, out_dir, model_meta=meta, dtype=export.export_dtype(run))
    export_peak = _status("VmHWM")
    with open(f"{result}.{dist.get_rank()}.json", "w") as f:
        json.dump(dict(rank=dist.get_rank(), startup=base, load_peak=load_peak, export_peak=export_peak,
                       load_seconds=seconds, gpu_peak=gpu_peak), f)
    parallel.teardown()


def _device() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-1.5b")
    p.add_argument("--workdir", default="/tmp/pretrained_memory")
    p.add_argument("--out", default=None)
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS),
                   help="on one GPU: '1 rank' (the others need 2 devices)")
    p.add_argument("--worker", nargs=3, default=None, help=argparse.SUPPRESS)
    args, rest = p.parse_known_args()
    if args.worker:
        return worker(*args.worker, rest)
    hf = os.path.join(args.workdir, "hf")
    os.makedirs(args.workdir, exist_ok=True)
    if not os.path.isfile(os.path.join(hf, "config.json")):
        build = ("import sys; sys.path.insert(0, %r); from bench.convert_memory import make_model; "
                 "from megatron_ext.models.qwen.shape import PRESETS; print(make_model(PRESETS[%r], %r))"
                 % (REPO, args.model, hf))
        subprocess.run([sys.executable, "-c", build], check=True, capture_output=True, text=True)
    weights = json.load(open(os.path.join(hf, "model.safetensors.index.json")))["metadata"]["total_size"]
    rows = {}
    for name in args.layouts:
        ranks, flags = LAYOUTS[name]
        result = os.path.join(args.workdir, name.replace(" ", "_"))
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}", "--master-port=29533",
               os.path.abspath(__file__), "--worker", hf, os.path.join(args.workdir, "export"), result, *flags]
        subprocess.run(cmd, cwd=REPO, check=True, env=dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1",
                                                        MALLOC_MMAP_THRESHOLD_="65536"))
        per_rank = [json.load(open(f"{result}.{r}.json")) for r in range(ranks)]
        rows[name] = dict(ranks=ranks, per_rank=per_rank,
                          load=max(r["load_peak"] - r["startup"] for r in per_rank),
                          export=max(r["export_peak"] - r["startup"] for r in per_rank),
                          load_seconds=max(r["load_seconds"] for r in per_rank),
                          gpu_peak=max(r["gpu_peak"] or 0 for r in per_rank) or None)
    one = rows.get("1 rank") or next(iter(rows.values()))
    print(f"\n{args.model}: bf16 weights {weights / GIB:.2f} GiB; peak host memory per rank above start-up (GiB)")
    print(f"{'layout':<12}{'ranks':>6}{'load':>8}{'x 1 rank':>10}{'export':>9}{'x 1 rank':>10}{'load s':>8}"
          f"{'GPU peak':>10}")
    for name, row in rows.items():
        gpu = f"{row['gpu_peak'] / GIB:.2f}" if row["gpu_peak"] else "-"
        print(f"{name:<12}{row['ranks']:>6}{row['load'] / GIB:>8.2f}{row['load'] / one['load']:>10.2f}"
              f"{row['export'] / GIB:>9.2f}{row['export'] / one['export']:>10.2f}{row['load_seconds']:>8.1f}{gpu:>10}")
    verdict = {}
    for name, row in rows.items():
        if row["ranks"] == 2 and "1 rank" in rows:
            row["x_1_rank"] = {k: row[k] / one[k] for k in ("load", "export")}
            verdict[name] = all(v <= TARGET for v in row["x_1_rank"].values())
            print(f"{name}: load and export <= {TARGET}x the 1-rank figure: {'holds' if verdict[name] else 'FAILS'}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(model=args.model, device=_device(), weights_bytes=weights, target_x_1_rank=TARGET,
                           target_holds=verdict, layouts=rows), f, indent=2)


if __name__ == "__main__":
    main()
