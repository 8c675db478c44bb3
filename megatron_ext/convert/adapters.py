"""LoRA adapters in PEFT's format: out with ``--save-peft DIR`` (what ``peft.PeftModel.from_pretrained`` loads onto
the base model in transformers), in with ``--pretrained-adapter DIR`` (ours, or one trained with PEFT).

PEFT adapts each Hugging Face linear on its own (``q_proj``, ``k_proj``, ``v_proj``, ``gate_proj``, ``up_proj``);
ours sit on megatron-core's fused linears (``linear_qkv``, ``linear_fc1``), and the family's name table says which
HF linears a fused one is made of. Out: the fused adapter's B is split into its parts' rows by that table's own rule
and each part gets the same A, which is exact (the rows of B A are B_q A, B_k A, B_v A). In: parts sharing their A
(an adapter of ours) come back at rank r; parts with their own A (PEFT's) are stacked, A = [A_q; A_k; A_v] at rank
3r with B block-diagonal, exact as well (the target's rank is recorded: ``LoRAConfig.target_ranks``); a part the
adapter leaves out is zero. Written by rank 0 from the adapters gathered whole (they are small).

Routed experts: ``convert/peft_experts.py``.

Reward models: the score head trains whole beside the adapters, which PEFT writes as a module to save
(``base_model.model.score.weight``, ``task_type="SEQ_CLS"``); it goes out and comes back with the adapters.
"""

from __future__ import annotations

import os
import shutil
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron_ext.models import families
from megatron_ext.models.hf_rules import Rule, read_json
from megatron_ext.convert.peft_experts import PREFIX, fuse_experts, split_experts
from megatron_ext.errors import ConfigError
from megatron_ext.models.reward import SCORE  # a reward model's score head

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
WHOLE = ("score.weight",)  # PEFT's modules_to_save that we read: the score head (Hugging Face's name)
FLAG = "--pretrained-adapter"


def _base(gname: str) -> str:
    return gname.replace(".lora_a.", ".").replace(".lora_b.", ".")


def _modules(rule: Rule) -> List[str]:
    """The HF linears (module paths) a megatron-core linear's weight is made of."""
    return [name[:-len(".weight")] for name in rule.hf]


def _target_of(mcore: str) -> Optional[str]:
    """Our LoRA target a layer's linear weight belongs to (``...linear_fc1.weight``: fc1, the routed and shared
    experts' too), or None."""
    from megatron_ext.models.lora import TARGETS

    for target, path in TARGETS.items():
        if mcore.startswith("decoder.layers.") and mcore.endswith(f".{path.rsplit('.', 1)[1]}.weight"):
            return target
    return None


def _target_rules(family, shape, record) -> List[Tuple[str, Rule]]:
    """(our target, the rule of its base weight) of every targetable linear of every layer."""
    return [(_target_of(rule.mcore), rule) for rule in family.rules(shape, record) if _target_of(rule.mcore)]


# ---- out ----

def _reward(shape) -> bool:
    return getattr(shape, "head", "lm") == "score"


def gather_adapters(engine, reward: bool = False) -> Dict[str, torch.Tensor]:
    """Every adapter tensor of ``engine`` (and a ``reward`` model's score head), whole (TP=1) and on the CPU, under
    its global name, on rank 0 (collective: every rank of every stage takes part)."""
    from megatron_ext.convert.export import _parameters, _writes
    from megatron_ext.models.sharding import gather_full

    def _saved(gname: str) -> bool:
        return ".lora_" in gname or (reward and gname == SCORE)

    mine = {}
    for p in _parameters(engine):
        if not any(_saved(piece[0]) for piece in p.pieces):
            continue
        with p.whole() as tensors:
            for (gname, name, param, chunk, _), tensor in zip(p.pieces, tensors):
                if _saved(gname):
                    full = gather_full(tensor, name, param, chunk)
                    if _writes(param):
                        mine[gname] = full.detach().to("cpu", copy=True)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return {k: v for part in everyone for k, v in part.items()} if dist.get_rank() == 0 else {}


