"""A single-process model's parameters by their global names, filled from a Hugging Face checkpoint by a family's
table (each family's ``build.single_process`` builds the model)."""

from __future__ import annotations

from typing import Dict

import torch


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
