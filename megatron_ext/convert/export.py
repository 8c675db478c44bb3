"""``--save-hf DIR``: the trained model as a directory transformers loads as it is, written at the end of training
by the ranks that hold it, through the same family tables as the converters.

One parameter at a time: each is made whole over tensor parallelism (and gathered from ZeRO-3 or FSDP shards), then
written by the one rank that owns it (TP rank 0 and data-parallel rank 0 of its pipeline stage, or of its expert
group) into that rank's own safetensors files; rank 0 then names the files ``model-0000k-of-0000n.safetensors``,
writes the index, config.json, generation_config.json, the tokenizer and the family's side files. No rank holds
more than one shard. Vocabulary padding is removed; LoRA adapters are merged first; a tied embedding is written
once. The directory appears complete or not at all (written beside it, then renamed); an earlier export in it is
replaced.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Iterator, Optional, Tuple

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from megatron_ext.convert import families
from megatron_ext.convert.common import DTYPES
from megatron_ext.convert.source import EXPORT_MARK
from megatron_ext.models.sharding import gather_full, global_named_parameters, is_expert, parameter_pieces, unwrap

MAX_SHARD_BYTES = 2**30  # per file: what a writing rank holds at most besides its model
GENERATION_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def _parameters(engine) -> Iterator[Tuple[str, str, torch.Tensor, torch.nn.Parameter, torch.nn.Module]]:
    """(global name, name, this TP rank's whole tensor, the parameter with its TP attributes, chunk) of every
    parameter, the same order on every rank of a stage; collectives inside for ZeRO-3 and FSDP shards."""
    if hasattr(engine, "layout"):  # FSDP: DTensors over DP, TP attributes kept in the engine's layout
        for name, param in engine.module.named_parameters():
            for piece, tensor in parameter_pieces(engine.module, name, param.full_tensor()):
                gname, before = engine.layout[piece]
                yield gname, piece, tensor, before, engine.module
        return
    if hasattr(engine, "megatron_chunk"):  # DeepSpeed: ZeRO-3 partitions are gathered one parameter at a time
        import deepspeed

        chunk = engine.megatron_chunk
        stage3 = engine.engine.zero_optimization_stage() == 3
        for gname, name, param in global_named_parameters(chunk):
            with deepspeed.zero.GatheredParameters([param], enabled=stage3):
                yield gname, name, param.data, param, chunk
        return
    for chunk in engine.model:
        for gname, name, param in global_named_parameters(unwrap(chunk)):
            yield gname, name, param.data, param, unwrap(chunk)


def _writes(param: torch.nn.Parameter) -> bool:
    """This rank writes ``param``: tensor-parallel rank 0 and data-parallel rank 0 of its group."""
    from megatron.core import parallel_state as ps

    if is_expert(param):
        return ps.get_expert_tensor_parallel_rank() == 0 and ps.get_expert_data_parallel_rank() == 0
    return ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank(with_context_parallel=True) == 0


class _RankFiles:
    """This rank's part of the export: files of at most ``MAX_SHARD_BYTES``."""

    def __init__(self, directory: str):
        self.directory, self.pending, self.size, self.files = directory, {}, 0, []

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.size + size > MAX_SHARD_BYTES:
            self.flush()
        self.pending[name] = tensor.contiguous()
        self.size += size

    def flush(self) -> None:
        if self.pending:
            file = f"rank{dist.get_rank():05d}-{len(self.files):05d}.safetensors"
            save_file(self.pending, os.path.join(self.directory, file), metadata={"format": "pt"})
            self.files.append((file, list(self.pending), self.size))
            self.pending, self.size = {}, 0


def save_hf(engine, out: str, *, model_meta: dict, dtype: torch.dtype, tokenizer: Optional[str] = None,
            source_dir: Optional[str] = None, lora: bool = False) -> str:
    """Write the model of ``engine`` to ``out`` (collective over every rank); returns the line rank 0 prints."""
    family = families.FAMILIES[model_meta["model_type"]]
    shape = family.shape_type(**model_meta["model_shape"])
    record = dict(model_meta)
    if source_dir is not None:
        record["hf_files"] = families.carried_files(family, source_dir, "--pretrained")
    rules = {rule.mcore: rule for rule in family.rules(shape, record)}
    ctx = family.context(shape)
    if lora:  # adapters folded into their base weights: the export is a plain model
        from megatron_ext.models import lora as lora_module

        lora_module.merge([unwrap(c) for c in engine.model])
    partial = out.rstrip("/") + ".partial"
    if dist.get_rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)
        os.makedirs(partial)
    dist.barrier()
    files = _RankFiles(partial)
    for gname, name, tensor, param, chunk in _parameters(engine):
        if name == "output_layer.weight" and getattr(chunk, "share_embeddings_and_output_weights", False):
            continue  # the last stage's copy of the tied embedding: written once, by the first stage
        full = gather_full(tensor, name, param, chunk)
        if _writes(param):
            for hf_name, value in zip(rules[gname].hf, rules[gname].to_hf(full, ctx)):
                files.add(hf_name, value.to(dtype, copy=True))  # never a view of a parameter's buffer
    files.flush()
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, files.files)
    if dist.get_rank() == 0:
        total = _finish(partial, out, [f for part in everyone for f in part], family, shape, record, dtype,
                        tokenizer, source_dir)
        message = (f"megatron_ext: Hugging Face model written to --save-hf {out} "
                   f"({str(dtype).replace('torch.', '')}, {total / 2**30:.2f} GiB)")
    else:
        message = ""
    dist.barrier()
    return message


