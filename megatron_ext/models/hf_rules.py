"""A family's Hugging Face name map is a table of ``Rule``s (models/<family>/hf.py); this is the table's grammar
and the config reading the families share. Torch-free at import: the flags' checks read configs before torch
loads; the convert machinery (convert/) applies the tables.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import TYPE_CHECKING, Callable, Iterator, List, Optional, Sequence, Tuple

from megatron_ext.errors import ConfigError

if TYPE_CHECKING:
    import torch

LAYER = "{i}"  # placeholder for the layer index in rule names
EXPERT = "{e}"  # placeholder for the (global) expert index in rule names of MoE layers


@dataclasses.dataclass(frozen=True)
class Rule:
    """One megatron-core tensor and the Hugging Face tensors it is made of.

    ``fuse(hf_tensors, ctx) -> mcore`` and ``split(mcore, ctx) -> hf_tensors`` are inverses; the default moves one
    tensor unchanged. Names containing ``{i}`` repeat per layer, names containing ``{e}`` per expert.
    """

    mcore: str
    hf: Tuple[str, ...]
    fuse: Optional[Callable] = None
    split: Optional[Callable] = None

    def per_layer(self) -> bool:
        return LAYER in self.mcore

    def expand(self, layers: Sequence[int], num_experts: int = 0) -> Iterator["Rule"]:
        for i in (layers if self.per_layer() else [None]):
            for e in (range(num_experts) if EXPERT in self.mcore else [None]):
                yield dataclasses.replace(self, mcore=self.mcore.format(i=i, e=e),
                                          hf=tuple(name.format(i=i, e=e) for name in self.hf))

    def to_mcore(self, tensors: List[torch.Tensor], ctx, flag: str = "--hf-path") -> torch.Tensor:
        try:
            return self.fuse(tensors, ctx) if self.fuse else tensors[0]
        except RuntimeError:  # a reshape/cat that cannot work: the tensors do not have the config's shapes
            shapes = ", ".join(f"{n} {tuple(t.shape)}" for n, t in zip(self.hf, tensors))
            raise ConfigError(f"{flag}: cannot build {self.mcore} from {shapes}; the config does not match "
                              "the weights") from None

    def to_hf(self, tensor: torch.Tensor, ctx) -> List[torch.Tensor]:
        return list(self.split(tensor, ctx)) if self.split else [tensor]


def concrete_rules(rules: Sequence[Rule], num_layers: int, layers: Optional[Sequence[int]] = None,
                   num_experts: int = 0) -> List[Rule]:
    """``rules`` for every layer (or those in ``layers``: an MoE model's MoE or dense ones) and expert."""
    layers = range(num_layers) if layers is None else layers
    return [concrete for rule in rules for concrete in rule.expand(layers, num_experts)]


def with_dtype(config: dict, dtype: torch.dtype) -> dict:
    """``config`` stamped with the exported dtype, under the key it already uses (transformers 4: ``torch_dtype``)."""
    config = dict(config)
    config["torch_dtype" if "torch_dtype" in config else "dtype"] = str(dtype).replace("torch.", "")
    return config


def read_json(path: str, flag: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"{flag} {path}: cannot read a JSON file ({e.__class__.__name__}: {e})") from None


def hf_to_mcore(table, hf: dict, shape) -> dict:
    """A full (TP=PP=1) megatron-core state dict from an in-memory Hugging Face one, by a family's name map
    (``table``: its ``hf`` module; a checkpoint without a head's tensors leaves the head out). The tools stream."""
    rules, _ = table.source(shape, hf, hf.__getitem__)
    ctx = table.context(shape)
    return {rule.mcore: rule.to_mcore([hf[name] for name in rule.hf], ctx) for rule in rules}


def read_config(path: str, flag: str, model_types: Tuple[str, ...]) -> dict:
    """A Hugging Face ``config.json`` (or the directory holding one) of one of ``model_types``, as a dict."""
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    try:
        with open(path) as f:
            cfg = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"{flag} {path}: cannot read a JSON config ({e.__class__.__name__}: {e})") from None
    if cfg.get("model_type") not in model_types:
        raise ConfigError(f"{flag} {path}: model_type is {cfg.get('model_type')!r}, expected "
                          f"{' or '.join(repr(t) for t in model_types)}")
    return cfg
