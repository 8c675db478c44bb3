"""Shared machinery for Hugging Face <-> megatron-core conversion: a model family is a table of ``Rule``s
(``models/hf_rules.py``; each family's in ``models/<family>/hf.py``).

Tensors stream: HF shards are read one tensor at a time (``safe_open``), and exported tensors are written into
shards of bounded size as they are produced, so a conversion holds the megatron model plus at most one shard.
"""

from __future__ import annotations

import json
import os
from typing import Callable, Dict, Iterator, List, Sequence, Tuple

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from megatron_ext.errors import ConfigError
from megatron_ext.models.hf_rules import Rule

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}  # the tools' --dtype


def mcore_to_hf_tensors(rules: Sequence[Rule], get_mcore: Callable[[str], torch.Tensor],
                        ctx) -> Iterator[Tuple[str, torch.Tensor]]:
    """(HF name, tensor) for every model tensor, in the order of the table."""
    for rule in rules:
        yield from zip(rule.hf, rule.to_hf(get_mcore(rule.mcore), ctx))


class SafetensorsReader:
    """The tensors of a Hugging Face model directory (``model.safetensors`` or an index plus any number of shards),
    opened lazily. Missing shards are reported up front, naming the file; ``check_files`` reads every shard's header
    (a truncated or corrupt file fails there, before any tensor is read)."""

    def __init__(self, directory: str, flag: str = "--hf-path"):
        from megatron_ext.convert.source import check_weights

        weight_map = check_weights(directory, flag)  # every file there and as long as its header says
        if weight_map is None:
            weight_map = {name: "model.safetensors" for name in self._open(directory, "model.safetensors", flag).keys()}
        self.directory, self.weight_map, self.flag = directory, weight_map, flag

    @staticmethod
    def _open(directory: str, file: str, flag: str):
        try:
            return safe_open(os.path.join(directory, file), "pt")
        except Exception as e:  # safetensors' own error type: a truncated or corrupt file
            raise ConfigError(f"{flag} {directory}: {file} cannot be read ({str(e).splitlines()[0]}); the file is "
                              "truncated or damaged, download it again") from None

    def check_files(self) -> Dict[str, Tuple[int, ...]]:
        """Every shard's header; the shape of every tensor, without reading one."""
        shapes = {}
        for file in sorted(set(self.weight_map.values())):
            handle = self._open(self.directory, file, self.flag)
            for name in handle.keys():
                if self.weight_map.get(name) == file:
                    shapes[name] = tuple(handle.get_slice(name).get_shape())
        absent = [name for name in self.weight_map if name not in shapes]
        if absent:
            raise ConfigError(f"{self.flag} {self.directory}: the index places {absent[0]} in "
                              f"{self.weight_map[absent[0]]}, which does not hold it; the download is incomplete")
        return shapes

    def names(self) -> List[str]:
        return list(self.weight_map)

    def get(self, name: str) -> torch.Tensor:
        if name not in self.weight_map:
            raise ConfigError(f"{self.flag} {self.directory}: tensor {name} is missing from the checkpoint")
        with self._open(self.directory, self.weight_map[name], self.flag) as f:
            return f.get_tensor(name)

    def get_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` only (mmap: only their pages are read)."""
        with self._open(self.directory, self.weight_map[name], self.flag) as f:
            return f.get_slice(name)[start:stop]

    def get_columns(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Columns ``start:stop`` of a 2-D tensor (a copy of only them; mmap still touches every row's pages)."""
        with self._open(self.directory, self.weight_map[name], self.flag) as f:
            return f.get_slice(name)[:, start:stop]


class ShardedSafetensorsWriter:
    """Writes tensors into ``model-0000k-of-0000n.safetensors`` shards of at most ``max_shard_bytes`` (one
    ``model.safetensors`` if they all fit) plus the index, as ``save_pretrained`` does."""

    def __init__(self, directory: str, max_shard_bytes: int):
        self.directory, self.max_shard_bytes = directory, max_shard_bytes
        self.pending: Dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.shards: List[List[str]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.max_shard_bytes:
            self._flush()
        self.pending[name] = tensor.contiguous()
        self.pending_bytes += size
        self.total_bytes += size

    def _flush(self) -> None:
        save_file(self.pending, os.path.join(self.directory, f"shard-{len(self.shards):05d}.tmp"),
                  metadata={"format": "pt"})
        self.shards.append(list(self.pending))
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> None:
        if self.pending:
            self._flush()
        if len(self.shards) == 1:
            os.replace(os.path.join(self.directory, "shard-00000.tmp"),
                       os.path.join(self.directory, "model.safetensors"))
            return
        weight_map = {}
        for k, names in enumerate(self.shards):
            final = f"model-{k + 1:05d}-of-{len(self.shards):05d}.safetensors"
            os.replace(os.path.join(self.directory, f"shard-{k:05d}.tmp"), os.path.join(self.directory, final))
            weight_map.update({name: final for name in names})
        with open(os.path.join(self.directory, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}, f, indent=2)


def check_output_dir(path: str, overwrite: bool, flag: str = "--save") -> None:
    """Refuse to write into a non-empty directory unless asked: nothing a user has is overwritten by accident."""
    if os.path.isdir(path) and os.listdir(path) and not overwrite:
        raise ConfigError(f"{flag} {path} is not empty; choose an empty directory or pass --overwrite")
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"{flag} {path} is a file, not a directory")
    os.makedirs(path, exist_ok=True)


def check_shape(name: str, actual: torch.Size, expected: torch.Size, flag: str) -> None:
    if tuple(actual) != tuple(expected):
        raise ConfigError(f"{flag}: tensor {name} has shape {tuple(actual)} but the model expects "
                          f"{tuple(expected)}; the config does not match the weights")


def parse_size(text: str) -> int:
    """'2GB', '500MB', '1GiB' or a number of bytes."""
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "B": 1}
    upper = text.strip().upper()
    for unit, factor in sorted(units.items(), key=lambda kv: -len(kv[0])):
        if upper.endswith(unit):
            return int(float(upper[:-len(unit)]) * factor)
    return int(upper)
