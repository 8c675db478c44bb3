"""The model families, one record each: the entry script that trains it, its flags (typed sections), its shape from
them, its builder, and its Hugging Face name maps by ``model_type`` (``TABLES``: the convert tools, ``--pretrained``
and ``--save-hf`` look a table up and hold no per-family branch). A new family: a package beside qwen/, vit/, gpt2/
and a row here. Torch-free at import: the flags read it before any process group exists.

A checkpoint's ``record`` is its common state: ``model_shape``, ``model_type``, ``hf_config`` (the source's
config.json), ``hf_files`` (other source files kept for the export) and whatever its family adds (ViT:
``num_classes``, None for a backbone).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Callable, Dict, Optional, Tuple, Type

from megatron_ext import config
from megatron_ext.config import rampup
from megatron_ext.config import Section, option
from megatron_ext.errors import ConfigError
from megatron_ext.flag_types import fraction, nonneg_int, positive_float
from megatron_ext.models import moe_flags
from megatron_ext.models.gpt2 import build as gpt2_build, config as gpt2_config, hf as gpt2_hf
from megatron_ext.models.gpt2.shape import GPT2Shape, gpt2_shape_from_hf_config
from megatron_ext.models.hf_rules import read_json
from megatron_ext.models.qwen import build as qwen_build, config as qwen_config, hf as qwen_hf
from megatron_ext.models.qwen.shape import QWEN_MODEL_TYPES, ModelShape, shape_from_hf_config
from megatron_ext.models.vit import build as vit_build, config as vit_config, hf as vit_hf
from megatron_ext.models.vit.shape import ViTShape, vit_shape_from_hf_config


@dataclasses.dataclass
class LoRA(Section):
    GROUP = qwen_config.LORA_GROUP
    lora_rank: int = option(0, type=nonneg_int, help="adapter rank; 0 trains every weight")
    lora_alpha: Optional[float] = option(None, type=positive_float, help="scale alpha/rank (default: alpha = rank)")
    lora_targets: str = option("qkv", help="comma list of qkv, proj, fc1, fc2")
    lora_dropout: float = option(0.0, type=fraction)


@dataclasses.dataclass(frozen=True)
class Table:
    """One Hugging Face ``model_type``'s name map (``models/<family>/hf.py``) and what conversion needs beside it."""

    label: str                 # in messages
    shape_type: type           # recorded as ``model_shape`` (its fields, dataclasses.asdict)
    shape_from_hf: Callable    # (config.json or its directory, flag) -> shape
    source: Callable           # (shape, HF tensor names, get tensor) -> (rules naming them, what to record)
    rules: Callable            # (shape, record) -> the name table of a checkpoint with that record
    context: Callable          # shape -> what the rules' fuse/split read
    build: Callable            # (shape, dtype, record) -> the single-process model, allocated, not initialised
    hf_config: Callable        # (shape, record, dtype) -> the export's config.json
    ignorable: Callable        # (HF tensor name, shape) -> True for a tensor that is dropped on import
    side_files: Optional[Callable] = None  # (shape, record) -> {file name: JSON} the export also writes
    carried: Tuple[str, ...] = ()  # source JSON files recorded (``hf_files``) for the export
    holds: Callable = lambda shape: True  # for checkpoints recording no model_type: is ``shape`` of this family?


def _table(label, hf, build, shape_type, shape_from_hf, **more) -> Table:
    return Table(label, shape_type, shape_from_hf, hf.source, hf.rules, hf.context, build, hf.hf_config, hf.ignorable,
                 **more)


@dataclasses.dataclass(frozen=True)
class Family:
    entry: str                       # the script that trains it (messages)
    model: Type[Section]             # its model flags; ``shape(training, moe)`` gives the shape
    data: Type[Section]              # its data flags; ``check_files()`` the local files
    presets: dict
    shape_from_hf: Callable          # (config.json or its directory, flag) -> shape
    build: Callable                  # (run, shape, device, ...) -> training.run.build_model's keywords
    model_types: Tuple[str, ...]     # what --pretrained may be
    tables: Dict[str, Table]         # the Hugging Face name maps it converts, by model_type
    more: Tuple[Type[Section], ...] = ()  # more model flags (LoRA, adapters)
    moe: bool = False                # the MoE flags (moe_flags)
    tokenizer: Optional[str] = None  # the default tokenizer (language families)
    training: Tuple[Type[Section], ...] = ()  # its own training flags (GPT: the batch ramp-up)
    objectives: bool = False         # trains any objective (objectives/: SFT, DPO, KTO, reward), not only its loss

    def sections(self) -> Tuple[Type[Section], ...]:
        """Its sections beside the model's and the data's, in the order they check themselves."""
        return (*self.more, *((moe_flags.MoESettings,) if self.moe else ()), *self.training)

    def add_model_flags(self, p: argparse.ArgumentParser) -> None:
        config.add_arguments(p, (self.model, *self.more))
        if self.moe:
            config.add_arguments(p, [moe_flags.MoESettings])

    def add_data_flags(self, p: argparse.ArgumentParser) -> None:
        config.add_arguments(p, [self.data])
        p.set_defaults(**self.data.shipped())


