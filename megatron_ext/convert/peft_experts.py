"""Routed experts: transformers 5 holds each MoE layer's experts as 3D parameters (``mlp.experts.gate_up_proj``
[E, 2F, H], ``down_proj`` [E, H, F]), which PEFT adapts through ``target_parameters``: one A [E r, in] (expert-major)
and one B [out, r E] (expert-minor) per parameter, nested (``experts.base_layer.lora_A`` is the first listed). They
are read into, and written from, the per-expert linears of the files (``experts.{e}.gate_proj``), so the rest of
the conversion sees one linear per expert as for the dense layers.
"""

from __future__ import annotations

import re
from typing import Dict, List, Tuple

import torch

from megatron_ext.errors import ConfigError

PREFIX = "base_model.model."  # PeftModel -> LoraModel -> the transformers model

# transformers 5's fused expert parameters and the per-expert linears of the files they are made of
FUSED_EXPERTS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
_PER_EXPERT = re.compile(r"^(?P<experts>.+\.experts)\.(?P<e>\d+)\.(?P<linear>\w+)$")


def _nested(module: str, order: List[str], fused: str) -> str:
    """PEFT's module path of ``fused``'s ParamWrapper: the first of the targeted parameters is the innermost."""
    return module + ".base_layer" * (len(order) - 1 - order.index(fused))


def fuse_experts(tensors: Dict[str, torch.Tensor], r: int) -> Tuple[Dict[str, torch.Tensor], List[str]]:
    """Per-expert PEFT tensors (``...experts.{e}.gate_proj.lora_A.weight``) -> PEFT's tensors of the fused expert
    parameters, and its ``target_parameters``."""
    groups: Dict[Tuple[str, str], Dict[int, Dict[str, Dict[str, torch.Tensor]]]] = {}
    out = {}
    for key, value in tensors.items():
        module, _, kind = key[len(PREFIX):].rpartition(".lora_")
        match = _PER_EXPERT.match(module)
        fused = next((f for f, parts in FUSED_EXPERTS.items() if match and match["linear"] in parts), None)
        if fused is None:
            out[key] = value
            continue
        groups.setdefault((match["experts"], fused), {}).setdefault(int(match["e"]), {}).setdefault(
            match["linear"], {})[kind[0]] = value
    order = [f for f in FUSED_EXPERTS if any(g[1] == f for g in groups)]
    for (module, fused), experts in groups.items():
        a, b = [], []
        for e in range(len(experts)):
            parts = [experts[e][linear] for linear in FUSED_EXPERTS[fused]]
            if any(p["A"].shape[0] != r or not torch.equal(p["A"], parts[0]["A"]) for p in parts):
                raise ConfigError(f"--save-peft: the adapters of {module}.{e} have their own A per part or rank "
                                  f"{parts[0]['A'].shape[0]} (not {r}); PEFT's expert adapters share one")
            a.append(parts[0]["A"])
            b.append(torch.cat([p["B"] for p in parts]))
        name = PREFIX + _nested(module, order, fused)
        out[f"{name}.lora_A.weight"] = torch.cat(a)  # [E r, in]: expert-major
        out[f"{name}.lora_B.weight"] = torch.stack(b, dim=-1).reshape(b[0].shape[0], -1)  # [out, r E]: expert-minor
    prefixes = {module.rsplit(".", 2)[-2] + "." + module.rsplit(".", 1)[-1] for module, _ in groups}
    return out, [f"{p}.{f}" for p in sorted(prefixes) for f in order]


def split_experts(by_module: Dict[str, Dict[str, torch.Tensor]], config: dict) -> Dict[str, Dict[str, torch.Tensor]]:
    """The inverse of ``fuse_experts`` on an adapter read by module: PEFT's fused expert tensors -> per-expert
    linears (``...experts.{e}.gate_proj``: the expert's A, its rows of B)."""
    params = config.get("target_parameters") or []
    out = {}
    for module, tensors in by_module.items():
        base = module
        while base.endswith(".base_layer"):
            base = base[:-len(".base_layer")]
        order = [p.rsplit(".", 1)[1] for p in params if base.endswith(p.rsplit(".", 1)[0])]
        depth = (len(module) - len(base)) // len(".base_layer")
        fused = order[len(order) - 1 - depth] if depth < len(order) else None
        if fused not in FUSED_EXPERTS:
            out[module] = tensors
            continue
        r = config["r"]
        a, b = tensors["A"], tensors["B"]
        experts = a.shape[0] // r
        for e in range(experts):
            b_e = b.reshape(b.shape[0], r, experts)[:, :, e]
            for linear, rows in zip(FUSED_EXPERTS[fused], b_e.chunk(len(FUSED_EXPERTS[fused]))):
                out[f"{base}.{e}.{linear}"] = {"A": a[e * r:(e + 1) * r], "B": rows}
    return out
