"""Memory and time of the loss layer alone (output layer + cross entropy, forward and backward) for one micro-batch:
megatron-core's path (the whole logits, ``vocab_parallel_cross_entropy``) beside ``--cross-entropy-loss-fusion``
(``megatron_ext/models/linear_cross_entropy.py``: chunks of tokens).

    .venv/bin/python bench/loss_memory.py --out bench/results/loss_memory_cpu.json     # Qwen2.5-0.5B's shape, fp32
    python bench/loss_memory.py --device cuda --dtype bf16 --tokens 16384                # one GPU: 4 x 4,096 tokens

Each variant runs in a fresh process (one rank, TP1): the peak is the process's high-water mark above what it held
just before the measured call (CPU: resident set; CUDA: ``max_memory_allocated``), so it counts the logits, the
softmax saved for backward and every temporary, not the inputs or the weight's gradient.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
GIB = 2**30


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def worker(variant: str, tokens: int, hidden: int, vocab: int, dtype: str, device: str) -> dict:
    import torch
    from megatron.core import tensor_parallel

    from megatron_ext import parallel
    from megatron_ext.mesh import Mesh
    from megatron_ext.models import linear_cross_entropy

    parallel.init_distributed("nccl" if device == "cuda" else "gloo")
    parallel.init_model_parallel(Mesh(world=1), seed=1)
    dtype = dict(fp32=torch.float32, bf16=torch.bfloat16)[dtype]
    g = torch.Generator(device=device).manual_seed(0)
    hidden_states = (torch.randn(tokens, 1, hidden, generator=g, device=device) * 0.5).to(dtype).requires_grad_()
    weight = (torch.randn(vocab, hidden, generator=g, device=device) * 0.02).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (1, tokens), generator=g, device=device)

    def step():
        if variant == "fused":
            loss = linear_cross_entropy.linear_cross_entropy(hidden_states, weight, labels, vocab_size=vocab,
                                                            sequence_parallel=False)
        else:  # megatron-core's: GPTModel's output layer, then compute_language_model_loss
            logits = hidden_states @ weight.t()
            loss = tensor_parallel.vocab_parallel_cross_entropy(logits, labels.t().contiguous()).t()
        loss.sum().backward()
        return loss

    if device == "cuda":
        step()  # warm-up (cuBLAS workspaces); the weight's gradient exists from here on
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        weight.grad = torch.zeros_like(weight)  # as after a warm-up, without raising the high-water mark
        hidden_states.grad = torch.zeros_like(hidden_states)
        before = _rss()
    start = time.perf_counter()
    loss = step()
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() - before if device == "cuda" else \
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    result = dict(variant=variant, peak_gib=round(peak / GIB, 3), seconds=round(seconds, 3),
                  loss_mean=float(loss.float().mean()))
    parallel.teardown()
    return result


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=896, help="default: Qwen2.5-0.5B's")
    p.add_argument("--vocab", type=int, default=151936, help="default: Qwen2.5's")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--out", default=None)
    p.add_argument("--worker", default=None, choices=["unfused", "fused"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    shape = dict(tokens=args.tokens, hidden=args.hidden, vocab=args.vocab, dtype=args.dtype, device=args.device)
    if args.worker:
        print(json.dumps(worker(args.worker, **shape)))
        return
    rows = []
    for variant in ("unfused", "fused"):
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", variant, *sum(
            ([f"--{k}", str(v)] for k, v in shape.items()), [])]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=REPO,
                             env=dict(os.environ, PYTHONWARNINGS="ignore"))
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    logits_gib = args.tokens * args.vocab * 4 / GIB
    print(f"loss layer, {args.tokens} tokens x {args.vocab:,} vocabulary (hidden {args.hidden}), {args.dtype} on "
          f"{args.device}; one fp32 copy of the logits is {logits_gib:.2f} GiB")
    print(f"{'':<10}{'peak above inputs':>20}{'forward+backward':>18}{'mean loss':>12}")
    for r in rows:
        print(f"{r['variant']:<10}{r['peak_gib']:>16.2f} GiB{r['seconds']:>16.2f} s{r['loss_mean']:>12.5f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(shape, fp32_logits_gib=round(logits_gib, 3), rows=rows), f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
