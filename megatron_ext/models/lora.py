"""LoRA on megatron-core's parallel linear layers: ``y = W x + b + (alpha / r) * B A dropout(x)``, W frozen.

Any model family: the targets are the transformer layers' linears (``qkv``, ``proj``, ``fc1``, ``fc2``; on an MoE
layer fc1/fc2 are the routed experts' (``models/lora_experts.py``) and the shared expert's). Adapters are
megatron-core parallel linears laid out as Megatron-Bridge does, so they are right under TP (and SP):
- column-parallel base (qkv, fc1): A column-parallel with its output gathered (full r), B column-parallel like W;
- row-parallel base (proj, fc2): A row-parallel on the TP-sharded input (output all-reduced), B gathered.
Checkpoints keep the base's own names (``...linear_qkv.weight``) and add ``...linear_qkv.lora_{a,b}.weight``, so a
plain checkpoint loads into a LoRA model and a LoRA checkpoint exports merged (``merge``) as the plain model.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from typing import Callable, Iterable, List, Optional, Tuple

import torch
from megatron.core import tensor_parallel
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

from megatron_ext.errors import ConfigError
from megatron_ext.models import lora_experts
from megatron_ext.models.init import full_shape, local_shape
from megatron_ext.models.sharding import (all_gather_tp, global_named_parameters, local_shard, plain_name, unwrap,
                                          write_shard)

TARGETS = {"qkv": "self_attention.linear_qkv", "proj": "self_attention.linear_proj",
           "fc1": "mlp.linear_fc1", "fc2": "mlp.linear_fc2"}
TRAINABLE = ("head.",)  # besides adapters: the classifier head stays trainable (HF's modules_to_save), as do
# modules marked ``trains_whole`` (a reward model's score head)


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    rank: int
    alpha: float
    targets: Tuple[str, ...] = ("qkv",)
    dropout: float = 0.0
    # a target's own rank where it differs: a PEFT adapter whose q/k/v (gate/up) parts have their own A comes in
    # with them stacked (convert/adapters.py); the scale stays alpha / rank, as PEFT's
    target_ranks: Tuple[Tuple[str, int], ...] = ()

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def rank_of(self, target: str) -> int:
        return dict(self.target_ranks).get(target, self.rank)

    @classmethod
    def from_record(cls, record: dict) -> "LoRAConfig":
        """The config a checkpoint records (``dataclasses.asdict``: tuples come back as lists)."""
        return cls(**{**record, "targets": tuple(record["targets"]),
                      "target_ranks": tuple(map(tuple, record.get("target_ranks", ())))})


def config_of(flags, tp: int, adapter: Optional[dict] = None) -> Optional[LoRAConfig]:
    """The ``--lora-*`` flags (``flags``: the family's LoRA section) -> a config, None without ``--lora-rank``;
    ``adapter``: the rank, alpha and targets of ``--pretrained-adapter`` (convert/adapters.py), which replace the
    flags'. ConfigError naming the flag."""
    if not flags.lora_rank and adapter is None:
        return None
    if not 0.0 <= flags.lora_dropout < 1.0:
        raise ConfigError(f"--lora-dropout must be in [0, 1), got {flags.lora_dropout}")
    if adapter is not None:
        lora = LoRAConfig(dropout=flags.lora_dropout, **adapter)
    else:
        targets = tuple(t.strip() for t in flags.lora_targets.split(",") if t.strip())
        unknown = sorted(set(targets) - set(TARGETS))
        if unknown or not targets:
            raise ConfigError(f"--lora-targets {flags.lora_targets}: choose from {','.join(TARGETS)}")
        alpha = float(flags.lora_rank if flags.lora_alpha is None else flags.lora_alpha)
        lora = LoRAConfig(rank=flags.lora_rank, alpha=alpha, targets=targets, dropout=flags.lora_dropout)
    if lora.rank < 0 or lora.rank % tp:
        raise ConfigError(f"--lora-rank {lora.rank} must be positive and divisible by "
                          f"--tensor-model-parallel-size {tp} (the adapter's A is split over TP)")
    return lora


class LoRALinear(torch.nn.Module):
    """A frozen ``ColumnParallelLinear``/``RowParallelLinear`` plus its adapter; returns ``(output, bias)`` as the
    base does."""

    def __init__(self, base: torch.nn.Module, lora: LoRAConfig, rank: int):
        super().__init__()
        self.base, self.scale, self.column = base, lora.scale, isinstance(base, ColumnParallelLinear)
        for p in base.parameters():
            p.requires_grad_(False)
        config = dataclasses.replace(base.config, sequence_parallel=False, perform_initialization=True,
                                     gradient_accumulation_fusion=False)
        self.sequence_parallel = base.config.sequence_parallel
        common = dict(config=config, init_method=torch.nn.init.zeros_, bias=False)
        if self.column:
            self.lora_a = ColumnParallelLinear(base.input_size, rank, gather_output=True, **common)
        else:
            self.lora_a = RowParallelLinear(base.input_size, rank, input_is_parallel=True, skip_bias_add=True,
                                            **common)
        self.lora_b = ColumnParallelLinear(rank, base.output_size, gather_output=not self.column, **common)
        self.dropout = torch.nn.Dropout(lora.dropout)
        # torch state dicts use the base's own names too (``linear_qkv.weight``, not ``linear_qkv.base.weight``)
        self._register_state_dict_hook(_drop_base_prefix)
        self._register_load_state_dict_pre_hook(_add_base_prefix)

    def forward(self, x: torch.Tensor, *args, **kwargs):
        out, bias = self.base(x, *args, **kwargs)
        if not self.dropout.p or not self.training:  # (no RNG fork: it copies and compares the CPU RNG state)
            a_in = x
        elif self.column and not self.sequence_parallel:  # x is the same on every TP rank: so is its mask
            a_in = self.dropout(x)
        else:  # x is this rank's shard: its own mask, from megatron-core's model-parallel RNG (as its dropouts)
            with tensor_parallel.get_cuda_rng_tracker().fork():
                a_in = self.dropout(x)
        if self.column and self.sequence_parallel:  # the base gathers the sequence inside; A needs it too
            # A's input gradient is already summed over TP (its copy_to region all-reduces): split it, do not
            # reduce-scatter it again (that would count it TP times).
            a_in = tensor_parallel.gather_from_sequence_parallel_region(a_in, tensor_parallel_output_grad=False)
        delta, _ = self.lora_b(self.lora_a(a_in)[0])
        if not self.column and self.sequence_parallel:  # the base's output is reduce-scattered over the sequence
            delta = tensor_parallel.scatter_to_sequence_parallel_region(delta)
        return torch.add(out, delta, alpha=self.scale), bias  # one pass over the output, not two

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        state = self.base.sharded_state_dict(prefix, sharded_offsets, metadata)
        for name in ("lora_a", "lora_b"):
            state.update(getattr(self, name).sharded_state_dict(f"{prefix}{name}.", sharded_offsets, metadata))
        if self.column and self.base.config.gated_linear_unit and prefix.endswith("linear_fc1."):
            # B's rows are [gate_r; up_r] on TP rank r, as the fc1 weight's: saved as megatron-core's MLP saves that
            # weight (gate and up each sharded over TP), so it loads under any TP size
            from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

            key = f"{prefix}lora_b.weight"
            state[key] = apply_swiglu_sharded_factory(state[key], sharded_offsets,
                                                      (metadata or {}).get("singleton_local_shards", False))
        return state

    @torch.no_grad()
    def merged_weight(self) -> torch.Tensor:
        """This TP rank's base weight with the adapter folded in (gathers the other factor's shards over TP; under
        FSDP each factor is first gathered whole over DP)."""
        w, a, b = (_whole(p) for p in (self.base.weight, self.lora_a.weight, self.lora_b.weight))
        a, b = a.float(), b.float()
        if self.column:  # W [out/tp, in] += B [out/tp, r] @ A [r, in]; A is split over r
            a = torch.cat(all_gather_tp(a), dim=0)
        else:  # W [out, in/tp] += B [out, r] @ A [r, in/tp]; B is split over out
            b = torch.cat(all_gather_tp(b), dim=0)
        return (w.float() + self.scale * (b @ a)).to(w.dtype)


def _whole(param: torch.Tensor) -> torch.Tensor:
    """A parameter as this TP rank holds it: an FSDP (DTensor) parameter gathered over DP."""
    return param.full_tensor() if hasattr(param, "full_tensor") else param


def _drop_base_prefix(module, state_dict, prefix, local_metadata):
    for key in [k for k in state_dict if k.startswith(prefix + "base.")]:
        state_dict[prefix + key[len(prefix) + len("base."):]] = state_dict.pop(key)


def _add_base_prefix(state_dict, prefix, *unused):
    own = (prefix + "lora_", prefix + "base.")
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(own)]:
        state_dict[prefix + "base." + key[len(prefix):]] = state_dict.pop(key)


