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
from megatron_ext.config.engine import Engine
from megatron_ext.config.parallel import Parallelism
from megatron_ext.config.profiling import Profiling
from megatron_ext.config.reliability import Reliability
from megatron_ext.config.training import Checkpoint, Fusions, Logging, Training
from megatron_ext.convert import source as pretrained_source
from megatron_ext.convert.source import Pretrained
from megatron_ext.engines.optimizer import OptimizerSettings
from megatron_ext.errors import PREFLIGHT, ConfigError, PreflightPassed
from megatron_ext.flag_types import shipped
from megatron_ext.mesh import Mesh
from megatron_ext.models import moe_flags
from megatron_ext.models.families import FAMILIES
from megatron_ext.models.qwen.shape import ModelShape
from megatron_ext.training import rampup


# The sections every entry point shares, in --help's order (the family's model flags come first, its data flags
# after the optimizer's).
CORE = (Parallelism, Engine, OptimizerSettings)
LATER = (Training, Fusions, Checkpoint, Logging, Profiling, Reliability, Pretrained)
SECTIONS = dict(parallel=Parallelism, engine=Engine, optimizer=OptimizerSettings, training=Training, fusions=Fusions,
                checkpoint=Checkpoint, logging=Logging, profile=Profiling, reliability=Reliability,
                pretrained=Pretrained)


def build_parser(description: str = "megatron_ext", family: str = "qwen") -> argparse.ArgumentParser:
    """The flags of an entry point of ``family`` ("qwen", "vit" or "gpt"): the model and data groups differ."""
    p = flag_types.Parser(description=description, allow_abbrev=False)
    FAMILIES[family].add_model_flags(p)
    if family == "qwen":  # its objectives: SFT, DPO, KTO, reward
        config.add_arguments(p, objectives.SECTIONS)
    config.add_arguments(p, CORE)
    FAMILIES[family].add_data_flags(p)
    config.add_arguments(p, LATER[:1] + ((rampup.RampupFlags,) if family == "gpt" else ()) + LATER[1:])
    return p


@dataclasses.dataclass
class RunConfig:
    """A validated run: its sections, the model's shape and the mesh. ``args``: the family's and the objective's
    flags, read from the namespace until they are sections too."""

    args: argparse.Namespace
    shape: ModelShape
    mesh: Mesh
    parallel: Parallelism
    engine: Engine
    optimizer: OptimizerSettings
    training: Training
    fusions: Fusions
    checkpoint: Checkpoint
    logging: Logging
    profile: Profiling
    reliability: Reliability
    pretrained: Pretrained
    moe: Optional[moe_flags.MoESettings] = None  # the router's settings; None for dense models
    rampup: Optional[rampup.Rampup] = None  # pretrain_gpt.py --rampup-batch-size
    lora: Optional["LoRAConfig"] = None  # noqa: F821 (models.lora; None trains every weight)
    objective: Optional[objectives.config.ObjectiveConfig] = None  # --objective's section (None: the family's loss)

    @property
    def num_microbatches(self) -> int:
        return self.training.num_microbatches

    @property
    def sections(self):
        return (self.parallel, self.engine, self.optimizer, self.training, self.fusions, self.checkpoint,
                self.logging, self.profile, self.reliability, self.pretrained) + ((self.moe,) if self.moe else ())

    def engine_sections(self) -> dict:
        """What ``training.run.build_engine`` is built from."""
        return dict(mesh=self.mesh, engine=self.engine, training=self.training, optimizer=self.optimizer,
                    fusions=self.fusions)

    def flags(self) -> dict:
        """Every option's value, as a run's summary and loggers record it."""
        return dict(vars(self.args), **config.flags(self.sections))


def parse(argv: Optional[Sequence[str]] = None, world_size: Optional[int] = None,
          description: str = "megatron_ext", family: str = "qwen") -> RunConfig:
    """Parse and validate everything; no process group is touched."""
    args = build_parser(description, family).parse_args(argv)
    world_size = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
    pretrained_source.apply_pretrained(args, family)
    shape = FAMILIES[family].shape(args)  # (a ViT's --seq-length is its patch count)
    sections = {name: config.from_namespace(cls, args) for name, cls in SECTIONS.items()}
    sections["pretrained"].source = args.pretrained_source
    objective = objectives.from_args(args) if hasattr(args, "objective") else None
    if getattr(objective, "HEAD", "lm") == "score":  # a score head in the output layer's place
        shape = dataclasses.replace(shape, head="score")
    elif getattr(shape, "head", "lm") == "score":
        raise ConfigError("the model is a reward model (a sequence classifier of one label): train it with "
                          "--objective reward")
    source = args.pretrained_source
    args.model = args.model or (source.name if source else os.path.basename(os.path.dirname(os.path.abspath(args.hf_config))) if args.hf_config else "tiny")  # a label
    mesh = sections["parallel"].mesh(world_size, shape.num_layers, getattr(shape, "num_experts", None))
    moe = config.from_namespace(moe_flags.MoESettings, args) if getattr(shape, "moe", None) else None
    run = RunConfig(args=args, shape=shape, mesh=mesh, moe=moe, **sections)
    if family == "vit" and mesh.cp > 1:
        raise ConfigError("--context-parallel-size > 1 is not supported for ViT (context parallelism here is causal "
                          "attention for language models; a ViT's few hundred tokens need no split); use 1")
    if family == "vit" and mesh.sequence_parallel:
        raise ConfigError(f"--sequence-parallel is not supported for ViT: its {shape.seq_length} tokens would need "
                          "padding and a mask to split over TP; use TP without --sequence-parallel")
    if family == "vit" and run.fusions.cross_entropy_loss_fusion:
        raise ConfigError("--cross-entropy-loss-fusion fuses a language model's output layer over its vocabulary; "
                          "a ViT's classifier head is small: drop the flag")
    if family == "vit" and run.engine.engine == "deepspeed" and mesh.pp > 1:
        raise ConfigError("DeepSpeed's pipeline engine runs language models only so far; use --engine megatron "
                          "for a pipelined ViT, or --pipeline-model-parallel-size 1")
    if getattr(args, "transformer_impl", None) == "transformer_engine":
        try:
            import transformer_engine  # noqa: F401
        except ImportError:
            raise ConfigError("--transformer-impl transformer_engine needs TransformerEngine installed; "
                              "use --transformer-impl local") from None
    for section in (run.training, run.optimizer):  # the batch, then the schedule in its unit
        section.check(run)
    if family == "gpt":
        run.rampup = rampup.from_flags(config.from_namespace(rampup.RampupFlags, args), run)
        if run.rampup:  # Megatron-LM's step count for the ramp
            run.training.train_iters = run.rampup.train_iters(run.training.train_samples)
            run.optimizer.rampup = run.rampup
    for section in (run.engine, run.checkpoint, run.reliability, run.profile) + ((moe,) if moe else ()):
        section.check(run)
    config.mirror(run.sections, args)  # until every reader of args reads its section
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
    run.lora, run.objective = lora, objective
    if objective is not None:
        objective.check(run)
    return run