def to_peft(adapters: Dict[str, torch.Tensor], lora, family, shape,
            record) -> Tuple[Dict[str, torch.Tensor], List[str], List[str]]:
    """PEFT's tensors (``base_model.model.<module>.lora_{A,B}.weight``) of our full adapters, its
    ``target_modules`` and ``target_parameters`` (routed experts)."""
    rules = {rule.mcore: rule for rule in family.rules(shape, record)}
    ctx = family.context(shape)
    out = {}
    if SCORE in adapters:  # PEFT's modules_to_save, written under the module's own name
        out[PREFIX + rules[SCORE].hf[0]] = adapters[SCORE].clone()
    for gname in sorted(adapters):
        if ".lora_a." not in gname:
            continue
        rule = rules[_base(gname)]
        a, b = adapters[gname], adapters[gname.replace(".lora_a.", ".lora_b.")]
        modules = _modules(rule)
        stacked = a.shape[0] != lora.rank  # one block of A and B's columns per part (``from_peft``)
        parts_b = rule.to_hf(b, ctx)
        for k, (module, part_b) in enumerate(zip(modules, parts_b)):
            block = slice(k * lora.rank, (k + 1) * lora.rank) if stacked else slice(None)
            out[f"{PREFIX}{module}.lora_A.weight"] = a[block].clone()  # one tensor per part: no shared storage
            out[f"{PREFIX}{module}.lora_B.weight"] = part_b[:, block].contiguous()
    out, parameters = fuse_experts(out, lora.rank)
    modules = sorted({k[len(PREFIX):].rsplit(".", 2)[0].rsplit(".", 1)[-1] for k in out if ".lora_" in k
                      and not k[len(PREFIX):].rsplit(".", 2)[0].endswith(("experts", "base_layer"))})
    return out, modules, parameters


def save_peft(engine, out: str, *, lora, model_meta: dict, base: Optional[str], dtype: torch.dtype) -> str:
    """Write the adapters of ``engine`` to ``out`` as a PEFT LoRA adapter (collective); the line rank 0 prints."""
    from peft import LoraConfig
    from safetensors.torch import save_file

    family = families.TABLES[model_meta["model_type"]]
    shape = family.shape_type(**model_meta["model_shape"])
    reward = _reward(shape)
    adapters = gather_adapters(engine, reward)
    message = ""
    if dist.get_rank() == 0:
        tensors, targets, parameters = to_peft(adapters, lora, family, shape, model_meta)
        tensors = {k: v.to(dtype) for k, v in tensors.items()}
        partial = out.rstrip("/") + ".partial"
        shutil.rmtree(partial, ignore_errors=True)
        os.makedirs(partial)
        LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=targets or None,
                   target_parameters=parameters or None, task_type="SEQ_CLS" if reward else "CAUSAL_LM",
                   modules_to_save=["score"] if reward else None,
                   base_model_name_or_path=base).save_pretrained(partial)
        save_file(tensors, os.path.join(partial, WEIGHTS), metadata={"format": "pt"})
        if os.path.isdir(out):  # an earlier adapter (check_save_dir refused anything else at start-up)
            shutil.rmtree(out)
        os.replace(partial, out)
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        message = (f"megatron_ext: PEFT LoRA adapter written to --save-peft {out} (r={lora.rank}, "
                   f"{','.join(targets + parameters)}{', the score head' if reward else ''}; "
                   f"{size / 2**20:.1f} MiB)")
    dist.barrier()
    return message


def check_expressible(shape, lora) -> None:
    """peft (0.21, on transformers 5) reads a Qwen3-MoE adapter's gate_proj/up_proj/down_proj targets as the experts'
    transformers-4 names and fuses them into the expert parameters: the MLP adapters of the model's dense layers
    (``mlp_only_layers``; the published Qwen3-MoE models have none) cannot be written by name. One line at start-up."""
    moe = getattr(shape, "moe", None)
    if (getattr(shape, "model_type", None) == "qwen3_moe" and 0 in moe.pattern(shape.num_layers)
            and {"fc1", "fc2"} & set(lora.targets)):
        raise ConfigError("--save-peft: peft reads a Qwen3-MoE adapter's gate_proj/up_proj/down_proj as its experts' "
                          "(transformers 4's names), so the MLP adapters of this model's dense layers "
                          "(mlp_only_layers) cannot be written; drop fc1,fc2 from --lora-targets or --save-peft")


def check_save_dir(path: Optional[str]) -> None:
    """--save-peft replaces an earlier adapter only: a directory holding anything else is refused at start-up."""
    if path and os.path.isdir(path) and os.listdir(path) and not os.path.isfile(os.path.join(path, CONFIG)):
        raise ConfigError(f"--save-peft {path} holds files that are not a PEFT adapter; choose a new or empty "
                          "directory")
    if path and os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"--save-peft {path} is a file, not a directory")


# ---- in ----