def _modules(chunk: torch.nn.Module, targets: Iterable[str]) -> List[Tuple[str, torch.nn.Module, str]]:
    """(target, parent, attribute) of every targeted linear of every transformer layer of ``chunk``: on an MoE
    layer, fc1/fc2 name the shared expert's linear and each routed expert's (grouped experts: the module itself,
    attribute None)."""
    found = []
    for layer in unwrap(chunk).decoder.layers:
        experts = getattr(layer.mlp, "experts", None)
        for target in targets:
            if experts is None or target not in ("fc1", "fc2"):
                parent_path, attr = TARGETS[target].rsplit(".", 1)
                found.append((target, layer.get_submodule(parent_path), attr))
                continue
            if getattr(layer.mlp, "shared_experts", None) is not None:
                found.append((target, layer.mlp.shared_experts, f"linear_{target}"))
            if hasattr(experts, "per_expert"):
                found.append((target, experts, None))
            else:  # SequentialMLP: megatron-core's linears, right as LoRALinear's bases only without expert comms
                if experts.ep_group.size() > 1 or experts.tp_group.size() > 1:
                    raise ConfigError("LoRA on the experts under expert or expert-tensor parallelism needs the "
                                      "grouped experts (torch._grouped_mm), which this run's experts are not")
                found += [(target, local, f"linear_{target}") for local in experts.local_experts]
    return found


