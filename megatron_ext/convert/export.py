"""``--save-hf DIR``: the trained model as a directory transformers loads as it is, written at the end of training
by the ranks that hold it, through the same family tables as the converters.

Each parameter is written by the one rank that owns it (TP rank 0 and data-parallel rank 0 of its pipeline stage,
or of its expert group) into that rank's own safetensors files, planned before any value is read and written as
values arrive (``convert/stream.py``): a parameter exported as its leading rows (the embedding and output layer
without their vocabulary padding, any tensor exported as it is) is streamed from the ranks holding its parts (TP
shards, ZeRO-3 or FSDP pieces) a block at a time, never gathered; any other (fused QKV, [gate; up], transposed
Conv1D) is made whole one at a time (over TP, and from ZeRO-3 or FSDP shards) and freed before the next. No rank
holds more than its own shards plus one such parameter. Rank 0 then names the files
``model-0000k-of-0000n.safetensors``, writes the index, config.json, generation_config.json, the tokenizer and the
family's side files. Vocabulary padding is removed; LoRA adapters are merged first; a tied embedding is written
once. The directory appears complete or not at all (written beside it, then renamed); an earlier export in it is
replaced.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import shutil
from typing import Callable, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron_ext.convert import stream
from megatron_ext.models import families
from megatron_ext.convert.common import DTYPES
from megatron_ext.convert.source import EXPORT_MARK
from megatron_ext.data.chat import turn_end
from megatron_ext.models.init import local_shape
from megatron_ext.models.sharding import (_is_gated_fc1, gather_full, global_named_parameters, is_expert,
                                          parameter_pieces, plain_name, tp_world_size, unwrap)

MAX_SHARD_BYTES = 2**30  # per file (the files are written as values arrive: no rank holds one)
GENERATION_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")


@dataclasses.dataclass
class _Param:
    """One parameter of an engine: its pieces (itself, or grouped experts' per-expert weights) as (global name,
    name, a tensor with its TP attributes, chunk, TP-local shape); ``whole()`` their TP-local values (collective
    over DP for ZeRO-3 and FSDP); ``parts()`` (the parameter itself only) the global ranks of its DP group, the
    elements of DP part d, and this rank's part, flat."""
    pieces: List[Tuple[str, str, torch.Tensor, torch.nn.Module, torch.Size]]
    whole: Callable
    parts: Optional[Callable] = None
    replica: bool = False  # a DP replica of a whole (megatron, ZeRO-1/2) parameter other than DP rank 0's: skipped


def size(num_bytes: int) -> str:
    """Bytes in the unit that reads best: 283.3 KiB, 1.42 GiB."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.3g} {unit}" if num_bytes < 100 * scale else f"{num_bytes / scale:.0f} {unit}"
    return f"{num_bytes} bytes"


def _dp_rank(param) -> int:
    from megatron.core import parallel_state as ps

    return ps.get_expert_data_parallel_rank() if is_expert(param) else \
        ps.get_data_parallel_rank(with_context_parallel=True)


def _parameters(engine) -> Iterator[_Param]:
    """Every parameter of ``engine``, the same order on every rank of a stage; nothing is gathered here."""
    me = dist.get_rank()
    if hasattr(engine, "layout"):  # FSDP: DTensors sharded by rows over DP, TP attributes kept in the layout
        module = engine.module
        for name, param in module.named_parameters():
            meta = torch.empty(param.shape, device="meta")  # the pieces' shapes, and the layout's TP attributes
            pieces = [(engine.layout[piece][0], piece, engine.layout[piece][1], module, view.shape)
                      for piece, view in parameter_pieces(module, name, meta)]
            whole = functools.partial(_fsdp_whole, module, name, param)
            yield _Param(pieces, whole, functools.partial(_fsdp_parts, param) if len(pieces) == 1 else None)
        return
    if hasattr(engine, "megatron_chunk"):  # DeepSpeed: ZeRO-3 partitions gathered one parameter at a time
        chunk, stage3 = engine.megatron_chunk, engine.engine.zero_optimization_stage() == 3
        for gname, name, param in global_named_parameters(chunk):
            piece = [(gname, name, param, chunk, local_shape(param))]
            if stage3:
                part = getattr(param, "ds_tensor", None)
                resident = part is not None and getattr(part, "final_location", None) is None  # not on NVMe
                yield _Param(piece, lambda param=param: _gathered(param),
                             functools.partial(_zero3_parts, param) if resident else None)
            else:
                yield _plain(piece, param, me)
        return
    _weights_current(engine)
    for chunk in engine.model:
        for gname, name, param in global_named_parameters(unwrap(chunk)):
            yield _plain([(gname, name, param, unwrap(chunk), param.shape)], param, me)


def _weights_current(engine) -> None:
    """The megatron engine's last distributed-optimizer step all-gathered (it overlaps the next forward otherwise);
    other engines, and bare model chunks, are current."""
    if hasattr(engine, "finish_param_sync"):
        engine.finish_param_sync()


def _plain(piece, param, me: int) -> _Param:
    parts = None
    if isinstance(param, torch.nn.Parameter):  # not a grouped expert's (strided) view
        parts = lambda: ([me], lambda d: param.numel(), param.data.reshape(-1))  # noqa: E731
    return _Param(piece, lambda: contextlib.nullcontext([param.data]), parts, replica=_dp_rank(param) != 0)


def _fsdp_whole(module, name: str, param):
    return contextlib.nullcontext([t for _, t in parameter_pieces(module, name, param.full_tensor())])


@contextlib.contextmanager
def _gathered(param):
    import deepspeed

    with deepspeed.zero.GatheredParameters([param]):
        yield [param.data]


def _zero3_parts(param):
    """DeepSpeed's layout: the flattened parameter cut in equal parts over its DP group, the last padded."""
    size, total = param.ds_tensor.ds_numel, param.ds_numel
    ranks = dist.get_process_group_ranks(param.ds_process_group)
    numel = lambda d: max(0, min(size, total - d * size))  # noqa: E731
    return ranks, numel, param.ds_tensor.reshape(-1)[:numel(dist.get_rank(param.ds_process_group))]


