"""Mixture-of-Experts options: the shape overrides, the router's training settings, and every check of MoE against
the mesh and backend that can run before process groups exist (torch-free)."""

from __future__ import annotations

import dataclasses
from typing import Optional

from megatron_ext.config import Section, flag_of, option
from megatron_ext.errors import ConfigError
from megatron_ext.flag_types import int_at_least, nonneg_float, nonneg_int, positive_float, positive_int
from megatron_ext.models.qwen.shape import ModelShape, MoEShape


@dataclasses.dataclass
class MoESettings(Section):
    """The shape overrides (experts, top-k, sizes: ``shape()``) and how the router trains."""

    GROUP = "mixture of experts (megatron-core MoELayer; presets qwen1.5-moe-a2.7b, qwen3-30b-a3b, tiny-moe)"
    num_experts: Optional[int] = option(
        None, type=int_at_least(2),
        help="routed experts per MoE layer (makes a dense preset MoE, every expert the dense MLP's shape)")
    topk: Optional[int] = option(None, flags=("--moe-router-topk",), type=positive_int,
                                 help="experts per token (default: the shape's, or 2)")
    ffn_hidden_size: Optional[int] = option(None, flags=("--moe-ffn-hidden-size",), type=positive_int,
                                            help="each routed expert's FFN size")
    shared_expert_size: Optional[int] = option(None, flags=("--moe-shared-expert-intermediate-size",),
                                               type=nonneg_int, help="the gated shared expert's FFN size; 0 removes it")
    layer_freq: Optional[str] = option(
        None, flags=("--moe-layer-freq",),
        help="which layers are MoE, an explicit 0/1 list such as 1,0,1,1 (default: the shape's, or all)")
    aux_loss_coeff: float = option(0.0, flags=("--moe-aux-loss-coeff",), type=nonneg_float,
                                   help="load-balancing loss (Switch/GShard)")
    aux_loss_scope: str = option(
        "layer", flags=("--moe-aux-loss-scope",), choices=("layer", "model"),
        help="layer: megatron-core's load-balancing loss of each layer, summed; model: Qwen2-MoE's and Qwen3-MoE's own "
             "(transformers' load_balancing_loss_func), one loss over every layer's routing, so --moe-aux-loss-coeff "
             "is their router_aux_loss_coef (0.001); no pipeline parallelism")
    z_loss_coeff: Optional[float] = option(None, flags=("--moe-z-loss-coeff",), type=nonneg_float,
                                           help="router z-loss (ST-MoE); e.g. 1e-3")
    dispatcher: Optional[str] = option(
        None, flags=("--moe-token-dispatcher-type",), choices=("alltoall", "allgather"),
        help="default: alltoall, or allgather where alltoall cannot run (gloo with expert TP > 1)")
    capacity_factor: Optional[float] = option(
        None, flags=("--moe-expert-capacity-factor",), type=positive_float,
        help="drop tokens beyond this multiple of each expert's balanced share (default: dropless)")
    grouped_gemm: Optional[bool] = option(
        None, flags=("--moe-grouped-gemm",), negate=False,
        help="routed experts as two torch._grouped_mm GEMMs (default: on where torch runs them for the device, dtype "
             "and shapes, else SequentialMLP's loop, said in one line)")

    def shape(self, shape: ModelShape) -> ModelShape:
        """The preset's or config's shape with the MoE flags applied."""
        moe = shape.moe
        if self.num_experts is not None:
            moe = dataclasses.replace(moe, num_experts=self.num_experts) if moe else MoEShape(
                num_experts=self.num_experts, topk=2, ffn_hidden_size=shape.ffn_hidden_size, norm_topk_prob=True)
        given = [name for name in ("topk", "ffn_hidden_size", "shared_expert_size", "layer_freq", "z_loss_coeff",
                                   "dispatcher", "capacity_factor", "grouped_gemm") if getattr(self, name) is not None]
        if moe is None:
            if given or self.aux_loss_coeff:
                flag = flag_of(MoESettings, (given or ["aux_loss_coeff"])[0])
                raise ConfigError(f"{flag} needs an MoE model: --num-experts N, an MoE preset (--model tiny-moe) or a "
                                  "Qwen2-MoE/Qwen3-MoE --hf-config")
            return shape
        if self.topk is not None:
            moe = dataclasses.replace(moe, topk=self.topk)
        if self.ffn_hidden_size is not None:
            moe = dataclasses.replace(moe, ffn_hidden_size=self.ffn_hidden_size)
        if self.shared_expert_size is not None:
            moe = dataclasses.replace(moe, shared_expert_size=self.shared_expert_size or None)
        if self.layer_freq is not None:
            moe = dataclasses.replace(moe, layer_pattern=_layer_pattern(self.layer_freq, shape.num_layers))
        if not 1 <= moe.topk <= moe.num_experts:
            raise ConfigError(f"--moe-router-topk {moe.topk} must be between 1 and --num-experts {moe.num_experts}")
        if moe.layer_pattern is not None and len(moe.layer_pattern) != shape.num_layers:
            raise ConfigError(f"--moe-layer-freq has {len(moe.layer_pattern)} entries for {shape.num_layers} layers; "
                              "give one 0/1 per layer")
        return dataclasses.replace(shape, moe=moe)

    def check(self, run) -> None:
        """What cannot run with this mesh, engine and backend; chooses the dispatcher."""
        shape, mesh = run.shape, run.mesh
        if getattr(shape, "moe", None) is None:
            return
        if run.engine.engine == "deepspeed":
            raise ConfigError("--engine deepspeed does not run megatron-core's MoE layers (its ZeRO groups do not "
                              "know the expert-parallel groups); train MoE models with --engine megatron")
        if self.aux_loss_scope == "model":
            refused = [(mesh.pp > 1, "--pipeline-model-parallel-size > 1 (it needs every MoE layer's routing on one "
                                     "stage)"),
                       (self.capacity_factor is not None, "--moe-expert-capacity-factor (it counts the routing "
                                                          "before any token is dropped)")]
            for refuse, what in refused:
                if refuse:
                    raise ConfigError(f"--moe-aux-loss-scope model does not take {what}; use --moe-aux-loss-scope "
                                      "layer")
        if mesh.etp > 1 and shape.moe.ffn_hidden_size % mesh.etp:
            raise ConfigError(f"the expert FFN size {shape.moe.ffn_hidden_size} does not divide over "
                              f"--expert-tensor-parallel-size {mesh.etp}")
        if self.grouped_gemm:
            multiple = 8 if run.training.bf16 or run.training.fp16 else 4  # torch._grouped_mm: 16-byte rows
            ffn = shape.moe.ffn_hidden_size // mesh.etp
            for what, size in (("hidden size", shape.hidden_size), ("expert FFN size per expert-TP rank", ffn)):
                if size % multiple:
                    raise ConfigError(f"--moe-grouped-gemm: the {what} {size} is not a multiple of {multiple}, which "
                                      "torch._grouped_mm needs for this dtype; drop the flag to run the experts one "
                                      "by one")
        gloo = run.parallel.backend == "gloo"
        explicit = self.dispatcher
        self.dispatcher = explicit or ("allgather" if gloo and mesh.etp > 1 else "alltoall")
        if self.dispatcher == "alltoall" and gloo and mesh.etp > 1:
            raise ConfigError("--moe-token-dispatcher-type alltoall with --expert-tensor-parallel-size > 1 needs nccl "
                              "(gloo has no uneven all-gather); use --expert-tensor-parallel-size 1 or the allgather "
                              "dispatcher")


def _layer_pattern(text: str, num_layers: int):
    try:
        pattern = tuple(int(x) for x in text.strip("[] ").split(","))
    except ValueError:
        pattern = ()
    if not pattern or set(pattern) - {0, 1}:
        raise ConfigError(f"--moe-layer-freq {text!r}: give an explicit 0/1 list, one entry per layer (e.g. "
                          f"{','.join(['1'] * num_layers)}); megatron-core's integer form means something else "
                          "than Hugging Face's decoder_sparse_step")
    return pattern
