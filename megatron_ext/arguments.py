"""Megatron-style command-line flags, model presets and every check that can run before process groups exist.

Bad input must fail here, on every rank, as one line naming the flags and the fix (``ConfigError``), never as a
hang or a stack trace deep inside a collective.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Optional, Sequence

from megatron_ext import config, flag_types, objectives
from megatron_ext.convert import source as pretrained_source
from megatron_ext.engines import engine_flags, optimizer
from megatron_ext.errors import PREFLIGHT, ConfigError, PreflightPassed
from megatron_ext.flag_types import nonneg_int, positive_float, positive_int, shipped
from megatron_ext.mesh import Mesh
from megatron_ext.models import moe_flags
from megatron_ext.models.families import FAMILIES
from megatron_ext.models.qwen.shape import ModelShape
from megatron_ext.observability import profile_flags
from megatron_ext.training import rampup, reliability_flags


def build_parser(description: str = "megatron_ext", family: str = "qwen") -> argparse.ArgumentParser:
    """The flags of an entry point of ``family`` ("qwen" or "vit"): the model and data groups differ."""
    p = flag_types.Parser(description=description, allow_abbrev=False)
    FAMILIES[family].add_model_flags(p)
    if family == "qwen":  # its objectives: SFT, DPO, KTO, reward
        config.add_arguments(p, objectives.SECTIONS)

    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=positive_int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=positive_int, default=1)
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=positive_int, default=None)
    g.add_argument("--context-parallel-size", type=positive_int, default=1)
    g.add_argument("--expert-model-parallel-size", type=positive_int, default=1)
    g.add_argument("--expert-tensor-parallel-size", type=positive_int, default=None,
                   help="defaults to --tensor-model-parallel-size, as in megatron-core")
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--distributed-backend", default=None, choices=["nccl", "gloo"],
                   help="default: nccl when CUDA is available, else gloo; gloo means CPU ranks")
    g.add_argument("--local_rank", "--local-rank", dest="local_rank", type=nonneg_int, default=None,
                   help="set by the deepspeed launcher; ranks come from the environment")

    engine_flags.add_flags(p)
    optimizer.add_flags(p)
    FAMILIES[family].add_data_flags(p)

    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=positive_int, default=1)
    g.add_argument("--global-batch-size", type=positive_int, default=None, help="default: micro-batch size x DP")
    g.add_argument("--seq-length", type=positive_int, default=128)
    g.add_argument("--train-samples", type=positive_int, default=None,
                   help="the run's length in samples instead (--train-samples // --global-batch-size steps; the "
                        "learning-rate schedule then counts samples: --lr-*-samples)")
    g.add_argument("--train-iters", type=nonneg_int, default=None,
                   help="optimizer steps (default 10); 0 builds and loads the model and exports it (--save-hf, "
                        "--save-peft) as it starts")
    g.add_argument("--seed", type=flag_types.int_range(0, 2**32 - 1), default=1234)
    if family == "gpt":
        rampup.add_flag(g)
    precision = g.add_mutually_exclusive_group()
    precision.add_argument("--bf16", action="store_true")
    precision.add_argument("--fp16", action="store_true")
    g.add_argument("--recompute-granularity", default=None, choices=["full", "selective"])
    g.add_argument("--recompute-method", default=None, choices=["uniform", "block"],
                   help="with full recompute: uniform (default) checkpoints every group of --recompute-num-layers "
                        "layers; block recomputes the first --recompute-num-layers layers of each pipeline chunk "
                        "and keeps the rest's activations")
    g.add_argument("--recompute-num-layers", type=positive_int, default=1,
                   help="with full recompute: layers per checkpointed group (uniform: DeepSpeed's "
                        "activation_checkpoint_interval), or layers recomputed per pipeline chunk (block)")
    g.add_argument("--eval-interval", type=nonneg_int, default=0,
                   help="validate every N steps and after the last; 0 disables")
    g.add_argument("--eval-iters", type=positive_int, default=4, help="validation global batches per evaluation")
    g.add_argument("--exit-interval", type=positive_int, default=None, help="save (with --save) and exit after step N")
    g.add_argument("--manual-gc", action=argparse.BooleanOptionalAction, default=True,
                   help="Python's garbage collector off during training, run on every rank at the same steps "
                        "(--manual-gc-interval): no rank pauses at its own moment and stalls the others' collectives "
                        "(Megatron-LM's flag; torchtitan's default)")
    g.add_argument("--manual-gc-interval", type=nonneg_int, default=50,
                   help="with --manual-gc: collect every N steps (0: never while training)")

    g = p.add_argument_group("fusions (torch stand-ins for what TransformerEngine/apex would fuse)")
    g.add_argument("--no-gradient-accumulation-fusion", dest="gradient_accumulation_fusion", action="store_false",
                   help="megatron engine: add each weight gradient to the fp32 main_grad after its GEMM instead of "
                        "accumulating inside it")
    g.add_argument("--cross-entropy-loss-fusion", action="store_true",
                   help="the output layer and the vocab-parallel cross entropy in chunks of tokens: the [tokens, "
                        "vocabulary] logits never exist whole (GiBs at a 152k vocabulary), for one more output-layer "
                        "GEMM in backward")

    g = p.add_argument_group("checkpoints")
    g.add_argument("--save", default=None, help="directory for megatron-core distributed checkpoints")
    g.add_argument("--save-interval", type=positive_int, default=None)
    g.add_argument("--async-save", action="store_true",
                   help="write checkpoints in the background: training waits only while the state is copied out")
    g.add_argument("--load", default=None, help="resume everything: model, optimizer, scheduler, data, RNG")
    g.add_argument("--finetune", action="store_true", help="with --load: weights only, fresh optimizer and data")

    g = p.add_argument_group("logging")
    g.add_argument("--log-dir", default=None, help="metrics.jsonl, summary and plots")
    g.add_argument("--tensorboard-dir", default=None)
    g.add_argument("--wandb-project", default=None)
    g.add_argument("--wandb-exp-name", default=None)
    g.add_argument("--peak-tflops", type=positive_float, default=None,
                   help="per-device peak for MFU (default: by device)")
    profile_flags.add_flags(p)
    reliability_flags.add_flags(p)
    pretrained_source.add_flags(p)
    return p


def mesh_from_args(args: argparse.Namespace, world_size: int, num_layers: int,
                   num_experts: Optional[int] = None) -> Mesh:
    """Derive the mesh from the flags; ConfigError (one line, with the fix) on any inconsistency."""
    tp, pp, cp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size
    ep = args.expert_model_parallel_size
    etp = tp if args.expert_tensor_parallel_size is None else args.expert_tensor_parallel_size
    for flag, value in (("--tensor-model-parallel-size", tp), ("--pipeline-model-parallel-size", pp),
                        ("--context-parallel-size", cp), ("--expert-model-parallel-size", ep),
                        ("--expert-tensor-parallel-size", etp)):
        if value < 1:
            raise ConfigError(f"{flag} must be >= 1, got {value}")
    model_parallel = tp * pp * cp
    if world_size % model_parallel:
        raise ConfigError(
            f"world size {world_size} is not divisible by TP x PP x CP = {tp} x {pp} x {cp} = {model_parallel} "
            f"(--tensor-model-parallel-size, --pipeline-model-parallel-size, --context-parallel-size); "
            f"launch a multiple of {model_parallel} processes or shrink the mesh")
    if args.sequence_parallel and tp == 1:
        raise ConfigError("--sequence-parallel needs --tensor-model-parallel-size > 1 (it splits activations over TP)")

    vpp = None
    if args.num_layers_per_virtual_pipeline_stage is not None:
        per_stage = args.num_layers_per_virtual_pipeline_stage
        if pp == 1:
            raise ConfigError("--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size > 1")
        if per_stage < 1 or num_layers % (pp * per_stage):
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
        if tp > 1 and not args.sequence_parallel:
            raise ConfigError("MoE with --tensor-model-parallel-size > 1 needs --sequence-parallel (megatron-core)")
        if ep == 1 and etp != tp:
            # megatron-core 0.16.1 tags experts as expert-parallel (allreduce=False) only at EP > 1: at EP 1 its DDP
            # reduces their gradients over the dense data-parallel group, not the expert one that etp < tp needs
            raise ConfigError(f"--expert-tensor-parallel-size {etp} differs from --tensor-model-parallel-size {tp} "
                              f"only with --expert-model-parallel-size > 1 (megatron-core treats experts as dense "
                              f"parameters at EP 1); drop the flag or raise the expert-parallel size")
    return Mesh(world=world_size, tp=tp, pp=pp, vpp=vpp, cp=cp, ep=ep, etp=etp,
                sequence_parallel=args.sequence_parallel)


def check_model_against_mesh(shape: ModelShape, mesh: Mesh, args: argparse.Namespace) -> None:
    tp = mesh.tp
    if shape.num_attention_heads % tp:
        raise ConfigError(f"{shape.num_attention_heads} attention heads do not divide over "
                          f"--tensor-model-parallel-size {tp}; use a divisor of {shape.num_attention_heads}")
    if shape.num_query_groups % tp:
        raise ConfigError(f"{shape.num_query_groups} key/value groups (GQA) do not divide over "
                          f"--tensor-model-parallel-size {tp}; use a divisor of {shape.num_query_groups}")
    if mesh.sequence_parallel and args.seq_length % tp:
        raise ConfigError(f"--seq-length {args.seq_length} must be divisible by --tensor-model-parallel-size {tp} "
                          "with --sequence-parallel")
    if mesh.cp > 1:  # each CP rank holds 2 of 2 x CP chunks of the sequence (of every packed document)
        multiple = 2 * mesh.cp * (tp if mesh.sequence_parallel else 1)
        if args.seq_length % multiple:
            sp = f" x --tensor-model-parallel-size {tp} (--sequence-parallel)" if mesh.sequence_parallel else ""
            raise ConfigError(f"--seq-length {args.seq_length} must be divisible by 2 x --context-parallel-size "
                              f"{mesh.cp}{sp} = {multiple}; use a multiple of {multiple}")
    per_chunk = shape.num_layers // (mesh.pp * (mesh.vpp or 1))
    if args.recompute_method is not None and args.recompute_granularity != "full":
        raise ConfigError(f"--recompute-method {args.recompute_method} chooses which layers full recompute "
                          "checkpoints; add --recompute-granularity full or drop it")
    if args.recompute_method == "block" and args.recompute_num_layers > per_chunk:
        raise ConfigError(f"--recompute-num-layers {args.recompute_num_layers} exceeds the {per_chunk} layers of "
                          f"each pipeline chunk (--recompute-method block recomputes that many of them); use at most "
                          f"{per_chunk}")
    if args.recompute_method != "block" and per_chunk % args.recompute_num_layers:
        raise ConfigError(f"--recompute-num-layers {args.recompute_num_layers} must divide the {per_chunk} layers of "
                          f"each pipeline chunk (or use --recompute-method block: that many layers of each recomputed)")
    if args.transformer_impl == "transformer_engine":
        try:
            import transformer_engine  # noqa: F401
        except ImportError:
            raise ConfigError("--transformer-impl transformer_engine needs TransformerEngine installed; "
                              "use --transformer-impl local") from None


def check_batch_sizes(args: argparse.Namespace, mesh: Mesh) -> int:
    """Fill in --global-batch-size and return the number of micro-batches per step per DP rank."""
    if args.micro_batch_size < 1:
        raise ConfigError(f"--micro-batch-size must be >= 1, got {args.micro_batch_size}")
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * mesh.dp
    per_step = args.micro_batch_size * mesh.dp
    if args.global_batch_size % per_step:
        raise ConfigError(f"--global-batch-size {args.global_batch_size} is not a multiple of --micro-batch-size "
                          f"{args.micro_batch_size} x DP {mesh.dp} = {per_step}; gradient accumulation needs whole "
                          f"micro-batches")
    num_microbatches = args.global_batch_size // per_step
    if mesh.vpp and num_microbatches < mesh.pp:
        raise ConfigError(f"the interleaved schedule needs at least --pipeline-model-parallel-size {mesh.pp} "
                          f"micro-batches per step, got {num_microbatches}; raise --global-batch-size to "
                          f"{mesh.pp * per_step} or more")
    return num_microbatches


@dataclasses.dataclass
class RunConfig:
    args: argparse.Namespace
    shape: ModelShape
    mesh: Mesh
    num_microbatches: int
    lora: Optional["LoRAConfig"] = None  # noqa: F821 (models.lora; None trains every weight)
    moe: Optional[moe_flags.MoESettings] = None  # the router's training settings; None for dense models
    profile: Optional[profile_flags.ProfileSettings] = None  # --profile: which steps and ranks, where
    reliability: reliability_flags.ReliabilitySettings = reliability_flags.ReliabilitySettings()
    objective: Optional[objectives.config.ObjectiveConfig] = None  # --objective's section (None: the family's loss)


def parse(argv: Optional[Sequence[str]] = None, world_size: Optional[int] = None,
          description: str = "megatron_ext", family: str = "qwen") -> RunConfig:
    """Parse and validate everything; no process group is touched."""
    args = build_parser(description, family).parse_args(argv)
    world_size = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
    pretrained_source.apply_pretrained(args, family)
    shape = FAMILIES[family].shape(args)
    objective = objectives.from_args(args) if hasattr(args, "objective") else None
    if getattr(objective, "HEAD", "lm") == "score":  # a score head in the output layer's place
        shape = dataclasses.replace(shape, head="score")
    elif getattr(shape, "head", "lm") == "score":
        raise ConfigError("the model is a reward model (a sequence classifier of one label): train it with "
                          "--objective reward")
    source = args.pretrained_source
    args.model = args.model or (source.name if source else os.path.basename(os.path.dirname(os.path.abspath(args.hf_config))) if args.hf_config else "tiny")  # a label
    mesh = mesh_from_args(args, world_size, shape.num_layers, getattr(shape, "num_experts", None))
    if family == "vit" and mesh.cp > 1:
        raise ConfigError("--context-parallel-size > 1 is not supported for ViT (context parallelism here is causal "
                          "attention for language models; a ViT's few hundred tokens need no split); use 1")
    if family == "vit" and mesh.sequence_parallel:
        raise ConfigError(f"--sequence-parallel is not supported for ViT: its {shape.seq_length} tokens would need "
                          "padding and a mask to split over TP; use TP without --sequence-parallel")
    if family == "vit" and args.cross_entropy_loss_fusion:
        raise ConfigError("--cross-entropy-loss-fusion fuses a language model's output layer over its vocabulary; "
                          "a ViT's classifier head is small: drop the flag")
    if family == "vit" and args.engine == "deepspeed" and mesh.pp > 1:
        raise ConfigError("DeepSpeed's pipeline engine runs language models only so far; use --engine megatron "
                          "for a pipelined ViT, or --pipeline-model-parallel-size 1")
    check_model_against_mesh(shape, mesh, args)
    num_microbatches = check_batch_sizes(args, mesh)
    optimizer.check(args)
    args.rampup = rampup.from_args(args, mesh)
    if args.rampup:  # Megatron-LM's step count for the ramp
        args.train_iters = args.rampup.train_iters(args.train_samples)
    engine_flags.check(args, mesh)
    moe = moe_flags.settings_from_args(shape, args, mesh) if isinstance(shape, ModelShape) else None
    if family == "qwen":  # how SFT rows are read: checked now, used by the data build
        from megatron_ext.data import chat

        from megatron_ext.data import mixture

        args.row_format = chat.row_format(args.data_format, args.data_columns, args.data_role_tags)
        args.data_mixture = mixture.parse(args.data_path)  # [(weight, path)]
        args.data_path = args.data_path[0] if len(args.data_path) == 1 else args.data_path
        if args.eval_generate_samples and (args.mock_data or not args.eval_interval):
            raise ConfigError(f"--eval-generate-samples {args.eval_generate_samples} answers held-out rows of "
                              "--data-path at every evaluation: " + (
                                  "drop --mock-data" if args.mock_data else "give --eval-interval N too"))
    if family == "gpt":  # which corpora: checked now (weights, combinations), read by data/pretrain.py
        from megatron_ext.data import mixture

        if args.train_data_path and args.data_path:
            raise ConfigError("--data-path and --train-data-path both choose the training data; keep one (--split cuts "
                              "--data-path, --train-data-path/--valid-data-path are the splits themselves)")
        if args.valid_data_path and not args.train_data_path:
            raise ConfigError("--valid-data-path needs --train-data-path (with --data-path, --split makes validation)")
        if not (args.train_data_path or args.data_path):
            args.data_path = [shipped("examples/data/tiny_shakespeare_sample.txt")]
        for values in (args.data_path, args.train_data_path, args.valid_data_path):
            if values:
                mixture.parse(values)
        if args.reset_attention_mask and not args.reset_position_ids:
            raise ConfigError("--reset-attention-mask packs each sample's documents, whose positions restart too: add "
                              "--reset-position-ids")
        if isinstance(shape, ModelShape) and args.reset_position_ids and not args.reset_attention_mask:
            raise ConfigError("--reset-position-ids: a Qwen's rotary positions restart with its packed documents "
                              "only; add --reset-attention-mask")
        if args.reset_attention_mask and mesh.cp > 1:
            raise ConfigError("--reset-attention-mask with --context-parallel-size > 1 would need every document "
                              "padded to a multiple of 2 x CP; drop one of them")
    lora = None
    if getattr(args, "lora_rank", 0) or getattr(args, "pretrained_adapter", None):
        from megatron_ext.models.lora import config_from_args

        adapter = None
        if getattr(args, "pretrained_adapter", None):  # its rank, alpha and targets replace the flags'
            from megatron_ext.convert import adapters

            adapter = adapters.lora_fields(args.pretrained_adapter, args, shape)
        lora = config_from_args(args, mesh.tp, adapter)
        experts = sorted({"fc1", "fc2"} & set(lora.targets)) if getattr(shape, "moe", None) else []
        if experts and lora.dropout:
            raise ConfigError(f"--lora-dropout {lora.dropout}: adapters on an MoE model's experts "
                              f"({','.join(experts)}) take no dropout (PEFT refuses it on them); use 0")
        if experts and args.moe_grouped_gemm is False and (mesh.ep > 1 or mesh.etp > 1):
            raise ConfigError("--no-moe-grouped-gemm: LoRA on the experts under expert or expert-tensor "
                              "parallelism needs the grouped experts; drop the flag")
    if getattr(args, "save_peft", None):
        if lora is None:
            raise ConfigError(f"--save-peft {args.save_peft} writes a LoRA run's adapters; add --lora-rank N (or "
                              "--pretrained-adapter DIR)")
        from megatron_ext.convert import adapters

        adapters.check_save_dir(args.save_peft)
        adapters.check_expressible(shape, lora)
    if os.environ.get(PREFLIGHT):  # megatron_ext.launch's check before any rank starts: the files too, then stop
        FAMILIES[family].check_files(args)
        raise PreflightPassed()
    run = RunConfig(args=args, shape=shape, mesh=mesh, num_microbatches=num_microbatches, lora=lora,
                    moe=moe, profile=profile_flags.settings_from_args(args, world_size),
                    reliability=reliability_flags.settings_from_args(args), objective=objective)
    if objective is not None:
        objective.check(run)
    return run
