"""Dense Qwen2 -> Qwen2-MoE upcycling, one tensor at a time: the recipe of tools/upcycle_moe.py (see its docstring
for why the upcycled model computes exactly the dense function at step 0), shared by that tool and by
``--pretrained`` (a dense source loaded into an MoE model is read through ``UpcycledReader``: no second copy).

With G = dense FFN / expert FFN (the granularity), expert e holds slice e mod G of the dense MLP (its down_proj
times G), the router has one small random row per group of G experts (seeded per layer), and the shared expert
starts at exactly zero output (down_proj and gate zero) with the dense MLP's first units as gate/up.
"""

from __future__ import annotations

import re
from typing import List, Optional, Tuple

import torch

from megatron_ext.errors import ConfigError

DENSE_MLP = re.compile(r"^model\.layers\.(\d+)\.mlp\.(gate|up|down)_proj\.weight$")
_MOE = re.compile(r"^model\.layers\.(\d+)\.mlp\.(gate\.weight|experts\.(\d+)\.(gate|up|down)_proj\.weight|"
                  r"shared_expert\.(gate|up|down)_proj\.weight|shared_expert_gate\.weight)$")


def check(num_experts: int, topk: int, granularity: int, ffn_hidden_size: int, flag: str = "--granularity") -> int:
    """The routed experts' FFN size, or one line naming what breaks the exact upcycling (``flag``: what sets the
    granularity)."""
    e, k, g = num_experts, topk, granularity
    if g < 1:
        raise ConfigError(f"{flag} must be >= 1, got {g}")
    if e < 2 or e % g:
        raise ConfigError(f"--num-experts {e} must be a multiple of {flag} {g} and at least 2")
    if not 1 <= k <= e or k % g:
        raise ConfigError(f"--moe-router-topk {k} must be a multiple of {flag} {g} (a token selects whole "
                          f"groups of G experts) and at most --num-experts {e}")
    if ffn_hidden_size % g:
        raise ConfigError(f"{flag} {g} does not divide the dense FFN size {ffn_hidden_size}; choose a divisor of it")
    return ffn_hidden_size // g