def apply(chunks, lora: LoRAConfig, seed: int) -> None:
    """Freeze every weight, wrap the targets, keep the head trainable; adapters drawn mesh-independently (A as
    ``nn.Linear``'s default kaiming-uniform, B zero, so the model starts as the base). Call before the engine
    builds its DDP buffers and optimizer, which then see only the trainable parameters."""
    for chunk in chunks:
        whole = {id(p) for m in unwrap(chunk).modules() if getattr(m, "trains_whole", False) for p in m.parameters()}
        for name, param in unwrap(chunk).named_parameters():
            param.requires_grad_(name.startswith(TRAINABLE) or id(param) in whole)
        for target, parent, attr in _modules(chunk, lora.targets):
            if attr is None:
                lora_experts.add(parent, target, lora.rank_of(target), lora.scale)
            else:
                setattr(parent, attr, LoRALinear(getattr(parent, attr), lora, lora.rank_of(target)))
        _init_adapters(chunk, seed)
        if unwrap(chunk).config.recompute_granularity == "full":
            # megatron-core's reentrant checkpointing gives parameters inside no gradient unless its input requires
            # one; the frozen embeddings' output does not (research/vit.md 3.4).
            unwrap(chunk).decoder.register_forward_pre_hook(_input_requires_grad, with_kwargs=True)


def _input_requires_grad(module, args, kwargs):
    hidden = args[0] if args else kwargs.get("hidden_states")
    if module.training and hidden is not None and not hidden.requires_grad and torch.is_grad_enabled():
        hidden.requires_grad_(True)