def read_config(directory: str, lora_flags, pretrained: Optional[str]) -> dict:
    """``adapter_config.json`` of ``--pretrained-adapter``, checked against the flags (no torch needed)."""
    path = os.path.join(directory, CONFIG)
    if not os.path.isfile(path):
        raise ConfigError(f"{FLAG} {directory}: no {CONFIG} there; give a directory PEFT's save_pretrained wrote")
    config = read_json(path, FLAG)
    if config.get("peft_type") != "LORA":
        raise ConfigError(f"{FLAG} {directory}: a {config.get('peft_type')} adapter; only LoRA adapters load")
    for key, what in (("use_dora", "DoRA"), ("use_rslora", "rank-stabilised scaling"), ("rank_pattern", "per-module ranks"),
                      ("alpha_pattern", "per-module alphas")):
        if config.get(key):
            raise ConfigError(f"{FLAG} {directory}: uses {what} ({key}), which megatron_ext's LoRA does not have")
    if lora_flags.lora_rank and lora_flags.lora_rank != config["r"]:
        raise ConfigError(f"--lora-rank {lora_flags.lora_rank} but {FLAG} {directory} has rank {config['r']}; drop "
                          "--lora-rank (the adapter sets it)")
    if lora_flags.lora_alpha is not None and lora_flags.lora_alpha != config["lora_alpha"]:
        raise ConfigError(f"--lora-alpha {lora_flags.lora_alpha} but {FLAG} {directory} has {config['lora_alpha']}; "
                          "drop --lora-alpha (the adapter sets it)")
    base, given = config.get("base_model_name_or_path"), pretrained
    if base and given and _model_name(base) != _model_name(given):
        raise ConfigError(f"{FLAG} {directory} was trained on {base}, not on --pretrained {given}; start from "
                          f"--pretrained {base}")
    return config


def _model_name(path: str) -> str:
    """Hub id or local copy of it: compared by the last part of the name."""
    return os.path.basename(os.path.normpath(path)).lower()


def _load_tensors(directory: str) -> Dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    path = os.path.join(directory, WEIGHTS)
    if not os.path.isfile(path):
        raise ConfigError(f"{FLAG} {directory}: no {WEIGHTS} there (an adapter_model.bin is not read: save it "
                          "again with safe_serialization)")
    return load_file(path)


def _by_module(directory: str, config: dict) -> Dict[str, Dict[str, torch.Tensor]]:
    """{HF module path: {"A": tensor, "B": tensor}} of an adapter's safetensors, routed experts per expert."""
    by_module: Dict[str, Dict[str, torch.Tensor]] = {}
    for key, value in _load_tensors(directory).items():
        core = key[len(PREFIX):] if key.startswith(PREFIX) else key
        if core in WHOLE:
            continue  # (``whole``)
        module, _, kind = core.rpartition(".lora_")
        if kind not in ("A.weight", "B.weight"):
            raise ConfigError(f"{FLAG} {directory}: tensor {key} is not a LoRA A or B weight; megatron_ext loads "
                              "LoRA adapters of the transformer layers' linears only")
        by_module.setdefault(module, {})[kind[0]] = value.float()
    return split_experts(by_module, config)


def whole(directory: str) -> Dict[str, torch.Tensor]:
    """The modules an adapter saves whole (a reward model's score head), by Hugging Face name."""
    tensors = _load_tensors(directory)
    return {name: tensors[PREFIX + name] for name in WHOLE if PREFIX + name in tensors}


def lora_fields(directory: str, lora_flags, pretrained: Optional[str], shape) -> dict:
    """``LoRAConfig``'s fields (but dropout) for a PEFT adapter, checked against the flags and the model."""
    config = read_config(directory, lora_flags, pretrained)
    return dict(rank=config["r"], alpha=float(config["lora_alpha"]), **plan(directory, config, shape.model_type, shape))


