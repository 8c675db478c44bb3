"""Host work per training step: operators dispatched (about one GPU kernel launch each) and host syncs, with
megatron-core's own fallbacks for the missing TE/apex kernels against megatron_ext's stand-ins.

    python bench/host_ops.py --model qwen2.5-0.5b --num-layers 2 4 --out bench/results/host_ops_cpu.json

At small micro-batches the first H100 runs were bound by the host launching kernels (gpu-facts.md), so the number
of operators a step dispatches is a GPU-independent measure of that overhead; it is counted below autograd
(``TorchDispatchMode``: backward included, views excluded) on CPU ranks, for one step of packed SFT-shaped
micro-batches after a warm-up step, in bf16 as on a GPU (the megatron engine keeps fp32 main weights). Two layer
counts separate the per-layer cost from the fixed one. The optimizer step's share is counted apart, and its host
time measured on a ViT with ViT-H's 392 weight tensors at tiny widths (``--optimizer-host-layers``): it runs after
a host read of the token count, when the GPU has nothing queued and waits for each launch.

Variants: ``megatron-core fallbacks`` = what megatron-core does without TE/apex (weight gradient added to
``main_grad`` after its GEMM, grad norm one tensor at a time via a host list, foreach AdamW, cos/sin recomputed
in every layer, packed RoPE split per document after ``.tolist()``, attention over the whole flattened micro-batch
with its mask built in every layer, bf16 weights copied from the fp32 ones one tensor at a time); ``megatron_ext`` =
the defaults (``megatron_ext/platform/kernels.py``,
``models/rope.py``, ``models/attention.py``); ``transformers`` = the same shape's ``Qwen2ForCausalLM`` /
``Qwen3ForCausalLM`` (SDPA) in bf16 trained the usual way (loss per micro-batch, ``clip_grad_norm_``, torch's
AdamW, both foreach as on CUDA), the peer's count beside ours.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Operators that only allocate or relabel memory: no kernel is launched for them.
NO_KERNEL = {torch.ops.aten.detach.default, torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default,
             torch.ops.aten.empty_like.default}
SYNCS = ("item", "tolist", "__float__", "__int__", "__bool__", "cpu", "numpy")


class CountOps(TorchDispatchMode):
    """Operators that reach a backend kernel: everything below autograd except views and allocations."""

    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and func not in NO_KERNEL:
            self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def count_syncs(counter: Counter):
    originals = {name: getattr(torch.Tensor, name) for name in SYNCS}

    def counting(name):
        def method(self, *args, **kwargs):
            counter[name] += 1
            return originals[name](self, *args, **kwargs)
        return method

    for name in SYNCS:
        setattr(torch.Tensor, name, counting(name))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def megatron_copy(this, that, overflow_buf=None):
    """megatron-core's ``_multi_tensor_copy_this_to_that`` for bf16 (``overflow_buf`` None): a loop of ``copy_``."""
    for this_, that_ in zip(this, that):
        that_.copy_(this_)


def megatron_clip(params, max_norm, total_norm):
    """megatron-core's ``clip_grad_by_total_norm_fp32``: every gradient through its DTensor check, then its
    multi-tensor scale; its CUDA type assert left out for CPU."""
    from megatron.core.optimizer import clip_grads
    from megatron.core.utils import to_local_if_dtensor

    grads = [to_local_if_dtensor(p.grad).detach() for p in params if p.grad is not None]
    coefficient = max_norm / (total_norm + 1.0e-6)
    if coefficient < 1.0:
        clip_grads.multi_tensor_applier(clip_grads.multi_tensor_scale_impl, None, [grads, grads], coefficient)


