"""The parallel layout of a run: how many ranks each dimension takes (torch-free, so flags validate it before any
process group exists; ``parallel.py`` builds megatron-core's groups from it)."""

from __future__ import annotations

import dataclasses
from typing import Optional


@dataclasses.dataclass(frozen=True)
class Mesh:
    """Sizes of every parallel dimension. Ranks are ordered tp-cp-ep-dp-pp, as megatron-core orders them."""

    world: int
    tp: int = 1
    pp: int = 1
    vpp: Optional[int] = None  # model chunks per pipeline rank (interleaved schedule) or None
    cp: int = 1
    ep: int = 1
    etp: int = 1
    sequence_parallel: bool = False

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.pp * self.cp)

    def megatron_sizes(self) -> dict:
        """The sizes under the keyword names that both TransformerConfig and initialize_model_parallel take."""
        return dict(tensor_model_parallel_size=self.tp, pipeline_model_parallel_size=self.pp,
                    virtual_pipeline_model_parallel_size=self.vpp, context_parallel_size=self.cp,
                    expert_model_parallel_size=self.ep, expert_tensor_parallel_size=self.etp)

    def describe(self) -> str:
        vpp = f" VPP{self.vpp}" if self.vpp else ""
        sp = "+SP" if self.sequence_parallel else ""
        return f"DP{self.dp} TP{self.tp}{sp} PP{self.pp}{vpp} CP{self.cp} EP{self.ep}"