def router(i: int, num_experts: int, granularity: int, hidden: int, std: float, seed: int) -> torch.Tensor:
    """Layer ``i``'s router: one random row per group of ``granularity`` experts, repeated (fp32)."""
    generator = torch.Generator().manual_seed(seed + i)
    rows = torch.randn(num_experts // granularity, hidden, generator=generator) * std
    return rows.repeat_interleave(granularity, dim=0)


def upcycled(name: str, dense, num_experts: int, granularity: int, shared_size: int, std: float,
             seed: int) -> torch.Tensor:
    """The Qwen2-MoE tensor ``name`` made from ``dense(proj, i)`` (layer i's dense gate/up/down, fp32)."""
    match = _MOE.match(name)
    i, g = int(match[1]), granularity
    if match[2] == "gate.weight":
        return router(i, num_experts, g, dense("gate", i).shape[1], std, seed)
    if match[3] is not None:  # routed expert e: slice e mod G
        proj, s = match[4], int(match[3]) % g
        weight = dense(proj, i)
        return weight.chunk(g, dim=1)[s] * g if proj == "down" else weight.chunk(g, dim=0)[s]
    if match[5] in ("gate", "up"):  # the shared expert's units: the dense MLP's first ones (cycled)
        weight = dense(match[5], i)
        return weight[torch.arange(shared_size) % weight.shape[0]]
    hidden = dense("gate", i).shape[1]
    return torch.zeros(hidden, shared_size) if match[5] == "down" else torch.zeros(1, hidden)


def moe_layer_names(i: int, num_experts: int, shared: bool) -> List[str]:
    prefix = f"model.layers.{i}.mlp"
    names = [f"{prefix}.gate.weight"] + [f"{prefix}.experts.{e}.{p}_proj.weight"
                                         for e in range(num_experts) for p in ("gate", "up", "down")]
    if shared:
        names += [f"{prefix}.shared_expert.{p}_proj.weight" for p in ("gate", "up", "down")]
        names.append(f"{prefix}.shared_expert_gate.weight")
    return names


class UpcycledReader:
    """A dense Qwen2 checkpoint read as the Qwen2-MoE of ``shape`` (an MoE shape whose dense part is the source's):
    the same interface as ``SafetensorsReader``, each MoE tensor computed when it is read."""

    def __init__(self, dense, shape, seed: int, std: float = 0.02, flag: str = "--pretrained"):
        moe = shape.moe
        if shape.ffn_hidden_size % moe.ffn_hidden_size:
            raise ConfigError(f"{flag}: the expert FFN size {moe.ffn_hidden_size} does not divide the dense FFN size "
                              f"{shape.ffn_hidden_size}; upcycling needs experts that are slices of the dense MLP")
        self.granularity = shape.ffn_hidden_size // moe.ffn_hidden_size
        check(moe.num_experts, moe.topk, self.granularity, shape.ffn_hidden_size,
              "the granularity (dense FFN / --moe-ffn-hidden-size)")
        if not moe.norm_topk_prob:
            raise ConfigError(f"{flag}: upcycling a dense model is exact only with renormalised top-k routing "
                              "(--moe-norm-topk-prob / the preset's norm_topk_prob); without it the MoE output is "
                              "scaled by the selected probability mass")
        self.dense, self.shape, self.seed, self.std, self.flag = dense, shape, seed, std, flag
        self.directory = dense.directory
        pattern = moe.pattern(shape.num_layers)
        self._moe_layers = {i for i, p in enumerate(pattern) if p}
        self._names = [n for n in dense.names()
                       if not (DENSE_MLP.match(n) and int(DENSE_MLP.match(n)[1]) in self._moe_layers)]
        for i in sorted(self._moe_layers):
            self._names += moe_layer_names(i, moe.num_experts, moe.shared_expert_size is not None)

    def names(self) -> List[str]:
        return list(self._names)

    def check_files(self) -> dict:
        self._dense_shapes = self.dense.check_files()
        return {name: tuple(self._meta(name).shape) for name in self._names}

    def _meta(self, name: str) -> torch.Tensor:
        if not _MOE.match(name):
            return torch.empty(self._dense_shapes[name], device="meta")
        dense = lambda proj, i: torch.empty(self._dense_shapes[f"model.layers.{i}.mlp.{proj}_proj.weight"],
                                            device="meta")
        return self._make(name, dense)

    def _make(self, name: str, dense) -> torch.Tensor:
        moe = self.shape.moe
        return upcycled(name, dense, moe.num_experts, self.granularity, moe.shared_expert_size or 1, self.std,
                        self.seed)

    def get(self, name: str) -> torch.Tensor:
        if not _MOE.match(name):
            return self.dense.get(name)
        source_dtype = []

        def dense(proj: str, i: int) -> torch.Tensor:
            tensor = self.dense.get(f"model.layers.{i}.mlp.{proj}_proj.weight")
            source_dtype.append(tensor.dtype)
            return tensor.float()

        tensor = self._make(name, dense)
        return tensor.to(source_dtype[0]) if source_dtype else tensor

    def get_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        return self.get(name)[start:stop]

    def get_columns(self, name: str, start: int, stop: int) -> torch.Tensor:
        return self.get(name)[:, start:stop]


def upcycled_layer(i: int, gate, up, down, num_experts: int, granularity: int, shared_size: Optional[int],
                   std: float, seed: int) -> List[Tuple[str, torch.Tensor]]:
    """(HF name, tensor) of MoE layer ``i`` from the dense MLP's [I,H] gate/up and [H,I] down (fp32); no shared
    expert when ``shared_size`` is None (Qwen3-MoE)."""
    dense = {"gate": gate, "up": up, "down": down}
    return [(name, upcycled(name, lambda proj, _: dense[proj], num_experts, granularity, shared_size or 1, std, seed))
            for name in moe_layer_names(i, num_experts, shared_size is not None)]
