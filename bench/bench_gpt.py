"""Benchmark a megatron_ext GPT-2 run beside transformers' GPT2LMHeadModel: tokens/s, MFU, peak memory.

    python bench/bench_gpt.py --model tiny --seq-length 256 --micro-batch-size 4 --global-batch-size 8 \
        --bench-out bench/results/cpu_gpt_tiny.json
    python bench/bench_gpt.py --model gpt2 --bf16 --seq-length 1024 --micro-batch-size 16 --global-batch-size 32 \
        --bench-out bench/results/h100_gpt2.json

Ours is pretrain_gpt.main in this process (the real engine, any pretrain_gpt.py flag, any mesh under torchrun with
--baseline none) on synthetic --mock-data tokens, so what is measured is the training job. ``--baseline hf`` (the
default) then trains transformers' GPT2LMHeadModel of exactly our shape (models/gpt2/hf.config_fields: tied
embeddings, tanh GELU, dropout 0 as ours) on the same batches, dtype and device with SDPA attention and torch AdamW
(bench/peers.py train_peer: the run's lr, betas, weight decay, clipping; gradient checkpointing with
--recompute-granularity full). Ours pads the vocabulary for TP (--make-vocab-size-divisible-by, 50257 -> 50304),
the peer does not; MFU counts the real vocabulary for both. Rows, JSON and table as bench_qwen.py's, so
bench/table.py collects these runs too; the first --warmup-steps steps are left out of the averages.
"""

from __future__ import annotations

import os
import sys
from typing import Optional, Sequence

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import pretrain_gpt  # noqa: E402  (needs REPO on the path)
from bench.bench_qwen import _given, parse_bench_argv, run_benchmark  # noqa: E402
from bench.peers import train_lm_peer  # noqa: E402
from megatron_ext import arguments  # noqa: E402
from megatron_ext.cli import run_main  # noqa: E402
from megatron_ext.errors import ConfigError  # noqa: E402

ATTENTION = "sdpa"  # both sides: torch scaled_dot_product_attention


def split_argv(argv: Sequence[str]):
    """The benchmark's flags and the pretrain_gpt.py command line they imply; every refusal is one line, before
    any process group."""
    bench, rest = parse_bench_argv(argv, arguments.build_parser(__doc__.splitlines()[0], family="gpt"),
                                   baseline="hf", peer="transformers' GPT2LMHeadModel (SDPA, AdamW)")
    if _given("--data-path", rest):  # a tokenizer could widen our vocabulary past the peer's
        raise ConfigError("--data-path: bench_gpt.py times the model on synthetic tokens (--mock-data); "
                          "pretrain_gpt.py itself trains on a token stream")
    forward = [*rest, "--train-iters", str(bench.bench_steps)]
    if not _given("--mock-data", rest):
        forward.append("--mock-data")
    return bench, forward


def model_name(args) -> str:
    """The JSON's (and bench/table.py's) model column: "gpt2-tiny", not the bare "tiny" of the Qwen runs."""
    return args.hf_config or (args.model if args.model.startswith("gpt2") else f"gpt2-{args.model}")


def megatron_parameters(run: arguments.RunConfig) -> Optional[int]:
    """Parameters of ours (padded vocabulary included) built on the meta device. Without TP/PP every rank holds the
    whole model; a sharded mesh reports None."""
    import torch

    from megatron_ext.models.gpt2 import model as gpt2
    from megatron_ext.models.qwen import model as qwen

    if run.mesh.tp * run.mesh.pp != 1:
        return None
    config = gpt2.transformer_config(run.shape, run.mesh, initialize=False)
    vocab = qwen.padded_vocab_size(run.shape.vocab_size, run.model.make_vocab_size_divisible_by, run.mesh.tp)
    with torch.device("meta"):
        return sum(p.numel() for p in gpt2.build_gpt2(config, run.shape, vocab_size=vocab).parameters())


def run_transformers(run: arguments.RunConfig, device, steps: int, kind: str = "hf") -> dict:
    """GPT2LMHeadModel of our shape on the batches --mock-data fed ours (``peers.train_lm_peer``): the
    "transformers" side."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from megatron_ext.models.gpt2.hf import config_fields

    config = GPT2Config(**config_fields(run.shape), resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        attn_implementation=ATTENTION, use_cache=False)
    return dict(side="transformers", **train_lm_peer(run, device, steps, GPT2LMHeadModel, config))


def main(argv: Optional[Sequence[str]] = None) -> None:
    bench, forward = split_argv(sys.argv[1:] if argv is None else argv)
    run_benchmark(bench, forward, family="gpt", entry=pretrain_gpt.main, peer=run_transformers, model=model_name,
                  parameters=megatron_parameters, extra=dict(benchmark="bench_gpt", attention=ATTENTION))


if __name__ == "__main__":
    run_main(main)