@torch.no_grad()
def _init_adapters(chunk: torch.nn.Module, seed: int) -> None:
    for global_name, name, param in global_named_parameters(chunk):
        if ".lora_" in name and not param.is_meta:  # (on the meta device FSDP draws them: ``initial_values``)
            param.copy_(adapter_value(global_name, name, param, chunk, seed))


def adapter_value(global_name: str, name: str, param: torch.Tensor, chunk, seed: int) -> Optional[torch.Tensor]:
    """This TP rank's initial value of an adapter weight (None for any other parameter), mesh-independent: A as
    ``nn.Linear``'s default kaiming-uniform, drawn whole from a generator seeded by (seed, global name); B zero."""
    if name.endswith("lora_b.weight"):
        return torch.zeros(local_shape(param))
    if not name.endswith("lora_a.weight"):
        return None
    full = torch.empty(full_shape(param), dtype=torch.float32)
    bound = 1.0 / math.sqrt(full.shape[1])  # kaiming_uniform_(a=sqrt(5)), as nn.Linear and peft
    full.uniform_(-bound, bound, generator=torch.Generator().manual_seed(seed + zlib.crc32(global_name.encode())))
    return local_shard(full, name, param, chunk)


def initial_values(seed: int, values: Optional[Callable] = None, adapters: Optional[Callable] = None) -> Callable:
    """``value(global name, name, parameter, chunk)`` for a model whose adapters are in place but not yet drawn (FSDP
    fills its shards from it after sharding): an adapter from ``adapters`` (a PEFT adapter coming in) or
    ``adapter_value``; a wrapped base weight from ``values`` (published weights) or ``initial_value`` under its
    plain name, as a model without adapters draws it."""
    from megatron_ext.models.init import initial_value

    def value(global_name, name, param, chunk):
        own = adapters(global_name, name, param, chunk) if adapters else None  # (a reward model's score head too)
        if ".lora_" in name:
            return own if own is not None else adapter_value(global_name, name, param, chunk, seed)
        if own is not None:
            return own
        global_name, name = plain_name(global_name), plain_name(name)
        return values(global_name, name, param, chunk) if values else \
            initial_value(global_name, name, param, chunk, seed, torch.device("cpu"))  # (param: on the meta device)
    return value


@torch.no_grad()
def merge(chunks) -> None:
    """Fold every adapter into its base weight and put the plain linear back (collective over TP)."""
    for chunk in chunks:
        for parent in list(unwrap(chunk).decoder.layers.modules()):
            if hasattr(parent, "per_expert"):  # grouped experts
                lora_experts.merge(parent)
            for attr, wrapper in list(parent.named_children()):
                if isinstance(wrapper, LoRALinear):
                    weight = wrapper.base.weight
                    if hasattr(weight, "device_mesh"):  # FSDP: this rank's rows of the merged weight
                        write_shard(weight, wrapper.merged_weight())
                    else:
                        weight.copy_(wrapper.merged_weight())
                    setattr(parent, attr, wrapper.base)


def trainable_summary(chunks) -> str:
    params = [p for c in chunks for p in c.parameters()]
    trainable = sum(p.numel() for p in params if p.requires_grad)
    return f"LoRA: {trainable:,} trainable of {sum(p.numel() for p in params):,} parameters on this rank"


def trainable_state(chunk: torch.nn.Module) -> dict:
    """A chunk's sharded state without its frozen parameters: a LoRA run's checkpoints hold the adapters (and their
    optimizer state); the base comes back from where the run began (its ``lora_base`` record)."""
    state = unwrap(chunk).sharded_state_dict()
    frozen = {p.data_ptr() for p in unwrap(chunk).parameters() if not p.requires_grad}
    if not frozen:
        return state
    return {k: v for k, v in state.items()
            if not (torch.is_tensor(getattr(v, "data", None)) and v.data.data_ptr() in frozen)}
