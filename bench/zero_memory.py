"""Per-rank model-state memory of ZeRO stages 1/2/3 (``--engine deepspeed``), measured against the ZeRO paper's
formula for mixed-precision Adam: 2Ψ bytes of 16-bit weights + 2Ψ of 16-bit gradients + 12Ψ of fp32 master
weights, momentum and variance, of which stage 1 partitions the 12Ψ over the N data-parallel ranks, stage 2 also
the gradients, stage 3 everything.

    .venv/bin/python bench/zero_memory.py --worlds 2 4 --stages 1 2 3 --out bench/results/zero_memory_cpu.json

Each (stage, world) is one torchrun launch of this script in worker mode: a bf16 Qwen2-architecture model, two
micro-batches of one sequence per rank per step (gradient accumulation, where stage 1 and 2 differ), two steps.
During the second step (Adam's moments exist) memory is counted at the two moments model states peak: after each
backward (full 16-bit gradients exist under stage 1) and when the wrapped torch optimizer is about to step (the fp32
gradient partition exists). Every live tensor storage is counted once and attributed to

- weights: the model's 16-bit parameters (stage 3: this rank's partition, ``ds_tensor``);
- grads16: their ``.grad``, and every other tensor of at least 1/8 of a partition's bytes (DeepSpeed's flat
  16-bit gradient partitions and reduce buckets);
- grads32: ``.grad`` of the fp32 master partitions, which DeepSpeed fills just before the step (not in the formula);
- optimizer: the fp32 master partitions and Adam's two moments.

Bucket sizes are set to Ψ/N elements and stage 3 persists no parameter whole, so what is measured is the
partitioning itself, not DeepSpeed's fixed 5e8-element buffers (which would dwarf a model this small).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

# A Qwen2-shaped model large enough that model states dominate everything else in the process (~26M parameters).
SHAPE = dict(hidden_size=512, ffn_hidden_size=1408, num_layers=8, num_attention_heads=8, num_query_groups=2,
             vocab_size=8192, max_position_embeddings=2048, rope_theta=1e6, rms_norm_eps=1e-6,
             tie_word_embeddings=True)
SEQ = 16  # activations are not model states; bf16 matmuls are slow on CPU (~0.7 GFLOP/s in backward)


def formula(stage: int, psi: int, n: int) -> dict:
    """Bytes per rank predicted for weights, gradients and optimizer states."""
    return {"weights": 2 * psi / (n if stage >= 3 else 1), "gradients": 2 * psi / (n if stage >= 2 else 1),
            "optimizer": 12 * psi / n}


def live_tensor_bytes(model, masters, optimizer_state, partition_numel: int) -> dict:
    """Every live tensor storage once, attributed as in the module docstring. ``masters``: ZeRO's fp32 partitions."""
    import torch

    def key(t):
        return t.untyped_storage().data_ptr()

    moments = [v for p in masters for v in optimizer_state.get(p, {}).values() if torch.is_tensor(v) and v.numel() > 1]
    grads16 = [p.grad for p in model.parameters() if p.grad is not None]  # often reachable only through .grad
    grads32 = [p.grad for p in masters if p.grad is not None]
    grads = grads16 + grads32
    weights = {key(getattr(p, "ds_tensor", p)) for p in model.parameters()}
    optimizer = {key(t) for t in masters + moments}
    grad16_keys, grad32_keys = {key(g) for g in grads16}, {key(g) for g in grads32}
    seen, totals = set(), {"weights": 0, "grads16": 0, "grads32": 0, "optimizer": 0, "buffers": 0, "other": 0}
    for obj in [*gc.get_objects(), *grads, *moments]:
        try:
            if not torch.is_tensor(obj) or obj.device.type == "meta":
                continue
            storage = obj.untyped_storage()
        except Exception:  # half-built objects, tensor subclasses without storage
            continue
        k = storage.data_ptr()
        if k == 0 or k in seen:
            continue
        seen.add(k)
        nbytes = storage.nbytes()
        if k in weights:
            totals["weights"] += nbytes
        elif k in optimizer:
            totals["optimizer"] += nbytes
        elif k in grad16_keys:
            totals["grads16"] += nbytes
        elif k in grad32_keys:
            totals["grads32"] += nbytes
        elif nbytes >= 2 * partition_numel // 8:
            totals["buffers"] += nbytes
        else:
            totals["other"] += nbytes
    return totals


