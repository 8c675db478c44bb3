"""The whole megatron-core model in one CPU process, for conversion: a distributed checkpoint written from it (or
read into it) reshards to any TP/PP/DP mesh, so conversion never needs the training mesh."""

from __future__ import annotations

from typing import Dict

import torch

from megatron_ext import parallel
from megatron_ext.arguments import Mesh
from megatron_ext.models import qwen
from megatron_ext.models.shapes import ModelShape
from megatron_ext.models.sharding import global_named_parameters

VOCAB_DIVISIBLE_BY = 128  # finetune_qwen.py's --make-vocab-size-divisible-by default


def single_process_qwen(shape: ModelShape, dtype: torch.dtype) -> torch.nn.Module:
    """TP=PP=1 Qwen model on CPU, allocated but not initialised."""
    parallel.init_distributed("gloo")
    mesh = Mesh(world=1)
    parallel.init_model_parallel(mesh, seed=0)
    config = qwen.transformer_config(shape, mesh, params_dtype=dtype, initialize=False)
    return qwen.build_qwen(config, shape, vocab_size=padded_vocab(shape))


def padded_vocab(shape: ModelShape) -> int:
    return qwen.padded_vocab_size(shape.vocab_size, VOCAB_DIVISIBLE_BY, 1)


def parameters_by_name(model: torch.nn.Module) -> Dict[str, torch.nn.Parameter]:
    return {name: param for name, _, param in global_named_parameters(model)}