def _finish(partial: str, out: str, files, family, shape, record: dict, dtype, tokenizer, source_dir) -> int:
    """Rank 0: final shard names, index, config and side files; then the directory replaces ``out``."""
    weight_map, total = {}, 0
    for k, (file, names, size) in enumerate(files):
        final = "model.safetensors" if len(files) == 1 else f"model-{k + 1:05d}-of-{len(files):05d}.safetensors"
        os.replace(os.path.join(partial, file), os.path.join(partial, final))
        weight_map.update({name: final for name in names})
        total += size
    if len(files) > 1:
        _write_json(partial, "model.safetensors.index.json", {"metadata": {"total_size": total},
                                                              "weight_map": weight_map})
    config = family.hf_config(shape, record, dtype)
    _write_json(partial, "config.json", config)
    for name, content in (family.side_files(shape, record) if family.side_files else {}).items():
        _write_json(partial, name, content)
    generation = os.path.join(source_dir or "", "generation_config.json")
    if source_dir is not None and os.path.isfile(generation):
        with open(generation) as f:
            generation = json.load(f)
    else:
        generation = {k: config[k] for k in GENERATION_FIELDS if config.get(k) is not None} if tokenizer else None
    if tokenizer is not None:
        generation = stop_at_turn_end(generation, _save_tokenizer(tokenizer, partial))
    if generation is not None:
        _write_json(partial, "generation_config.json", generation)
    _write_json(partial, EXPORT_MARK, {"model_type": record.get("model_type"), "dtype": str(dtype)})
    old = out.rstrip("/") + ".old"
    if os.path.isdir(out):  # an earlier export (``source.check_export_dir``) or an empty directory
        os.replace(out, old)
    os.replace(partial, out)
    shutil.rmtree(old, ignore_errors=True)
    return total


def stop_at_turn_end(generation: Optional[dict], end: Optional[int]) -> Optional[dict]:
    """A generation config that also stops at the chat template's end of turn: a chat fine-tune of a base model
    (whose EOS is ``<|endoftext|>``) ends its answers with ``<|im_end|>``, and would otherwise never stop."""
    if generation is None or end is None:
        return generation
    eos = generation.get("eos_token_id")
    eos = [] if eos is None else eos if isinstance(eos, list) else [eos]
    return dict(generation, eos_token_id=eos if end in eos else eos + [end])


def _save_tokenizer(path: str, directory: str) -> Optional[int]:
    """The tokenizer (with its chat template) into the export; returns ``turn_end(tokenizer)``."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError) as e:  # e.g. a source with no tokenizer files, under --mock-data
        print(f"megatron_ext: --save-hf: no tokenizer written ({path}: {str(e).splitlines()[0][:120]})")
        return None
    tokenizer.save_pretrained(directory)
    return turn_end(tokenizer)


def turn_end(tokenizer) -> Optional[int]:
    """The special token closing an assistant turn in the tokenizer's chat template (``<|im_end|>``), or None."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    from megatron_ext.data import chat

    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    try:
        pieces = chat.trained_pieces(tokenizer, messages, None, "assistant")
    except Exception:  # a template that cannot render this minimal chat: nothing to add
        return None
    ids = tokenizer([text for text, trained in pieces if trained][-1], add_special_tokens=False)["input_ids"]
    special = [t for t in ids if t in set(tokenizer.all_special_ids)]
    return special[-1] if special else None


def _write_json(directory: str, name: str, content: dict) -> None:
    with open(os.path.join(directory, name), "w") as f:
        json.dump(content, f, indent=2)


def check_exportable(model_meta: dict, dtype: torch.dtype) -> None:
    """ConfigError now for a model --save-hf could not write (e.g. an MoE without the shared expert Qwen2-MoE has)."""
    family = families.FAMILIES[model_meta["model_type"]]
    family.hf_config(family.shape_type(**model_meta["model_shape"]), model_meta, dtype)


def export_dtype(args) -> torch.dtype:
    """--save-hf-dtype, else the run's (--bf16/--fp16, else fp32)."""
    if args.save_hf_dtype:
        return DTYPES[args.save_hf_dtype]
    return torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32

