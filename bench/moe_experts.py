"""One MoE layer's forward and backward: grouped experts (torch._grouped_mm) against SequentialMLP, with
transformers' ``Qwen2MoeSparseMoeBlock`` / ``Qwen3MoeSparseMoeBlock`` of the same shape and weights beside them (its
eager expert loop and its ``grouped_mm`` experts implementation).

    python bench/moe_experts.py --experts 8 60 --out bench/results/moe_experts_cpu.json
    python bench/moe_experts.py --model qwen3-30b-a3b --device cuda --bf16 --tokens 8192 --out ...

Shapes are the ``--model`` layer's: Qwen1.5-MoE-A2.7B's (hidden 2048, expert FFN 1408, top-4, gated shared expert
of 5632; default) or Qwen3-30B-A3B's (hidden 2048, expert FFN 768, top-8 renormalised, no shared expert), with the
given expert counts (default: the published one); on CPU every width is divided by ``--cpu-width-divisor``
(default 4) so a run takes seconds.
Per implementation: operators dispatched per layer step (forward + backward, counted below autograd with
``bench/host_ops.py``'s counter: about one kernel launch each on a GPU), host syncs, median wall time of the step
and routed tokens/s, and MFU on active parameters (router, top-k experts, shared expert) against the device's
peak on CUDA. Weights are copied so all three compute the same function (the bench checks the outputs agree).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from collections import Counter

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.host_ops import CountOps, count_syncs  # noqa: E402


MODELS = ("qwen1.5-moe-a2.7b", "qwen3-30b-a3b")


def layer_shape(model: str, experts: int, divisor: int):
    from megatron_ext.models.qwen.shape import PRESETS

    base = PRESETS[model]
    h, f = base.hidden_size // divisor, base.moe.ffn_hidden_size // divisor
    shared = base.moe.shared_expert_size and base.moe.shared_expert_size // divisor
    heads = max(1, base.num_attention_heads // divisor)
    return dataclasses.replace(base, hidden_size=h, ffn_hidden_size=shared or f, num_layers=1, vocab_size=256,
                               num_attention_heads=heads, num_query_groups=heads,
                               head_dim=base.head_dim and base.head_dim // divisor,
                               moe=dataclasses.replace(base.moe, num_experts=experts, ffn_hidden_size=f,
                                                       shared_expert_size=shared or None))


def megatron_layer(shape, grouped: bool, dtype: torch.dtype, device: torch.device):
    from megatron_ext.mesh import Mesh
    from megatron_ext.models.qwen import model as qwen
    from megatron_ext.models.init import init_mesh_independent
    from megatron_ext.models.moe_flags import MoESettings

    config = qwen.transformer_config(shape, Mesh(world=1), params_dtype=dtype, on_gpu=device.type == "cuda",
                                     moe_settings=MoESettings(grouped_gemm=grouped))
    model = qwen.build_qwen(config, shape, vocab_size=256)
    init_mesh_independent([model], seed=1)
    return model.decoder.layers[0].mlp.to(device)


def hf_layer(shape, reference, dtype: torch.dtype, device: torch.device, experts_implementation: str):
    """transformers' block with the megatron layer's weights (converted with the family's table)."""
    import transformers
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    from megatron_ext.models.qwen.hf import HF_CLASSES, config_fields, rules
    from megatron_ext.models.sharding import global_named_parameters

    config = getattr(transformers, HF_CLASSES[shape.model_type][0])(**config_fields(shape),
                                                                    experts_implementation=experts_implementation)
    block = (Qwen3MoeSparseMoeBlock if shape.qk_norm else Qwen2MoeSparseMoeBlock)(config)
    ours = {name.replace("decoder.layers.0.mlp.", ""): p for name, _, p in global_named_parameters(reference)}
    hf = {}
    for rule in rules(shape):
        if rule.mcore.startswith("decoder.layers.0.mlp."):
            tensors = rule.to_hf(ours[rule.mcore.replace("decoder.layers.0.mlp.", "")].detach().float(), None)
            hf.update({name.replace("model.layers.0.mlp.", ""): t for name, t in zip(rule.hf, tensors)})
    experts = shape.moe.num_experts
    fused = {"experts.gate_up_proj": torch.stack([torch.cat([hf[f"experts.{e}.gate_proj.weight"],
                                                             hf[f"experts.{e}.up_proj.weight"]]) for e in range(experts)]),
             "experts.down_proj": torch.stack([hf[f"experts.{e}.down_proj.weight"] for e in range(experts)])}
    state = {k: v for k, v in hf.items() if not k.startswith("experts.")} | fused
    missing = block.load_state_dict({k: v.reshape(block.state_dict()[k].shape) for k, v in state.items()},
                                    strict=True)
    assert not missing.missing_keys
    return block.to(device=device, dtype=dtype)


def step(layer, x: torch.Tensor, grad: torch.Tensor, hf: bool) -> torch.Tensor:
    out = layer(x.transpose(0, 1)).transpose(0, 1) if hf else layer(x)[0]  # ours: [s, b, h]
    out.backward(grad)
    return out


def measure(layer, x, grad, hf: bool, reps: int, device: torch.device) -> dict:
    for _ in range(2):  # warm-up: allocator, kernel selection
        step(layer, x, grad, hf)
    ops, syncs = CountOps(), Counter()
    with ops, count_syncs(syncs):
        out = step(layer, x, grad, hf)
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        step(layer, x, grad, hf)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return dict(ops=sum(ops.ops.values()), syncs=sum(syncs.values()), seconds=statistics.median(times),
                output=out.detach().float())


def active_flops_per_token(shape) -> float:
    """Forward + backward (3x) multiply-adds of the router, the top-k experts and the shared expert (if any)."""
    h, moe = shape.hidden_size, shape.moe
    shared = 3 * moe.shared_expert_size + 1 if moe.shared_expert_size else 0
    return 6.0 * h * (moe.num_experts + moe.topk * 3 * moe.ffn_hidden_size + shared)


def main(argv=None) -> None:

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", nargs="+", default=[MODELS[0]], choices=MODELS, help="whose MoE layers")
    p.add_argument("--experts", type=int, nargs="+", default=None, help="expert counts (default: the model's)")
    p.add_argument("--tokens", type=int, default=None, help="tokens per step (default: 8192 on CUDA, 1024 on CPU)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--cpu-width-divisor", type=int, default=4)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", default=None, help="write the results as JSON")
    args = p.parse_args(argv)
    from megatron_ext import parallel
    from megatron_ext.mesh import Mesh
    from megatron_ext.observability.flops import peak_flops

    device = torch.device(args.device)
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    tokens = args.tokens or (8192 if device.type == "cuda" else 1024)
    divisor = 1 if device.type == "cuda" else args.cpu_width_divisor
    parallel.init_distributed("nccl" if device.type == "cuda" else "gloo")
    parallel.init_model_parallel(Mesh(world=1), seed=1)
    peak = peak_flops(device, dtype, None) if device.type == "cuda" else None
    device_name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    rows = []
    print(f"one MoE layer, forward + backward, {tokens} tokens, {str(dtype)[6:]} on {device_name}")
    print(f"{'model':<18}{'experts':>8} {'implementation':<30}{'ops/step':>10}{'syncs':>7}{'ms/step':>10}{'tokens/s':>12}"
          f"{'MFU':>7}{'speed-up':>10}{'max diff':>11}")
    from megatron_ext.models.qwen.shape import PRESETS

    for model, experts in [(m, e) for m in args.model for e in args.experts or [PRESETS[m].moe.num_experts]]:
        shape = layer_shape(model, experts, divisor)
        g = torch.Generator().manual_seed(experts)
        x = torch.randn(tokens, 1, shape.hidden_size, generator=g).to(device, dtype).requires_grad_()
        grad = torch.randn(tokens, 1, shape.hidden_size, generator=g).to(device, dtype)
        sequential = megatron_layer(shape, False, dtype, device)
        layers = {"SequentialMLP (megatron-core)": (sequential, False),
                  "grouped (torch._grouped_mm)": (megatron_layer(shape, True, dtype, device), False)}
        for impl in ("eager", "grouped_mm"):
            layers[f"transformers ({impl})"] = (hf_layer(shape, sequential, dtype, device, impl), True)
        results = {name: measure(layer, x, grad, hf, args.reps, device) for name, (layer, hf) in layers.items()}
        base = results["SequentialMLP (megatron-core)"]
        reference = base["output"]
        for name, r in results.items():
            r["max_abs_diff_vs_sequential"] = float((r.pop("output") - reference).abs().max())
            r["tokens_per_sec"] = tokens / r["seconds"]
            r["mfu"] = active_flops_per_token(shape) * r["tokens_per_sec"] / peak if peak else None
            r["speedup_vs_sequential"] = base["seconds"] / r["seconds"]
            mfu = f"{r['mfu']:.1%}" if r["mfu"] else "—"
            print(f"{model:<18}{experts:>8} {name:<30}{r['ops']:>10,}{r['syncs']:>7}{1e3 * r['seconds']:>10.1f}"
                  f"{r['tokens_per_sec']:>12,.0f}{mfu:>7}{r['speedup_vs_sequential']:>9.2f}x"
                  f"{r['max_abs_diff_vs_sequential']:>11.1e}")
        rows.append(dict(model=model, experts=experts, topk=shape.moe.topk, hidden=shape.hidden_size,
                         expert_ffn=shape.moe.ffn_hidden_size, shared_ffn=shape.moe.shared_expert_size,
                         results=results))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=device_name, dtype=str(dtype), tokens=tokens,
                           torch=torch.__version__, rows=rows),
                      f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
