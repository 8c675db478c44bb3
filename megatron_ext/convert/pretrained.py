"""Published Hugging Face weights streamed straight into the shards this rank owns (``--pretrained``), with the
converters' family tables (``models/families.py``): one machinery for the tools and for training.

Every rank builds its model chunks for the real mesh (TP, SP, PP, VPP, EP, CP, DP), then reads only the HF
tensors of its own parameters: its pipeline stage's layers, its expert-parallel rank's experts, and of each
tensor-parallel parameter only the rows it holds where they are rows of the source (column-parallel weights,
the vocabulary, fused QKV and gate/up: ``_rows``), else the whole tensor, one at a time. Nothing is read before
the plan checks, identically on every rank (so rank 0 reports it), that the source and the model match one to one:
every shard's header is readable, every source tensor is used or known to be ignorable, every parameter is
written exactly once, every shape matches.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Dict, List, Optional, Sequence, Set, Tuple

import torch
import torch.distributed as dist

from megatron_ext.models import families
from megatron_ext.convert.common import SafetensorsReader
from megatron_ext.errors import ConfigError
from megatron_ext.models.init import full_shape, local_shape
from megatron_ext.models.sharding import global_named_parameters, local_shard, tp_group

EMBEDDING = "embedding.word_embeddings.weight"


def _all_ranks(local: dict) -> dict:
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    merged = {}
    for part in gathered:
        merged.update(part)
    return merged


def layer_of(name: str) -> Optional[int]:
    """The transformer layer a Hugging Face tensor belongs to (``model.layers.3.``, ``transformer.h.3.``,
    ``vit.encoder.layer.3.``), or None."""
    match = _HF_LAYER.search(name)
    return int(match[1]) if match else None


_HF_LAYER = re.compile(r"\.(?:layers|h|layer)\.(\d+)\.")


class HFWeights:
    """A Hugging Face checkpoint as the initial values of a model of ``shape`` (the run's: an MoE shape over a
    dense Qwen source upcycles it while reading)."""

    def __init__(self, directory: str, shape, seed: int, name: Optional[str] = None, first_layers: bool = False):
        name = name or directory
        flag = f"--pretrained {name}"  # messages name the source as given, and its files' directory once
        at = "--pretrained" if name == directory else f"{flag}:"
        model_type, family, _ = families.from_hf_config(directory, at)
        reader = SafetensorsReader(directory, at)
        source_shape = family.shape_from_hf(directory, at)
        if getattr(shape, "moe", None) is not None and source_shape.moe is None:
            from megatron_ext.convert.upcycle import UpcycledReader

            if dataclasses.replace(shape, moe=None, vocab_size=source_shape.vocab_size) != source_shape:
                raise ConfigError(f"{flag}: the MoE model's dense part is not the source's model; upcycling needs "
                                  "the same layers, widths and heads")
            reader, family = UpcycledReader(reader, shape, seed, flag=flag), families.TABLES[shape.model_type]
            self.upcycled = True
        else:
            self.upcycled = False
        self.reader, self.family, self.shape, self.flag = reader, family, shape, flag
        self.shapes = reader.check_files()  # every header, before anything is read
        names = reader.names()
        self.rules, self.record = family.source(shape, names, lambda n: torch.empty(self.shapes[n], device="meta"))
        self.by_mcore = {rule.mcore: rule for rule in self.rules}
        used = {name for rule in self.rules for name in rule.hf}
        absent = [name for name in sorted(used) if name not in self.shapes]
        if absent:
            raise ConfigError(f"{flag}: tensor {absent[0]} is missing ({len(absent)} missing); the source is not a "
                              f"complete {family.label} checkpoint of this config")
        unknown = [name for name in names if name not in used and not family.ignorable(name, shape)
                   and not (first_layers and layer_of(name) is not None and layer_of(name) >= shape.num_layers)]
        if unknown:
            raise ConfigError(f"{flag}: tensor {unknown[0]} ({len(unknown)} such) has no place in the model; the "
                              "config.json does not describe these weights")
        self.ctx = family.context(shape)

    def plan(self, params: Sequence[Tuple[str, str, torch.nn.Parameter, torch.nn.Module]],
             replaceable: Set[str] = frozenset()) -> Dict[str, Tuple[int, ...]]:
        """Check the source against every rank's parameters (collective); returns the parameters that start fresh
        (a ``replaceable`` head the source lacks or holds in another shape), by global name, with their shapes."""
        expected = _all_ranks({gname: tuple(full_shape(p)) for gname, _, p, _ in params})
        if hasattr(self.ctx, "padded_vocab") and EMBEDDING in expected:  # the run pads for its TP size
            self.ctx = dataclasses.replace(self.ctx, padded_vocab=expected[EMBEDDING][0])
        fresh = {}
        for gname in sorted(expected):
            rule = self.by_mcore.get(gname)
            if rule is None:
                if gname in replaceable:
                    fresh[gname] = expected[gname]
                    continue
                raise ConfigError(f"{self.flag}: the model's {gname} has no tensor in the source; the config.json "
                                  "does not describe these weights")
            built = rule.to_mcore([torch.empty(self.shapes[n], device="meta") for n in rule.hf], self.ctx, self.flag)
            if tuple(built.shape) != expected[gname]:
                if gname in replaceable:
                    fresh[gname] = expected[gname]
                    continue
                raise ConfigError(f"{self.flag}: {' + '.join(rule.hf)} give {gname} the shape {tuple(built.shape)}, "
                                  f"but the model's is {expected[gname]}; the config.json does not match the weights")
        unplaced = [rule for rule in self.rules if rule.mcore not in expected]
        if unplaced:
            raise ConfigError(f"{self.flag}: tensor {unplaced[0].hf[0]} ({len(unplaced)} such) has no parameter in "
                              "the model (--num-layers or another shape flag changed the model?)")
        return fresh

    @torch.no_grad()
    def value(self, gname: str, name: str, param: torch.nn.Parameter, chunk: torch.nn.Module) -> torch.Tensor:
        """This rank's slice of parameter ``gname`` (its TP shard), read from the source."""
        rule = self.by_mcore[gname]
        if rule.fuse is None and getattr(param, "tensor_model_parallel", False) and param.partition_dim == 1:
            width = local_shape(param)[1]  # a row-parallel weight as it is in the source: only its columns are copied
            start = width * dist.get_rank(tp_group(param))
            return self.reader.get_columns(rule.hf[0], start, start + width)
        rows = _rows(rule, self.shapes, self.ctx, name, param, chunk)
        if rows is not None:
            return self._read_rows(rule, rows, param)
        return local_shard(rule.to_mcore([self.reader.get(n) for n in rule.hf], self.ctx, self.flag), name, param,
                           chunk)

    def _read_rows(self, rule, rows: torch.Tensor, param) -> torch.Tensor:
        """Rows of the fused tensor by their source: ``rows[j]`` is k * STRIDE + r + 1 for row r of source k, 0 for
        a padding row (zero). Runs of consecutive rows are copied as blocks; one run covering every row is returned
        as the source's own (memory-mapped) rows, without a copy."""
        out = None
        for k, name in enumerate(rule.hf):
            mine = (rows > k * _STRIDE) & (rows <= (k + 1) * _STRIDE)
            if not mine.any():
                continue
            where = mine.nonzero().flatten()
            src = (rows[where] - k * _STRIDE - 1).long()
            breaks = ((where.diff() != 1) | (src.diff() != 1)).nonzero().flatten() + 1
            starts = [0, *breaks.tolist()]
            ends = [*breaks.tolist(), len(where)]
            if len(starts) == 1 and len(where) == len(rows):
                return self.reader.get_rows(name, int(src[0]), int(src[0]) + len(rows))
            if out is None:
                out = torch.zeros(local_shape(param), dtype=param.dtype)
            for a, b in zip(starts, ends):
                w, r = int(where[a]), int(src[a])
                out[w:w + b - a].copy_(self.reader.get_rows(name, r, r + b - a))
        return out if out is not None else torch.zeros(local_shape(param), dtype=param.dtype)


