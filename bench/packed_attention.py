"""Attention over packed documents, forward and backward, on one layer's heads: SDPA with the per-document mask
(what CPU and fp32 runs use) beside torch's flash kernel for variable lengths (what a GPU uses in bf16/fp16,
``megatron_ext/models/attention.py``), both through ``SDPAttention`` as the model calls it.

    python bench/packed_attention.py --device cuda --out bench/results/<device>_packed_attention.json
    .venv/bin/python bench/packed_attention.py --rows 1 --seq-length 1024   # CPU: the mask only

Rows of ``--seq-length`` tokens are filled with documents of uniformly random length up to ``--longest`` (SFT data:
MetaMathQA's conversations are a few hundred tokens), the last cut at the row's end. The FLOPs column counts what
each document needs (causal, within itself); the mask path computes every score of the row, so its TFLOP/s counts
work it did not need to do.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def documents(rows: int, seq: int, longest: int, seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    cu = [0]
    for row in range(rows):
        while cu[-1] < (row + 1) * seq:
            cu.append(min((row + 1) * seq, cu[-1] + int(torch.randint(16, longest + 1, (), generator=g))))
    return cu


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-0.5b", help="a preset: its heads, key/value heads and head width")
    p.add_argument("--rows", type=int, default=4, help="packed rows per micro-batch")
    p.add_argument("--seq-length", type=int, default=4096)
    p.add_argument("--longest", type=int, default=800, help="longest document, in tokens")
    p.add_argument("--device", default="cpu")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", help="JSON file for the results")
    args = p.parse_args(argv)

    from megatron_ext import parallel
    from megatron_ext.engines.megatron import thd_params
    from megatron_ext.mesh import Mesh
    from megatron_ext.models import attention
    from megatron_ext.models.qwen import model as qwen
    from megatron_ext.models.qwen.shape import PRESETS
    from megatron.core.transformer.enums import AttnMaskType

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = PRESETS[args.model]
    parallel.init_distributed("nccl" if device.type == "cuda" else "gloo")
    parallel.init_model_parallel(Mesh(world=1), seed=1)
    try:
        config = qwen.transformer_config(shape, Mesh(world=1))
        config = dataclasses.replace(config, attention_dropout=0.0)
        module = attention.SDPAttention(config, 1, AttnMaskType.causal, "self")
        cu = documents(args.rows, args.seq_length, args.longest)
        params = thd_params(torch.tensor(cu, device=device), args.seq_length)
        tokens, d = args.rows * args.seq_length, config.kv_channels
        heads = (config.num_attention_heads, config.num_query_groups, config.num_query_groups)
        lengths = [b - a for a, b in zip(cu, cu[1:])]
        flops = 3 * 2 * 2 * config.num_attention_heads * d * sum(n * (n + 1) / 2 for n in lengths)  # fwd + 2x bwd
        found = attention.varlen_kernel
        kernel = found(torch.empty(0, dtype=dtype, device=device), 0.0)
        rows = []
        for name, choose in (("SDPA + document mask", lambda q, p: None), ("flash varlen", found)):
            if name == "flash varlen" and kernel is None:
                rows.append(dict(path=name, ms=None, note="not available here (CUDA, bf16/fp16, torch >= 2.11)"))
                continue
            attention.varlen_kernel = choose
            q, k, v = (torch.randn(tokens, h, d, device=device, dtype=dtype, requires_grad=True) for h in heads)
            times = []
            for rep in range(args.reps + 1):
                if device.type == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                module(q, k, v, None, packed_seq_params=params).sum().backward()
                if device.type == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
            seconds = statistics.median(times[1:])  # the first: warm-up
            rows.append(dict(path=name, ms=round(1e3 * seconds, 3), tflops=round(flops / seconds / 1e12, 2)))
    finally:
        attention.varlen_kernel = found
        parallel.teardown()
    base = rows[0]["ms"]
    for r in rows:
        r["vs_mask"] = f"{base / r['ms']:.2f}x" if r["ms"] else "n/a"
    result = dict(model=args.model, device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                  dtype=str(dtype).split(".")[-1], rows=args.rows, seq_length=args.seq_length,
                  documents=len(lengths), mean_document=round(sum(lengths) / len(lengths), 1), results=rows)
    print(f"{args.model} heads {heads}, {args.rows} x {args.seq_length} tokens in {len(lengths)} documents "
          f"(mean {result['mean_document']}), {result['dtype']} on {result['device']}, forward + backward")
    for r in rows:
        print(f"  {r['path']:<22} {r['ms'] if r['ms'] else '-':>10} ms  {r.get('tflops', '-'):>8} TFLOP/s  "
              f"{r['vs_mask']:>6}  {r.get('note', '')}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