def _fsdp_parts(param):
    """fully_shard's Shard(0): torch.chunk's split of the rows over the DP mesh."""
    group = param.device_mesh.get_group()
    rows, width = param.shape[0], math.prod(param.shape[1:])
    per = -(-rows // group.size())
    numel = lambda d: max(0, min(per, rows - d * per)) * width  # noqa: E731
    return dist.get_process_group_ranks(group), numel, param.to_local().reshape(-1)[:numel(dist.get_rank(group))]


def _tp_whole(shape, param) -> Tuple[int, ...]:
    shape = list(shape)
    if getattr(param, "tensor_model_parallel", False):
        shape[param.partition_dim] *= tp_world_size(param)
    return tuple(shape)


def _writes(param: torch.nn.Parameter) -> bool:
    """This rank writes ``param``: tensor-parallel rank 0 and data-parallel rank 0 of its group."""
    from megatron.core import parallel_state as ps

    tp = ps.get_expert_tensor_parallel_rank() if is_expert(param) else ps.get_tensor_model_parallel_rank()
    return tp == 0 and _dp_rank(param) == 0


def _tp_peers() -> List[dict]:
    """For every global rank, the global ranks of its TP and expert-TP groups, in group order."""
    from megatron.core import parallel_state as ps

    expert = ps.get_expert_tensor_parallel_group(check_initialized=False)
    mine = {"tp": dist.get_process_group_ranks(ps.get_tensor_model_parallel_group()),
            "etp": dist.get_process_group_ranks(expert) if expert is not None else [dist.get_rank()]}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


def _stream(p: _Param, files, hf_name: str, rows: int, peers: List[dict]) -> None:
    """A parameter exported as its leading ``rows``, from the parts of the ranks holding it (``stream_rows``)."""
    _, _, param, _, shape = p.pieces[0]
    kind = "etp" if is_expert(param) else "tp"
    split = getattr(param, "tensor_model_parallel", False)
    tp_ranks = peers[dist.get_rank()][kind]
    if not split and tp_ranks.index(dist.get_rank()) != 0:
        return  # replicated over TP: TP rank 0's parts make it
    ranks, numel, mine = p.parts()
    holders = [(peers[ranks[d]][kind][t], numel(d)) for t in (range(len(tp_ranks)) if split else [0])
               for d in range(len(ranks))]
    full = _tp_whole(shape, param)
    stream.stream_rows(files, hf_name, rows * math.prod(full[1:]), holders, mine)


def save_hf(engine, out: str, *, model_meta: dict, dtype: torch.dtype, tokenizer: Optional[str] = None,
            source_dir: Optional[str] = None, lora: bool = False) -> str:
    """Write the model of ``engine`` to ``out`` (collective over every rank); returns the line rank 0 prints."""
    family = families.TABLES[model_meta["model_type"]]
    shape = family.shape_type(**model_meta["model_shape"])
    record = dict(model_meta)
    if source_dir is not None:
        record["hf_files"] = families.carried_files(family, source_dir, "--pretrained")
    rules = {rule.mcore: rule for rule in family.rules(shape, record)}
    ctx = family.context(shape)
    _weights_current(engine)  # (before the adapters are folded in below, which reads them)
    if lora:  # adapters folded into their base weights: the export is a plain model
        from megatron_ext.models import lora as lora_module

        lora_module.merge([unwrap(c) for c in engine.model])
        if hasattr(engine, "layout"):  # FSDP's names: the base linears are back in their places
            engine.layout = {plain_name(n): (plain_name(g), p)
                             for n, (g, p) in engine.layout.items() if ".lora_" not in n}
    partial = out.rstrip("/") + ".partial"
    if dist.get_rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)
        os.makedirs(partial)
    dist.barrier()
    params = list(_parameters(engine))
    for p in params:  # the last stage's copy of a tied embedding: written once, by the first stage
        p.pieces = [x for x in p.pieces if not (x[1] == "output_layer.weight"
                                                and getattr(x[3], "share_embeddings_and_output_weights", False))]
    entries = []  # every tensor this rank writes, before any is read: the files' headers come first
    for p in params:
        for gname, _, param, _, piece_shape in p.pieces:
            if _writes(param):
                meta = torch.empty(_tp_whole(piece_shape, param), device="meta")
                entries += [(n, tuple(t.shape)) for n, t in zip(rules[gname].hf, rules[gname].to_hf(meta, ctx))]
    files = stream.RankFiles(partial, f"rank{dist.get_rank():05d}", entries, dtype, MAX_SHARD_BYTES)
    peers = _tp_peers()
    for p in params:
        if p.replica or not p.pieces:
            continue
        gname, name, param, chunk, piece_shape = p.pieces[0]
        rows = None
        split = getattr(param, "tensor_model_parallel", False)
        if p.parts is not None and (not split or param.partition_dim == 0 and not _is_gated_fc1(name, param, chunk)):
            rows = stream.row_prefix(rules[gname], ctx, _tp_whole(piece_shape, param))
        if rows is not None:
            _stream(p, files, rules[gname].hf[0], rows, peers)
            continue
        with p.whole() as tensors:
            for (gname, name, param, chunk, _), tensor in zip(p.pieces, tensors):
                full = gather_full(tensor, name, param, chunk)
                if _writes(param):
                    for hf_name, value in zip(rules[gname].hf, rules[gname].to_hf(full, ctx)):
                        files.write(hf_name, value)
                del full
    files.close()
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, files.files)
    if dist.get_rank() == 0:
        total = _finish(partial, out, [f for part in everyone for f in part], family, shape, record, dtype,
                        tokenizer, source_dir)
        message = (f"megatron_ext: Hugging Face model written to --save-hf {out} "
                   f"({str(dtype).replace('torch.', '')}, {size(total)})")
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
    if getattr(shape, "head", "lm") == "score" and config.get("pad_token_id") is None and tokenizer is not None:
        from transformers import AutoTokenizer  # a sequence classifier finds each row's last token by its padding

        config["pad_token_id"] = AutoTokenizer.from_pretrained(tokenizer).pad_token_id
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


def _write_json(directory: str, name: str, content: dict) -> None:
    with open(os.path.join(directory, name), "w") as f:
        json.dump(content, f, indent=2)


def check_exportable(model_meta: dict, dtype: torch.dtype) -> None:
    """ConfigError now for a model --save-hf could not write (e.g. an MoE without the shared expert Qwen2-MoE has)."""
    family = families.TABLES[model_meta["model_type"]]
    family.hf_config(family.shape_type(**model_meta["model_shape"]), model_meta, dtype)


def export_dtype(run) -> torch.dtype:
    """--save-hf-dtype, else the run's (--bf16/--fp16, else fp32)."""
    if run.pretrained.save_hf_dtype:
        return DTYPES[run.pretrained.save_hf_dtype]
    return run.training.compute_dtype