@contextlib.contextmanager
def megatron_fallbacks(engine):
    """Put back what megatron-core does on its own without TE/apex, for this engine, then restore ours."""
    from megatron.core import utils
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.optimizer import clip_grads, optimizer

    from megatron_ext.models import attention, rope
    from megatron_ext.platform import kernels

    saved = (attention.packed_rows, attention.packed_mask, kernels.clip_by_total_norm)
    optimizer._multi_tensor_copy_this_to_that = megatron_copy
    kernels.clip_by_total_norm = megatron_clip
    clip_grads.l2_norm_impl = utils.local_multi_tensor_l2_norm
    clip_grads.multi_tensor_scale_impl = optimizer.multi_tensor_scale_impl = utils.local_multi_tensor_scale
    clip_grads.to_local_if_dtensor = utils.to_local_if_dtensor  # (host time only: no operator)
    clip_grads.get_data_parallel_group_if_dtensor = utils.get_data_parallel_group_if_dtensor
    rope_utils._apply_rotary_pos_emb_thd, rope_utils._apply_rotary_pos_emb_bshd = rope._MEGATRON["thd"], \
        rope._MEGATRON["bshd"]
    attention.packed_rows = lambda params, tokens: 1
    attention.packed_mask = lambda params, batch, seq: attention.document_causal_mask(params.cu_seqlens_q, batch, seq)
    optimizers = [opt.optimizer for opt in getattr(engine.optimizer, "chained_optimizers", [engine.optimizer])]
    for opt in optimizers:
        for group in opt.param_groups:
            group["fused"], group["foreach"] = False, True  # megatron-core's torch AdamW on GPU is foreach
    try:
        yield
    finally:
        for opt in optimizers:
            kernels.use_fused_adam(opt)
        attention.packed_rows, attention.packed_mask, kernels.clip_by_total_norm = saved
        kernels.install()  # (our norm, scale, copy and DTensor checks)
        rope.install()


def packed_microbatches(count: int, micro_batch: int, seq: int, vocab: int, seed: int = 0):
    """SFT-shaped packed micro-batches: rows of ``seq`` tokens, each holding documents of random lengths."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        cuts, positions = [0], []
        for row in range(micro_batch):
            start = row * seq
            inner = sorted(torch.randperm(seq - 1, generator=g)[:3].add(1).tolist())
            bounds = [start + c for c in inner] + [start + seq]
            cuts += bounds
            edges = [start] + bounds
            positions += [torch.arange(b - a) for a, b in zip(edges, edges[1:])]
        tokens = torch.randint(0, vocab, (micro_batch, seq + 1), generator=g)
        out.append(dict(tokens=tokens[:, :-1], labels=tokens[:, 1:], loss_mask=torch.ones(micro_batch, seq),
                        position_ids=torch.cat(positions).view(micro_batch, seq),
                        cu_seqlens=torch.tensor(cuts, dtype=torch.int32)))
    return out


def measure(shape, *, fallbacks: bool, micro_batch: int, seq: int, microbatches: int) -> dict:
    from megatron_ext.mesh import Mesh
    from megatron_ext.config.engine import Engine
    from megatron_ext.config.training import Fusions, Training
    from megatron_ext.engines.optimizer import OptimizerSettings
    from megatron_ext.training.run import build_engine
    from megatron_ext.objectives.sft import forward_step
    from megatron_ext.models.qwen import model as qwen
    from megatron_ext.models.init import init_mesh_independent
    from megatron_ext import parallel

    parallel.init_model_parallel(Mesh(world=1), seed=1)
    vocab = qwen.padded_vocab_size(shape.vocab_size, 128, 1)
    config = qwen.transformer_config(shape, Mesh(world=1), params_dtype=torch.bfloat16)  # as on GPU: fp32 main weights
    chunk = qwen.build_qwen(config, shape, vocab_size=vocab)
    init_mesh_independent([chunk], 1)
    engine = build_engine([chunk], torch.device("cpu"), forward_step, mesh=Mesh(world=1), engine=Engine(),
                          training=Training(micro_batch_size=micro_batch, seq_length=seq),
                          optimizer=OptimizerSettings(clip_grad=1.0),
                          fusions=Fusions(gradient_accumulation_fusion=not fallbacks))
    batches = packed_microbatches(microbatches, micro_batch, seq, shape.vocab_size)
    with megatron_fallbacks(engine) if fallbacks else contextlib.nullcontext():
        engine.forward_backward(batches)  # warm-up: optimizer states, lazy buffers
        engine.optimizer_step()
        syncs = Counter()
        with CountOps() as counter, count_syncs(syncs):
            engine.forward_backward(batches)
            before = sum(counter.ops.values())
            engine.optimizer_step()
    return dict(ops=sum(counter.ops.values()), syncs=sum(syncs.values()),
                optimizer_ops=sum(counter.ops.values()) - before, top_ops=dict(counter.ops))


def measure_transformers(shape, *, micro_batch: int, seq: int, microbatches: int) -> dict:
    """One step of transformers' model of ``shape`` on the same micro-batches (their rows unpacked)."""
    import transformers

    from megatron_ext.models.qwen.hf import HF_CLASSES, config_fields

    config_class, model_class = (getattr(transformers, name) for name in HF_CLASSES[shape.model_type])
    model = model_class(config_class(**config_fields(shape), attn_implementation="sdpa")).to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)  # torch's default on CUDA
    batches = packed_microbatches(microbatches, micro_batch, seq, shape.vocab_size)

    def backward():
        optimizer.zero_grad(set_to_none=True)
        for batch in batches:
            model(input_ids=batch["tokens"], labels=batch["tokens"]).loss.div(len(batches)).backward()

    def update():
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)  # (the default on CUDA)
        optimizer.step()

    backward()  # warm-up: optimizer states
    update()
    syncs = Counter()
    with CountOps() as counter, count_syncs(syncs):
        backward()
        before = sum(counter.ops.values())
        update()
    return dict(ops=sum(counter.ops.values()), syncs=sum(syncs.values()),
                optimizer_ops=sum(counter.ops.values()) - before, top_ops=dict(counter.ops))


