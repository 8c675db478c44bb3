"""The parallel layout's options (Megatron-LM's names) and the mesh they make, checked before process groups exist."""

from __future__ import annotations

import dataclasses
from typing import Optional

from megatron_ext.config import Section, option
from megatron_ext.errors import ConfigError
from megatron_ext.flag_types import nonneg_int, positive_int
from megatron_ext.mesh import Mesh


@dataclasses.dataclass
class Parallelism(Section):
    GROUP = "parallelism"
    tp: int = option(1, flags=("--tensor-model-parallel-size",), type=positive_int)
    pp: int = option(1, flags=("--pipeline-model-parallel-size",), type=positive_int)
    layers_per_virtual_stage: Optional[int] = option(None, flags=("--num-layers-per-virtual-pipeline-stage",),
                                                     type=positive_int)
    cp: int = option(1, flags=("--context-parallel-size",), type=positive_int)
    ep: int = option(1, flags=("--expert-model-parallel-size",), type=positive_int)
    etp: Optional[int] = option(None, flags=("--expert-tensor-parallel-size",), type=positive_int,
                                help="defaults to --tensor-model-parallel-size, as in megatron-core")
    sequence_parallel: bool = option(False)
    distributed_backend: Optional[str] = option(None, choices=("nccl", "gloo"),
                                                help="default: nccl when CUDA is available, else gloo; gloo means CPU "
                                                     "ranks")
    local_rank: Optional[int] = option(None, flags=("--local_rank", "--local-rank"), type=nonneg_int,
                                       help="set by the deepspeed launcher; ranks come from the environment")

    @property
    def backend(self) -> str:
        if self.distributed_backend:
            return self.distributed_backend
        import torch  # only when the backend was not named

        return "nccl" if torch.cuda.is_available() else "gloo"

    def mesh(self, world_size: int, num_layers: int, num_experts: Optional[int] = None) -> Mesh:
        """The mesh of these sizes over ``world_size`` ranks; one line (with the fix) for any inconsistency."""
        tp, pp, cp, ep = self.tp, self.pp, self.cp, self.ep
        etp = tp if self.etp is None else self.etp
        model_parallel = tp * pp * cp
        if world_size % model_parallel:
            raise ConfigError(
                f"world size {world_size} is not divisible by TP x PP x CP = {tp} x {pp} x {cp} = {model_parallel} "
                f"(--tensor-model-parallel-size, --pipeline-model-parallel-size, --context-parallel-size); "
                f"launch a multiple of {model_parallel} processes or shrink the mesh")
        if self.sequence_parallel and tp == 1:
            raise ConfigError("--sequence-parallel needs --tensor-model-parallel-size > 1 (it splits activations "
                              "over TP)")
        vpp = None
        if self.layers_per_virtual_stage is not None:
            per_stage = self.layers_per_virtual_stage
            if pp == 1:
                raise ConfigError("--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size > 1")
            if num_layers % (pp * per_stage):
                raise ConfigError(
                    f"{num_layers} layers do not split into --pipeline-model-parallel-size {pp} x "
                    f"--num-layers-per-virtual-pipeline-stage {per_stage} chunks; choose sizes whose product divides "
                    f"{num_layers}")
            vpp = num_layers // (pp * per_stage)
            if vpp == 1:
                vpp = None  # one chunk per rank is plain 1F1B
        elif num_layers % pp:
            raise ConfigError(f"{num_layers} layers do not divide over --pipeline-model-parallel-size {pp}; "
                              f"choose a divisor of {num_layers}")
        if num_experts is None:
            if ep > 1:
                raise ConfigError("--expert-model-parallel-size > 1 needs an MoE model (--num-experts)")
        else:
            if num_experts % ep:
                raise ConfigError(f"--num-experts {num_experts} is not divisible by --expert-model-parallel-size {ep}")
            if world_size % (etp * ep * pp):
                raise ConfigError(
                    f"world size {world_size} is not divisible by expert TP x EP x PP = {etp} x {ep} x {pp}; "
                    f"adjust --expert-tensor-parallel-size / --expert-model-parallel-size")
            if tp > 1 and not self.sequence_parallel:
                raise ConfigError("MoE with --tensor-model-parallel-size > 1 needs --sequence-parallel (megatron-core)")
            if ep == 1 and etp != tp:
                # megatron-core 0.16.1 tags experts as expert-parallel (allreduce=False) only at EP > 1: at EP 1 its
                # DDP reduces their gradients over the dense data-parallel group, not the expert one etp < tp needs
                raise ConfigError(f"--expert-tensor-parallel-size {etp} differs from --tensor-model-parallel-size "
                                  f"{tp} only with --expert-model-parallel-size > 1 (megatron-core treats experts as "
                                  f"dense parameters at EP 1); drop the flag or raise the expert-parallel size")
        return Mesh(world=world_size, tp=tp, pp=pp, vpp=vpp, cp=cp, ep=ep, etp=etp,
                    sequence_parallel=self.sequence_parallel)
