"""Megatron-style command-line flags, model presets and every check that can run before process groups exist.

Bad input must fail here, on every rank, as one line naming the flags and the fix (``ConfigError``), never as a
hang or a stack trace deep inside a collective.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Optional, Sequence, Tuple, Type, TypeVar

from megatron_ext import config, flag_types, objectives
from megatron_ext.config import Section
from megatron_ext.config.engine import Engine
from megatron_ext.config.parallel import Parallelism
from megatron_ext.config.profiling import Profiling
from megatron_ext.config.reliability import Reliability
from megatron_ext.config.training import Checkpoint, Fusions, Logging, Training
from megatron_ext.convert import source as pretrained_source
from megatron_ext.convert.source import Pretrained
from megatron_ext.engines.optimizer import OptimizerSettings
from megatron_ext.errors import PREFLIGHT, ConfigError, PreflightPassed
from megatron_ext.mesh import Mesh
from megatron_ext.models import moe_flags
from megatron_ext.models.families import FAMILIES, LoRA
from megatron_ext.models.qwen.config import Adapters
from megatron_ext.models.qwen.shape import ModelShape
from megatron_ext.config.rampup import Rampup

S = TypeVar("S", bound=config.Section)


# The sections every entry point shares (RunConfig's fields), in --help's order: the family's model flags come
# first, its data flags after the optimizer's, its own training flags after the training section's.
SECTIONS = dict(parallel=Parallelism, engine=Engine, optimizer=OptimizerSettings, training=Training, fusions=Fusions,
                checkpoint=Checkpoint, logging=Logging, profile=Profiling, reliability=Reliability,
                pretrained=Pretrained)


def build_parser(description: str = "megatron_ext", family: str = "qwen") -> argparse.ArgumentParser:
    """The flags of an entry point of ``family`` ("qwen", "vit" or "gpt"): the model and data groups differ."""
    fam, shared = FAMILIES[family], list(SECTIONS.values())
    p = flag_types.Parser(description=description, allow_abbrev=False)
    fam.add_model_flags(p)
    if fam.objectives:  # SFT, DPO, KTO, reward
        config.add_arguments(p, objectives.SECTIONS)
    config.add_arguments(p, shared[:3])
    fam.add_data_flags(p)
    config.add_arguments(p, [shared[3], *fam.training, *shared[4:]])
    return p


@dataclasses.dataclass
class RunConfig:
    """A validated run: its typed sections (each option lives in exactly one), the model's shape and the mesh."""

    shape: ModelShape
    mesh: Mesh
    label: str  # the model's name in logs and summaries (--model, --pretrained's, or the --hf-config directory's)
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
    model: Section  # the family's model section (models/<family>/config.py)
    data: Section  # the family's data section
    more: Tuple[Section, ...] = ()  # the family's other sections: LoRA, adapters, MoE, the ramp-up
    objective: Optional[objectives.config.ObjectiveConfig] = None  # --objective's section (None: the family's loss)
    moe: Optional[moe_flags.MoESettings] = None  # the router's settings; None for dense models
    rampup: Optional[Rampup] = None  # pretrain_gpt.py --rampup-batch-size
    lora: Optional["LoRAConfig"] = None  # noqa: F821 (models.lora; None trains every weight)

    @property
    def num_microbatches(self) -> int:
        return self.training.num_microbatches

    def section(self, cls: Type[S]) -> Optional[S]:
        """The family's section of type ``cls`` (LoRA, Adapters, ...), or None where the family has none."""
        return next((s for s in self.more if isinstance(s, cls)), None)

    @property
    def sections(self) -> Tuple[Section, ...]:
        return (self.model, self.parallel, self.engine, self.optimizer, self.data, self.training, self.fusions,
                self.checkpoint, self.logging, self.profile, self.reliability, self.pretrained, *self.more) + (
                    (self.objective,) if self.objective is not None else ())

    def engine_sections(self) -> dict:
        """What ``training.run.build_engine`` is built from."""
        return dict(mesh=self.mesh, engine=self.engine, training=self.training, optimizer=self.optimizer,
                    fusions=self.fusions)

    def flags(self) -> dict:
        """Every option's value by its flag's name (``model``: the label), as summaries and loggers record them;
        ``types.SimpleNamespace(**run.flags())`` reads them by name."""
        return dict(config.flags(self.sections), model=self.label)


