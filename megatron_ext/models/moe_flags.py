"""Mixture-of-Experts flags: the shape overrides, the router's training settings, and every check of MoE against
the mesh and backend that can run before process groups exist (torch-free, like ``arguments``)."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Optional

from megatron_ext.errors import ConfigError
from megatron_ext.flag_types import int_at_least, nonneg_float, nonneg_int, positive_float, positive_int
from megatron_ext.models.qwen.shape import ModelShape, MoEShape


@dataclasses.dataclass(frozen=True)
class MoESettings:
    """How the router trains; the shape (experts, top-k, sizes) lives in ``MoEShape``."""

    aux_loss_coeff: float = 0.0
    aux_loss_scope: str = "layer"  # "model": Qwen's loss over every layer's routing together (models/moe_aux.py)
    z_loss_coeff: Optional[float] = None
    dispatcher: str = "alltoall"
    capacity_factor: Optional[float] = None  # None: dropless
    grouped_gemm: Optional[bool] = None  # None: grouped experts where torch._grouped_mm runs, else SequentialMLP


def add_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("mixture of experts (megatron-core MoELayer; presets qwen1.5-moe-a2.7b, qwen3-30b-a3b, "
                             "tiny-moe)")
    g.add_argument("--num-experts", type=int_at_least(2), default=None,
                   help="routed experts per MoE layer (makes a dense preset MoE, every expert the dense MLP's shape)")
    g.add_argument("--moe-router-topk", type=positive_int, default=None,
                   help="experts per token (default: the shape's, or 2)")
    g.add_argument("--moe-ffn-hidden-size", type=positive_int, default=None, help="each routed expert's FFN size")
    g.add_argument("--moe-shared-expert-intermediate-size", type=nonneg_int, default=None,
                   help="the gated shared expert's FFN size; 0 removes it")
    g.add_argument("--moe-layer-freq", default=None,
                   help="which layers are MoE, an explicit 0/1 list such as 1,0,1,1 (default: the shape's, or all)")
    g.add_argument("--moe-aux-loss-coeff", type=nonneg_float, default=0.0, help="load-balancing loss (Switch/GShard)")
    g.add_argument("--moe-aux-loss-scope", default="layer", choices=["layer", "model"],
                   help="layer: megatron-core's load-balancing loss of each layer, summed; model: Qwen2-MoE's and "
                        "Qwen3-MoE's own (transformers' load_balancing_loss_func), one loss over every layer's "
                        "routing, so --moe-aux-loss-coeff is their router_aux_loss_coef (0.001); no pipeline "
                        "parallelism")
    g.add_argument("--moe-z-loss-coeff", type=nonneg_float, default=None, help="router z-loss (ST-MoE); e.g. 1e-3")
    g.add_argument("--moe-token-dispatcher-type", default=None, choices=["alltoall", "allgather"],
                   help="default: alltoall, or allgather where alltoall cannot run (gloo with expert TP > 1)")
    g.add_argument("--moe-expert-capacity-factor", type=positive_float, default=None,
                   help="drop tokens beyond this multiple of each expert's balanced share (default: dropless)")
    g.add_argument("--moe-grouped-gemm", action=argparse.BooleanOptionalAction, default=None,
                   help="routed experts as two torch._grouped_mm GEMMs (default: on where torch runs them for the "
                        "device, dtype and shapes, else SequentialMLP's loop, said in one line)")


def shape_from_args(shape: ModelShape, args: argparse.Namespace) -> ModelShape:
    """The preset's or config's shape with the MoE flags applied."""
    moe = shape.moe
    if args.num_experts is not None:
        if args.num_experts < 2:
            raise ConfigError(f"--num-experts must be >= 2, got {args.num_experts}")
        moe = dataclasses.replace(moe, num_experts=args.num_experts) if moe else MoEShape(
            num_experts=args.num_experts, topk=2, ffn_hidden_size=shape.ffn_hidden_size, norm_topk_prob=True)
    moe_flags = [f for f in ("moe_router_topk", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
                             "moe_layer_freq", "moe_z_loss_coeff", "moe_token_dispatcher_type",
                             "moe_expert_capacity_factor", "moe_grouped_gemm") if getattr(args, f) is not None]
    if moe is None:
        if moe_flags or args.moe_aux_loss_coeff:
            flag = "--" + (moe_flags or ["moe_aux_loss_coeff"])[0].replace("_", "-")
            raise ConfigError(f"{flag} needs an MoE model: --num-experts N, an MoE preset (--model tiny-moe) or a "
                              "Qwen2-MoE/Qwen3-MoE --hf-config")
        return shape
    if args.moe_router_topk is not None:
        moe = dataclasses.replace(moe, topk=args.moe_router_topk)
    if args.moe_ffn_hidden_size is not None:
        moe = dataclasses.replace(moe, ffn_hidden_size=args.moe_ffn_hidden_size)
    if args.moe_shared_expert_intermediate_size is not None:
        moe = dataclasses.replace(moe, shared_expert_size=args.moe_shared_expert_intermediate_size or None)
    if args.moe_layer_freq is not None:
        moe = dataclasses.replace(moe, layer_pattern=_layer_pattern(args.moe_layer_freq, shape.num_layers))
    if not 1 <= moe.topk <= moe.num_experts:
        raise ConfigError(f"--moe-router-topk {moe.topk} must be between 1 and --num-experts {moe.num_experts}")
    if moe.layer_pattern is not None and len(moe.layer_pattern) != shape.num_layers:
        raise ConfigError(f"--moe-layer-freq has {len(moe.layer_pattern)} entries for {shape.num_layers} layers; "
                          "give one 0/1 per layer")
    return dataclasses.replace(shape, moe=moe)


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


def backend_of(args: argparse.Namespace) -> str:
    if args.distributed_backend:
        return args.distributed_backend
    import torch  # only for MoE runs that did not name the backend

    return "nccl" if torch.cuda.is_available() else "gloo"


def settings_from_args(shape: ModelShape, args: argparse.Namespace, mesh) -> Optional[MoESettings]:
    """The router's settings, the dispatcher chosen for the backend; ConfigError for what cannot run."""
    if shape.moe is None:
        return None
    if args.engine == "deepspeed":
        raise ConfigError("--engine deepspeed does not run megatron-core's MoE layers (its ZeRO groups do not know "
                          "the expert-parallel groups); train MoE models with --engine megatron")
    if args.moe_aux_loss_scope == "model":
        refused = [(mesh.pp > 1, "--pipeline-model-parallel-size > 1 (it needs every MoE layer's routing on one "
                                 "stage)"),
                   (args.moe_expert_capacity_factor is not None, "--moe-expert-capacity-factor (it counts the routing "
                                                                  "before any token is dropped)")]
        for refuse, what in refused:
            if refuse:
                raise ConfigError(f"--moe-aux-loss-scope model does not take {what}; use --moe-aux-loss-scope layer")
    if mesh.etp > 1 and shape.moe.ffn_hidden_size % mesh.etp:
        raise ConfigError(f"the expert FFN size {shape.moe.ffn_hidden_size} does not divide over "
                          f"--expert-tensor-parallel-size {mesh.etp}")
    if args.moe_grouped_gemm:
        multiple = 8 if args.bf16 or args.fp16 else 4  # torch._grouped_mm: 16-byte rows
        ffn = shape.moe.ffn_hidden_size // mesh.etp
        for what, size in (("hidden size", shape.hidden_size), ("expert FFN size per expert-TP rank", ffn)):
            if size % multiple:
                raise ConfigError(f"--moe-grouped-gemm: the {what} {size} is not a multiple of {multiple}, which "
                                  "torch._grouped_mm needs for this dtype; drop the flag to run the experts one by one")
    gloo = backend_of(args) == "gloo"
    dispatcher = args.moe_token_dispatcher_type or ("allgather" if gloo and mesh.etp > 1 else "alltoall")
    if dispatcher == "alltoall" and gloo and mesh.etp > 1:
        raise ConfigError("--moe-token-dispatcher-type alltoall with --expert-tensor-parallel-size > 1 needs nccl "
                          "(gloo has no uneven all-gather); use --expert-tensor-parallel-size 1 or the allgather "
                          "dispatcher")
    return MoESettings(aux_loss_coeff=args.moe_aux_loss_coeff, aux_loss_scope=args.moe_aux_loss_scope,
                       z_loss_coeff=args.moe_z_loss_coeff,
                       dispatcher=dispatcher, capacity_factor=args.moe_expert_capacity_factor,
                       grouped_gemm=args.moe_grouped_gemm)
