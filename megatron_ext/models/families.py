"""The model families the converters know, by Hugging Face ``model_type``: one row each, the same fields in every
row, so tools/convert_*.py look a family up and hold no per-family branch (a new family: its name table + a row).

A checkpoint's ``record`` is its common state: ``model_shape``, ``model_type``, ``hf_config`` (the source's
config.json), ``hf_files`` (other source files kept for the export) and whatever its family adds (ViT:
``num_classes``, None for a backbone).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable, Dict, Optional, Tuple

from megatron_ext.convert import model
from megatron_ext.models.gpt2 import hf as gpt2
from megatron_ext.models.qwen import hf as qwen
from megatron_ext.models.vit import hf as vit
from megatron_ext.convert.common import read_json
from megatron_ext.errors import ConfigError
from megatron_ext.models.qwen.shape import ModelShape, shape_from_hf_config
from megatron_ext.models.vit.shape import ViTShape, vit_shape_from_hf_config
from megatron_ext.models.gpt2.shape import GPT2Shape, gpt2_shape_from_hf_config


@dataclasses.dataclass(frozen=True)
class Family:
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


_QWEN = dict(shape_type=ModelShape, shape_from_hf=shape_from_hf_config, source=qwen.source, rules=qwen.rules,
             context=qwen.context, build=model.single_process_qwen, hf_config=qwen.hf_config, ignorable=qwen.ignorable)
FAMILIES: Dict[str, Family] = {
    # Qwen2ForCausalLM's table; Qwen2-MoE's adds the MoE layers' (router, per-expert and shared-expert rules);
    # Qwen3's drops the QKV bias for the query and key norms (convert/qwen.py)
    **{model_type: Family(label=label, **_QWEN, holds=lambda shape, t=model_type: shape.model_type == t)
       for model_type, label in (("qwen2", "Qwen2"), ("qwen2_moe", "Qwen2-MoE"), ("qwen3", "Qwen3"),
                                 ("qwen3_moe", "Qwen3-MoE"))},
    "vit": Family(label="ViT", shape_type=ViTShape, shape_from_hf=vit_shape_from_hf_config, source=vit.source,
                  rules=vit.rules, context=vit.context, build=model.single_process_vit, hf_config=vit.hf_config,
                  ignorable=vit.ignorable, side_files=vit.side_files, carried=(vit.PREPROCESSOR,)),
    "gpt2": Family(label="GPT-2", shape_type=GPT2Shape, shape_from_hf=gpt2_shape_from_hf_config, source=gpt2.source,
                   rules=gpt2.rules, context=gpt2.context, build=model.single_process_gpt2, hf_config=gpt2.hf_config,
                   ignorable=gpt2.ignorable),
}


def _lookup(model_type, where: str) -> Family:
    if model_type not in FAMILIES:
        raise ConfigError(f"{where}: model_type {model_type!r} is not supported; supported: {', '.join(FAMILIES)}")
    return FAMILIES[model_type]


def from_hf_config(path: str, flag: str) -> Tuple[str, Family, dict]:
    """(model_type, family, config) of a Hugging Face ``config.json`` or the directory holding one."""
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    config = read_json(path, flag)
    return config.get("model_type"), _lookup(config.get("model_type"), f"{flag} {path}"), config


def from_record(record: dict, where: str) -> Tuple[Family, object]:
    """(family, shape) a checkpoint records; the family of older ones by their HF config, else their shape's fields."""
    if "model_shape" not in record:
        raise ConfigError(f"{where}: the checkpoint does not record its model; pass --hf-config")
    model_type = record.get("model_type") or (record.get("hf_config") or {}).get("model_type")
    if model_type is None:  # fields with a default (ModelShape.moe) may be absent from older records
        fields = set(record["model_shape"])
        model_type = next((key for key, family in FAMILIES.items()
                           if _required(family.shape_type) <= fields <= {f.name for f in
                                                                        dataclasses.fields(family.shape_type)}
                           and family.holds(family.shape_type(**record["model_shape"]))), None)
    family = _lookup(model_type, f"{where} (recorded in the checkpoint)")
    return family, family.shape_type(**record["model_shape"])


def _required(shape_type: type) -> set:
    return {f.name for f in dataclasses.fields(shape_type)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}


def carried_files(family: Family, directory: str, flag: str) -> Dict[str, dict]:
    """The family's side files present in a source directory, to record in the checkpoint."""
    paths = {name: os.path.join(directory, name) for name in family.carried}
    return {name: read_json(path, flag) for name, path in paths.items() if os.path.isfile(path)}