def worker(stage: int, out_dir: str) -> None:
    import dataclasses

    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_ext import arguments, parallel
    from megatron_ext.data.sources import MockData
    from megatron_ext.engines.megatron import build_model_chunks
    from megatron_ext.models.qwen import model as qwen
    from megatron_ext.models.qwen.shape import ModelShape
    from megatron_ext.objectives.sft import forward_step
    from megatron_ext.training.run import build_engine

    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    shape = ModelShape(**SHAPE)
    run = arguments.parse(["--model", "tiny", "--bf16", "--engine", "deepspeed", "--zero-stage", str(stage),
                           "--seq-length", str(SEQ), "--micro-batch-size", "1", "--global-batch-size", str(2 * world),
                           "--mock-data"], world_size=world)
    device = parallel.init_distributed("gloo")
    parallel.init_model_parallel(run.mesh, 1234)
    config = qwen.transformer_config(shape, run.mesh, params_dtype=torch.bfloat16)
    vocab = qwen.padded_vocab_size(shape.vocab_size, 128, 1)
    chunks = build_model_chunks(lambda **s: qwen.build_qwen(config, shape, vocab_size=vocab, **s), None)
    psi = sum(p.numel() for p in chunks[0].parameters())
    bucket = psi // world
    run.engine.deepspeed_config = os.path.join(out_dir, f"ds_stage{stage}_rank{rank}.json")
    with open(run.engine.deepspeed_config, "w") as f:
        json.dump({"zero_optimization": {"reduce_bucket_size": bucket, "allgather_bucket_size": bucket,
                                         "stage3_prefetch_bucket_size": bucket,
                                         "stage3_param_persistence_threshold": 0}}, f)
    engine = build_engine(chunks, device, forward_step, **run.engine_sections())
    inner = engine.optimizer.optimizer  # the torch AdamW inside DeepSpeed's ZeRO optimizer
    zero = engine.optimizer
    masters = zero.fp32_partitioned_groups_flat if stage == 3 else zero.single_partition_of_fp32_groups
    partition, samples, step = psi // world, {}, [0]

    def measure(moment):
        if step[0] == 2 and moment not in samples:  # the second step: Adam's moments exist since the first
            samples[moment] = live_tensor_bytes(engine.engine.module, masters, inner.state, partition)

    inner.register_step_pre_hook(lambda *_: measure("before_step"))
    original_backward = engine.engine.backward

    def backward(loss):
        result = original_backward(loss)
        measure("after_backward")
        return result

    engine.engine.backward = backward
    data = MockData(vocab_size=shape.vocab_size, seq_length=SEQ, global_batch_size=2 * world, micro_batch_size=1,
                    dp_rank=parallel_state.get_data_parallel_rank(), dp_size=world, seed=1)
    for step[0] in (1, 2):
        engine.forward_backward(data.train_microbatches())
        engine.optimizer_step()
    with open(os.path.join(out_dir, f"stage{stage}_world{world}_rank{dist.get_rank()}.json"), "w") as f:
        json.dump({"psi": psi, "samples": samples, "shape": dataclasses.asdict(shape)}, f)
    dist.barrier()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def mib(n: float) -> str:
    return f"{n / 2**20:8.1f}"


def measured_row(stage: int, world: int, worker_dir: str) -> dict:
    """The workers' samples of one stage and world size against the formula: the moment and rank with the most
    model-state bytes (16-bit gradients include DeepSpeed's flat gradient partitions and reduce buckets)."""
    ranks = [json.load(open(os.path.join(worker_dir, f"stage{stage}_world{world}_rank{r}.json"))) for r in range(world)]
    psi = ranks[0]["psi"]
    peaks = [dict(weights=s["weights"], grads16=s["grads16"] + s["buffers"], grads32=s["grads32"],
                  optimizer=s["optimizer"], other=s["other"])
             for r in ranks for s in r["samples"].values()]
    measured = max(peaks, key=lambda s: s["weights"] + s["grads16"] + s["grads32"] + s["optimizer"])
    predicted = formula(stage, psi, world)
    model_states = measured["weights"] + measured["grads16"] + measured["grads32"] + measured["optimizer"]
    return dict(stage=stage, ranks=world, psi=psi, measured=measured, predicted=predicted,
                measured_model_states=model_states, predicted_model_states=sum(predicted.values()),
                ratio=model_states / sum(predicted.values()))


def table(rows: list) -> list:
    lines = [f"Ψ = {rows[0]['psi']:,} parameters, bf16 weights, fp32 AdamW, 2 micro-batches per step; MiB per rank "
             "at its peak (largest rank)",
             f"{'stage':>5} {'ranks':>5} | {'weights':>8} {'grads16':>8} {'grads32':>8} {'optim':>8} {'total':>8} | "
             f"{'formula: w':>10} {'g':>8} {'o':>8} {'total':>8} | {'ratio':>5}"]
    for r in rows:
        m, p = r["measured"], r["predicted"]
        lines.append(f"{r['stage']:>5} {r['ranks']:>5} | {mib(m['weights'])} {mib(m['grads16'])} "
                     f"{mib(m['grads32'])} {mib(m['optimizer'])} {mib(r['measured_model_states'])} | "
                     f"{mib(p['weights']):>10} {mib(p['gradients'])} {mib(p['optimizer'])} "
                     f"{mib(r['predicted_model_states'])} | {r['ratio']:5.2f}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--out", default=None, help="write the table as JSON")
    parser.add_argument("--worker-stage", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--worker-dir", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker_stage is not None:
        return worker(args.worker_stage, args.worker_dir)

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for world in args.worlds:
            for stage in args.stages:
                cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world}",
                       f"--master-port={free_port()}",
                       os.path.abspath(__file__), "--worker-stage", str(stage), "--worker-dir", tmp]
                env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
                proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
                if proc.returncode:
                    sys.exit(f"stage {stage} on {world} ranks failed:\n{(proc.stdout + proc.stderr)[-4000:]}")
                rows.append(measured_row(stage, world, tmp))
    print("\n".join(table(rows)))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"shape": SHAPE, "seq_length": SEQ, "rows": rows}, f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