_STRIDE = 2**40  # row codes of ``_rows``: exact in float64


def _rows(rule, shapes: Dict[str, tuple], ctx, name: str, param, chunk) -> Optional[torch.Tensor]:
    """For a tensor-parallel parameter split along dim 0 (at any TP size) whose fuse only selects, orders and pads
    rows (vocabulary padding, QKV per group, [gate; up]), the source row of each of this rank's rows; None otherwise
    (read in full). Found by fusing row numbers instead of weights: no per-family code, and a fuse that is not
    row-wise changes the shape, which sends it to the full read."""
    if not getattr(param, "tensor_model_parallel", False) or param.partition_dim != 0:
        return None
    probes = []
    for k, n in enumerate(rule.hf):
        if len(shapes[n]) not in (1, 2):
            return None
        code = torch.arange(shapes[n][0], dtype=torch.float64) + (k * _STRIDE + 1)
        probes.append(code if len(shapes[n]) == 1 else code[:, None])
    try:
        fused = rule.fuse(probes, ctx) if rule.fuse else probes[0]
    except (RuntimeError, TypeError, ValueError, IndexError):  # not a row-wise fuse: read in full
        return None
    ndim = len(local_shape(param))
    if fused.ndim != ndim or fused.shape[1:] != (1,) * (ndim - 1) \
            or fused.shape[0] != full_shape(param)[0]:
        return None
    return local_shard(fused, name, param, chunk).flatten()


def values(weights: HFWeights, chunks: List[torch.nn.Module], replaceable: Set[str] = frozenset()):
    """Check ``weights`` against the chunks' parameters (collective), then ``(value, fresh)``: ``value(global name,
    name, parameter, chunk)`` gives this rank's slice of one parameter (zero for a fresh head), ``fresh`` the
    parameters that start afresh with their shapes."""
    params = [(gname, name, param, chunk) for chunk in chunks for gname, name, param in global_named_parameters(chunk)]
    fresh = weights.plan(params, replaceable)

    def value(gname: str, name: str, param: torch.nn.Parameter, chunk: torch.nn.Module) -> torch.Tensor:
        if gname in fresh:
            return torch.zeros(local_shape(param), dtype=param.dtype)
        return weights.value(gname, name, param, chunk)

    return value, fresh


def load(weights: HFWeights, chunks: List[torch.nn.Module], replaceable: Set[str] = frozenset()):
    """Fill every parameter of ``chunks`` (bare, before any engine wraps them); returns the fresh ones."""
    from megatron_ext.models.init import init_mesh_independent

    value, fresh = values(weights, chunks, replaceable)
    init_mesh_independent(chunks, 0, value)
    return fresh


def describe(fresh: Dict[str, Tuple[int, ...]]) -> str:
    return f"; new, zero-initialised: {', '.join(f'{n} {list(s)}' for n, s in sorted(fresh.items()))}" if fresh else ""


def resumes(checkpoint) -> bool:
    """--load holds a checkpoint of this run (``checkpoint``: the run's Checkpoint section): it resumes, and
    --pretrained is not read."""
    from megatron_ext.checkpoint.files import holds_checkpoints

    return checkpoint.resumes and holds_checkpoints(checkpoint.load)