def plan(directory: str, config: dict, family_name: str, shape) -> dict:
    """Our targets and their ranks for a PEFT adapter: ``LoRAConfig`` fields (``targets``, ``target_ranks``)."""
    family = families.TABLES[family_name]
    if whole(directory) and not _reward(shape):
        raise ConfigError(f"{FLAG} {directory}: carries a score head (a reward model's adapter); add --objective "
                          "reward, or give a language model's adapter")
    r, by_module = config["r"], _by_module(directory, config)
    target_rules = _target_rules(family, shape, {})
    targets = sorted({t for t, rule in target_rules if set(_modules(rule)) & set(by_module)})
    placed = {m for t, rule in target_rules if t in targets for m in _modules(rule)}
    unplaced = sorted(set(by_module) - placed)
    if unplaced or not targets:
        raise ConfigError(f"{FLAG} {directory}: adapts {unplaced[0] if unplaced else 'nothing'}, which has no "
                          f"place in this {family.label} model (LoRA targets: the layers' attention and MLP linears)")
    ranks = {}
    for target in targets:
        rules = [rule for t, rule in target_rules if t == target]
        for rule in rules:
            for m in _modules(rule):
                if m in by_module and not (by_module[m]["A"].shape[0] == r == by_module[m]["B"].shape[1]):
                    raise ConfigError(f"{FLAG} {directory}: {m} has rank {by_module[m]['A'].shape[0]}, its "
                                      f"{CONFIG} says {r}")
        if not all(_shares_a(rule, by_module) for rule in rules if set(_modules(rule)) & set(by_module)):
            ranks[target] = r * max(len(_modules(rule)) for rule in rules)
    return {"targets": tuple(targets), "target_ranks": tuple(sorted(ranks.items()))}


def _shares_a(rule: Rule, by_module) -> bool:
    parts = [by_module.get(m) for m in _modules(rule)]
    return all(p is not None for p in parts) and all(torch.equal(p["A"], parts[0]["A"]) for p in parts)


@torch.no_grad()
def load(chunks, directory: str, lora, model_meta: dict) -> None:
    """Copy a PEFT adapter into the adapters ``lora.apply`` put on ``chunks`` (this rank's shards)."""
    from megatron_ext.models.sharding import global_named_parameters

    value = values(directory, lora, model_meta)
    for chunk in chunks:
        for gname, name, param in global_named_parameters(chunk):
            full = value(gname, name, param, chunk)
            if full is not None:
                param.copy_(full)


def values(directory: str, lora, model_meta: dict) -> Callable:
    """``value(global name, name, parameter, chunk)``: this TP rank's part of an adapter weight from a PEFT adapter
    (None for any other parameter; FSDP draws its shards from it). A shape the model lacks is one line."""
    from megatron_ext.models.init import full_shape
    from megatron_ext.models.sharding import local_shard

    family = families.TABLES[model_meta["model_type"]]
    shape = family.shape_type(**model_meta["model_shape"])
    rules = {rule.mcore: rule for rule in family.rules(shape, model_meta)}
    ctx, by_module = family.context(shape), _by_module(directory, read_json(os.path.join(directory, CONFIG), FLAG))

    saved, score = whole(directory), rules[SCORE].hf[0] if _reward(shape) else None

    def value(gname: str, name: str, param, chunk) -> Optional[torch.Tensor]:
        if gname == SCORE and score in saved:
            return local_shard(saved[score].to(param.dtype), name, param, chunk)
        if ".lora_" not in gname:
            return None
        base, whole = _base(gname), tuple(full_shape(param))
        stacked = lora.rank_of(_target_of(base)) != lora.rank
        full = _fused(rules[base], by_module, lora.rank, stacked, whole, ".lora_a." in gname, ctx)
        if tuple(full.shape) != whole:
            raise ConfigError(f"{FLAG} {directory}: the adapter of {base} has shape {tuple(full.shape)}, "
                              f"the model {whole}; the adapter belongs to another model")
        return local_shard(full.to(param.dtype), name, param, chunk)
    return value


def _fused(rule: Rule, by_module, r: int, stacked: bool, whole, is_a: bool, ctx) -> torch.Tensor:
    """One layer's A or B (``is_a``; ``whole``: its TP-whole shape) of a target in megatron-core's fused layout,
    from its parts' PEFT tensors: the shared A, or the parts' A stacked with B block-diagonal; a part the adapter
    leaves out is zero."""
    modules = _modules(rule)
    parts = [by_module.get(m) for m in modules]
    present = [p for p in parts if p is not None]
    if not present:
        return torch.zeros(whole)
    if not stacked:
        return present[0]["A"] if is_a else rule.to_mcore([p["B"] for p in parts], ctx, FLAG)
    if is_a:
        width = present[0]["A"].shape[1]
        return torch.cat([p["A"] if p is not None else torch.zeros(r, width) for p in parts])
    part_rows = [t.shape[0] for t in rule.to_hf(torch.empty(whole[0], 1, device="meta"), ctx)]
    bs = []
    for k, (p, out) in enumerate(zip(parts, part_rows)):
        block = torch.zeros(out, len(modules) * r)
        if p is not None:
            block[:, k * r:(k + 1) * r] = p["B"]
        bs.append(block)
    return rule.to_mcore(bs, ctx, FLAG)
