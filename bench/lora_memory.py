"""Model-state memory of one rank, full fine-tuning beside LoRA, for a Qwen2.5-3B-shaped model (bf16 weights, fp32
gradient buffer, fp32 master weights and AdamW moments: megatron-core's mixed precision), and the checkpoint size.

    .venv/bin/python bench/lora_memory.py --out bench/results/lora_memory_cpu.json
    .venv/bin/python bench/lora_memory.py --layers 36          # the whole model in one go (a GPU host's RAM)

Each variant is built in this process on the training path (``arguments.parse``, ``build_model_chunks``,
``lora.apply``, ``training.run.build_engine``); the optimizer then takes one step on zero gradients (AdamW creates its
moments there; no forward pass is needed to count model states), and the engine saves a checkpoint. Counted: the
model's parameters (weights), the DDP gradient buffers (grads), the optimizer's fp32 master weights and moments
(optimizer), and the checkpoint directory's bytes on disk. On a 24 GB host full fine-tuning of all 36 layers does
not fit (~56 GB), so by default both variants are measured at 2 and 4 layers and each figure is extended linearly to
the 36 layers of Qwen2.5-3B (every layer is the same; the embedding is the difference's intercept).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
FULL_LAYERS = {"qwen2.5-3b": 36}
LORA = ["--lora-rank", "16", "--lora-alpha", "32", "--lora-targets", "qkv,proj,fc1,fc2"]
KEYS = ("weights", "grads", "optimizer", "checkpoint")


def measure(model: str, layers: int, lora: bool, workdir: str) -> dict:
    """Model-state bytes of one rank and its checkpoint's size, for ``layers`` layers with or without LoRA."""
    import dataclasses

    import torch

    from megatron_ext import arguments, checkpoint, parallel
    from megatron_ext.engines.megatron import build_model_chunks
    from megatron_ext.models import lora as lora_module
    from megatron_ext.models.qwen import model as qwen
    from megatron_ext.objectives.sft import forward_step
    from megatron_ext.training.run import build_engine

    run = arguments.parse(["--model", model, "--num-layers", str(layers), "--bf16", "--mock-data", "--seq-length",
                           "64", "--micro-batch-size", "1", "--global-batch-size", "1", *(LORA if lora else [])],
                          world_size=1)
    device = parallel.init_distributed("gloo")
    parallel.init_model_parallel(run.mesh, seed=1)
    try:
        shape = run.shape
        config = qwen.transformer_config(shape, run.mesh, params_dtype=torch.bfloat16)
        vocab = qwen.padded_vocab_size(shape.vocab_size, 128, 1)
        chunks = build_model_chunks(lambda **s: qwen.build_qwen(config, shape, vocab_size=vocab, **s), None)
        if lora:
            lora_module.apply(chunks, run.lora, seed=1)
        engine = build_engine(chunks, device, forward_step, **run.engine_sections())
        engine.optimizer_step()  # zero gradients: AdamW's moments come to exist
        weights = sum(p.numel() * p.element_size() for c in chunks for p in c.parameters())
        grads = sum(b.grad_data.numel() * b.grad_data.element_size() for m in engine.model for b in m.buffers)
        optimizer = 0
        for part in getattr(engine.optimizer, "chained_optimizers", [engine.optimizer]):
            inner = part.optimizer
            masters = [p for g in inner.param_groups for p in g["params"]]
            optimizer += sum(p.numel() * p.element_size() for p in masters if p.dtype == torch.float32
                             and not any(p is q for c in chunks for q in c.parameters()))
            optimizer += sum(v.numel() * v.element_size() for s in inner.state.values() for v in s.values()
                             if torch.is_tensor(v) and v.dim() > 0)
        trainable = sum(p.numel() for c in chunks for p in c.parameters() if p.requires_grad)
        total = sum(p.numel() for c in chunks for p in c.parameters())
        root = tempfile.mkdtemp(dir=workdir)
        checkpoint.stage(root, 1, engine, dict(model_shape=dataclasses.asdict(shape))).write()  # (not committed)
        size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs)
        shutil.rmtree(root)
        return dict(layers=layers, lora=lora, parameters=total, trainable=trainable, weights=weights, grads=grads,
                    optimizer=optimizer, checkpoint=size)
    finally:
        engine = chunks = None
        gc.collect()
        parallel.teardown()


def extend(small: dict, large: dict, layers: int) -> dict:
    """Each figure at ``layers`` layers, linear in the layer count through the two measured points."""
    per_layer = {k: (large[k] - small[k]) / (large["layers"] - small["layers"]) for k in
                 (*KEYS, "parameters", "trainable")}
    return dict(small, layers=layers, extended=True,
                **{k: small[k] + per_layer[k] * (layers - small["layers"]) for k in per_layer})


def table(model: str, rows: list) -> list:
    gib = lambda b: f"{b / 2**30:9.2f}"  # noqa: E731
    lines = [f"{model} shape, one rank, bf16 weights, fp32 grads/master/AdamW; GiB ('*': extended from 2 and 4 layers)",
             f"{'variant':<22} {'layers':>6} {'trainable':>14} | {'weights':>9} {'grads':>9} {'optimizer':>9} "
             f"{'total':>9} | {'checkpoint':>10}"]
    for r in rows:
        states = r["weights"] + r["grads"] + r["optimizer"]
        name = "LoRA r=16, all linears" if r["lora"] else "full fine-tuning"
        lines.append(f"{name:<22} {r['layers']:>5}{'*' if r.get('extended') else ' '} {r['trainable']:>14,.0f} | "
                     f"{gib(r['weights'])} {gib(r['grads'])} {gib(r['optimizer'])} {gib(states)} | "
                     f"{gib(r['checkpoint']):>10}")
    return lines


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-3b", help="a preset (finetune_qwen.py --model)")
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 4],
                        help="layer counts measured; two of them: also extended to the whole model")
    parser.add_argument("--workdir", default=tempfile.gettempdir())
    parser.add_argument("--out", default=None, help="write the rows as JSON")
    args = parser.parse_args(argv)
    import torch

    measured = [measure(args.model, n, lora, args.workdir) for lora in (False, True) for n in args.layers]
    rows = list(measured)
    full = FULL_LAYERS.get(args.model)
    if len(args.layers) == 2 and full and full not in args.layers:
        for lora in (False, True):
            small, large = [r for r in measured if r["lora"] == lora]
            rows.append(extend(small, large, full))
    print("\n".join(table(args.model, rows)))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": "CPU", "torch": torch.__version__, "model": args.model, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
