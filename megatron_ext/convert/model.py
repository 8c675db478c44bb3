"""The whole megatron-core model in one CPU process, for conversion: a distributed checkpoint written from it (or
read into it) reshards to any TP/PP/DP mesh, so conversion never needs the training mesh. Builders take
``(shape, dtype, record)``, ``record`` being what the checkpoint records beside the shape; megatron is imported
only when one runs, so a bad config fails before the slow imports."""

from __future__ import annotations

from typing import Dict, Optional

import torch


def _single_process_mesh():
    from megatron_ext import parallel
    from megatron_ext.mesh import Mesh

    parallel.init_distributed("gloo")
    mesh = Mesh(world=1)
    parallel.init_model_parallel(mesh, seed=0)
    return mesh


def single_process_qwen(shape, dtype: torch.dtype, record: Optional[dict] = None) -> torch.nn.Module:
    """TP=PP=1 Qwen model on CPU, allocated but not initialised."""
    from megatron_ext.convert.qwen import context
    from megatron_ext.models import qwen

    config = qwen.transformer_config(shape, _single_process_mesh(), params_dtype=dtype, initialize=False)
    return qwen.build_qwen(config, shape, vocab_size=context(shape).padded_vocab)


def single_process_gpt2(shape, dtype: torch.dtype, record: Optional[dict] = None) -> torch.nn.Module:
    """TP=PP=1 GPT-2 on CPU, allocated but not initialised."""
    from megatron_ext.convert.gpt2 import context
    from megatron_ext.models import gpt2

    config = gpt2.transformer_config(shape, _single_process_mesh(), params_dtype=dtype, initialize=False)
    return gpt2.build_gpt2(config, shape, vocab_size=context(shape).padded_vocab)


def single_process_vit(shape, dtype: torch.dtype, record: dict) -> torch.nn.Module:
    """TP=PP=1 ViT on CPU, allocated but not initialised; with ``num_classes`` None a backbone (no head)."""
    from megatron_ext.models import vit

    config = vit.transformer_config(shape, _single_process_mesh(), params_dtype=dtype, initialize=False)
    classes = record.get("num_classes")
    model = vit.ViTClassifier(config, shape, classes or 1)
    if classes is None:
        del model.head  # a ViTModel / in21k backbone: no head is saved or exported
    return model


def parameters_by_name(model: torch.nn.Module) -> Dict[str, torch.nn.Parameter]:
    from megatron_ext.models.sharding import global_named_parameters

    return {name: param for name, _, param in global_named_parameters(model)}


def fill_from_hf(model: torch.nn.Module, reader, family, shape, rules, flag: str) -> set:
    """Copy a Hugging Face checkpoint's tensors (``reader``: ``common.SafetensorsReader``) into ``model`` by the
    family's ``rules``, one tensor at a time, each checked against its parameter's shape; returns the HF names used."""
    from megatron_ext.convert.common import check_shape

    params, ctx, used = parameters_by_name(model), family.context(shape), set()
    with torch.no_grad():
        for rule in rules:
            tensor = rule.to_mcore([reader.get(name) for name in rule.hf], ctx, flag)
            check_shape(" + ".join(rule.hf), tensor.shape, params[rule.mcore].shape, flag)
            params[rule.mcore].copy_(tensor)
            used.update(rule.hf)
    return used