_QWEN = dict(shape_type=ModelShape, shape_from_hf=shape_from_hf_config, hf=qwen_hf, build=qwen_build.single_process)
# Qwen2ForCausalLM's table; Qwen2-MoE's adds the MoE layers' (router, per-expert and shared-expert rules); Qwen3's
# drops the QKV bias for the query and key norms (qwen/hf.py)
QWEN_TABLES = {model_type: _table(label, **_QWEN, holds=lambda shape, t=model_type: shape.model_type == t)
               for model_type, label in (("qwen2", "Qwen2"), ("qwen2_moe", "Qwen2-MoE"), ("qwen3", "Qwen3"),
                                         ("qwen3_moe", "Qwen3-MoE"))}
FAMILIES: Dict[str, Family] = {
    "qwen": Family("finetune_qwen.py", qwen_config.QwenModel, qwen_config.QwenData, qwen_config.PRESETS,
                   shape_from_hf_config, qwen_build.model, QWEN_MODEL_TYPES, QWEN_TABLES,
                   more=(LoRA, qwen_config.Adapters), moe=True, tokenizer="examples/tokenizers/tiny-qwen",
                   objectives=True),
    "vit": Family("pretrain_vit.py", vit_config.ViTModel, vit_config.ViTData, vit_config.VIT_PRESETS,
                  vit_shape_from_hf_config, vit_build.model, ("vit",),
                  {"vit": _table("ViT", vit_hf, vit_build.single_process, ViTShape, vit_shape_from_hf_config,
                                 side_files=vit_hf.side_files, carried=(vit_hf.PREPROCESSOR,))},
                  more=(LoRA,)),
    # GPT-2 from scratch, and continued pretraining of the Qwen models (their tables are Qwen's)
    "gpt": Family("pretrain_gpt.py", gpt2_config.GPTModel, gpt2_config.GPTData, gpt2_config.DECODER_PRESETS,
                  gpt2_config.decoder_shape_from_hf_config, gpt2_build.model, ("gpt2", *QWEN_MODEL_TYPES),
                  {"gpt2": _table("GPT-2", gpt2_hf, gpt2_build.single_process, GPT2Shape, gpt2_shape_from_hf_config)},
                  moe=True, tokenizer="examples/tokenizers/tiny-gpt2", training=(rampup.RampupFlags,)),
}
TABLES: Dict[str, Table] = {t: table for family in FAMILIES.values() for t, table in family.tables.items()}


def family_of(model_type: Optional[str]) -> str:
    """The family (its entry script) that trains a Hugging Face ``model_type``; Qwen's for one it does not know."""
    return next((name for name, family in FAMILIES.items() if model_type in family.tables), "qwen")


def _lookup(model_type, where: str) -> Table:
    if model_type not in TABLES:
        raise ConfigError(f"{where}: model_type {model_type!r} is not supported; supported: {', '.join(TABLES)}")
    return TABLES[model_type]


def from_hf_config(path: str, flag: str) -> Tuple[str, Table, dict]:
    """(model_type, table, config) of a Hugging Face ``config.json`` or the directory holding one."""
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    cfg = read_json(path, flag)
    return cfg.get("model_type"), _lookup(cfg.get("model_type"), f"{flag} {path}"), cfg


def from_record(record: dict, where: str) -> Tuple[Table, object]:
    """(table, shape) a checkpoint records; the family of older ones by their HF config, else their shape's fields."""
    if "model_shape" not in record:
        raise ConfigError(f"{where}: the checkpoint does not record its model; pass --hf-config")
    model_type = record.get("model_type") or (record.get("hf_config") or {}).get("model_type")
    if model_type is None:  # fields with a default (ModelShape.moe) may be absent from older records
        fields = set(record["model_shape"])
        model_type = next((key for key, table in TABLES.items()
                           if _required(table.shape_type) <= fields <= {f.name for f in
                                                                       dataclasses.fields(table.shape_type)}
                           and table.holds(table.shape_type(**record["model_shape"]))), None)
    table = _lookup(model_type, f"{where} (recorded in the checkpoint)")
    return table, table.shape_type(**record["model_shape"])


def _required(shape_type: type) -> set:
    return {f.name for f in dataclasses.fields(shape_type)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}


def carried_files(table: Table, directory: str, flag: str) -> Dict[str, dict]:
    """The family's side files present in a source directory, to record in the checkpoint."""
    paths = {name: os.path.join(directory, name) for name in table.carried}
    return {name: read_json(path, flag) for name, path in paths.items() if os.path.isfile(path)}