def parse(argv: Optional[Sequence[str]] = None, world_size: Optional[int] = None,
          description: str = "megatron_ext", family: str = "qwen") -> RunConfig:
    """Parse and validate everything; no process group is touched."""
    fam, parser = FAMILIES[family], build_parser(description, family)
    args = parser.parse_args(argv)  # read here only: every option becomes its section's field
    built = {cls: config.from_namespace(cls, args) for cls in parser.sections}
    world_size = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
    sections = {name: built[cls] for name, cls in SECTIONS.items()}
    model, data, more = built[fam.model], built[fam.data], tuple(built[cls] for cls in fam.sections())
    source = pretrained_source.apply_pretrained(sections["pretrained"], model, data, sections["checkpoint"], family)
    shape = model.shape(sections["training"], built.get(moe_flags.MoESettings))  # (ViT: its patches' --seq-length)
    objective = objectives.chosen(built, data) if fam.objectives else None  # (preference data by default)
    if getattr(objective, "HEAD", "lm") == "score":  # a score head in the output layer's place
        shape = dataclasses.replace(shape, head="score")
    elif getattr(shape, "head", "lm") == "score":
        raise ConfigError("the model is a reward model (a sequence classifier of one label): train it with "
                          "--objective reward")
    label = model.model or (source.name if source else os.path.basename(os.path.dirname(os.path.abspath(
        model.hf_config))) if model.hf_config else "tiny")
    mesh = sections["parallel"].mesh(world_size, shape.num_layers, getattr(shape, "num_experts", None))
    run = RunConfig(shape=shape, mesh=mesh, label=label, model=model, data=data, more=more, objective=objective,
                    **sections)
    run.moe = run.section(moe_flags.MoESettings) if getattr(shape, "moe", None) else None
    # Each section checks itself against the rest: what the family's model refuses, the batch, the schedule in its
    # unit, the family's own (MoE, the ramp-up), the engine, ..., the data; then the adapters and the objective.
    for section in (run.model, run.training, run.optimizer, *run.more, run.engine, run.fusions, run.checkpoint,
                    run.reliability, run.profile, run.data):
        section.check(run)
    run.lora = _lora(run)
    if objective is not None:
        objective.check(run)
    if os.environ.get(PREFLIGHT):  # megatron_ext.launch's check before any rank starts: the files too, then stop
        if not getattr(run.data, "mock_data", False):
            run.data.check_files()
        raise PreflightPassed()
    return run


def _lora(run: RunConfig):
    """The adapters' config from the LoRA flags or --pretrained-adapter's (None: every weight trains), and what
    cannot take them; --save-peft's directory and the model's expressibility as PEFT's."""
    flags, adapters = run.section(LoRA), run.section(Adapters)
    given = adapters.pretrained_adapter if adapters else None
    lora = None
    if flags is not None and (flags.lora_rank or given):
        from megatron_ext.models.lora import config_of

        adapter = None
        if given:  # its rank, alpha and targets replace the flags'
            from megatron_ext.convert import adapters as peft

            adapter = peft.lora_fields(given, flags, run.pretrained.pretrained, run.shape)
        lora = config_of(flags, run.mesh.tp, adapter)
        experts = sorted({"fc1", "fc2"} & set(lora.targets)) if getattr(run.shape, "moe", None) else []
        if experts and lora.dropout:
            raise ConfigError(f"--lora-dropout {lora.dropout}: adapters on an MoE model's experts "
                              f"({','.join(experts)}) take no dropout (PEFT refuses it on them); use 0")
        if experts and run.moe.grouped_gemm is False and (run.mesh.ep > 1 or run.mesh.etp > 1):
            raise ConfigError("--no-moe-grouped-gemm: LoRA on the experts under expert or expert-tensor "
                              "parallelism needs the grouped experts; drop the flag")
    if adapters is not None and adapters.save_peft:
        if lora is None:
            raise ConfigError(f"--save-peft {adapters.save_peft} writes a LoRA run's adapters; add --lora-rank N (or "
                              "--pretrained-adapter DIR)")
        from megatron_ext.convert import adapters as peft

        peft.check_save_dir(adapters.save_peft)
        peft.check_expressible(run.shape, lora)
    return lora