def optimizer_host_ms(layers: int, reps: int = 40) -> dict:
    """Host milliseconds of one optimizer step of the megatron engine (bf16 weights, fp32 main weights, clipping
    that bites) on a ViT of ``layers`` layers at tiny widths (ViT-H: 32 layers, 392 weight tensors), megatron-core's
    fallbacks against ours: with tensors this small the time is the issuing of the work, which a GPU waits for, as
    the step starts after a host read that drained it. One thread; the median of ``reps`` steps, twice each,
    alternated."""
    import time

    from megatron_ext import parallel
    from megatron_ext.config.engine import Engine
    from megatron_ext.config.training import Training
    from megatron_ext.engines.optimizer import OptimizerSettings
    from megatron_ext.mesh import Mesh
    from megatron_ext.models.vit import model as vit
    from megatron_ext.models.vit.shape import ViTShape
    from megatron_ext.training.run import build_engine

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    parallel.init_model_parallel(Mesh(world=1), seed=1)
    shape = ViTShape(32, 64, layers, 2, 8, 32)
    chunk = vit.ViTClassifier(vit.transformer_config(shape, Mesh(world=1), params_dtype=torch.bfloat16), shape, 10)
    engine = build_engine([chunk], torch.device("cpu"), vit.forward_step, mesh=Mesh(world=1), engine=Engine(),
                          training=Training(micro_batch_size=2, seq_length=shape.seq_length),
                          optimizer=OptimizerSettings(clip_grad=1e-3))
    engine.forward_backward([dict(pixels=torch.randn(2, 3, 32, 32), labels=torch.tensor([1, 2]),
                                  loss_mask=torch.ones(2))])

    def median_ms():
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            engine.optimizer_step()
            times.append(time.perf_counter() - start)
        return sorted(times)[reps // 2] * 1e3

    median_ms()  # warm-up: optimizer states
    out = {"megatron-core fallbacks": [], "megatron_ext": []}
    for _ in range(2):
        with megatron_fallbacks(engine):
            out["megatron-core fallbacks"].append(median_ms())
        out["megatron_ext"].append(median_ms())
    torch.set_num_threads(threads)
    return dict(layers=layers, tensors=len(list(chunk.parameters())),
                **{name: round(sum(v) / len(v), 2) for name, v in out.items()})


def main(argv=None) -> None:
    from megatron_ext.models.qwen.shape import PRESETS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-0.5b", choices=sorted(PRESETS))
    parser.add_argument("--num-layers", type=int, nargs=2, default=[2, 4], metavar=("L1", "L2"))
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--optimizer-host-layers", type=int, default=32,
                        help="layers of the ViT whose optimizer step's host time is measured (ViT-H's 32; 0: skip)")
    parser.add_argument("--out", default=None, help="write the results as JSON")
    args = parser.parse_args(argv)
    if args.num_layers[0] >= args.num_layers[1]:
        sys.exit("error: --num-layers L1 L2 needs L1 < L2 (their difference gives the per-layer cost)")

    from megatron_ext import parallel

    torch.set_num_threads(max(1, torch.get_num_threads()))
    parallel.init_distributed("gloo")
    rows = {}
    full = PRESETS[args.model].num_layers
    sizes = dict(micro_batch=args.micro_batch_size, seq=args.seq_length, microbatches=args.microbatches)
    for name, fallbacks in (("megatron-core fallbacks", True), ("megatron_ext", False), ("transformers", None)):
        per_depth = {}
        for layers in args.num_layers:
            shape = dataclasses.replace(PRESETS[args.model], num_layers=layers)
            per_depth[layers] = measure_transformers(shape, **sizes) if fallbacks is None else \
                measure(shape, fallbacks=fallbacks, **sizes)
        (l1, a), (l2, b) = sorted(per_depth.items())
        per_layer = (b["ops"] - a["ops"]) / (l2 - l1)
        syncs_per_layer = (b["syncs"] - a["syncs"]) / (l2 - l1)
        rows[name] = dict(per_layer=per_layer, fixed=a["ops"] - per_layer * l1, syncs_per_layer=syncs_per_layer,
                          syncs_fixed=a["syncs"] - syncs_per_layer * l1, by_depth=per_depth)
        slope = (b["optimizer_ops"] - a["optimizer_ops"]) / (l2 - l1)  # the optimizer step's part, the same way
        rows[name]["optimizer_ops_full_depth"] = a["optimizer_ops"] + slope * (full - l1)
    print(f"{args.model} shape in bf16, packed, {args.microbatches} micro-batches of {args.micro_batch_size} x "
          f"{args.seq_length} tokens, one optimizer step (CPU, counted below autograd, views excluded)")
    print(f"{'':<26}{'ops/layer':>11}{'fixed ops':>11}{f'ops at {full} layers':>18}"
          f"{f'host syncs at {full} layers':>26}{'optimizer-step ops':>20}")
    for name, row in rows.items():
        row["ops_full_depth"] = row["fixed"] + row["per_layer"] * full
        row["syncs_full_depth"] = row["syncs_fixed"] + row["syncs_per_layer"] * full
        print(f"{name:<26}{row['per_layer']:>11,.0f}{row['fixed']:>11,.0f}{row['ops_full_depth']:>18,.0f}"
              f"{row['syncs_full_depth']:>26,.0f}{row['optimizer_ops_full_depth']:>20,.0f}")
    host = optimizer_host_ms(args.optimizer_host_layers) if args.optimizer_host_layers else None
    if host:
        print(f"optimizer step, host time at a {host['layers']}-layer ViT's {host['tensors']} weight tensors (tiny "
              f"widths, one thread): megatron-core fallbacks {host['megatron-core fallbacks']:.2f} ms, megatron_ext "
              f"{host['megatron_ext']:.2f} ms")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(model=args.model, dtype="bf16", full_depth=full, seq_length=args.seq_length,
                           micro_batch_size=args.micro_batch_size, microbatches=args.microbatches,
                           torch=torch.__version__, rows=rows, optimizer_host_ms=host), f, indent=1)
            f.write("\n")
    parallel.teardown()


if __name__ == "__main__":
    main()
