"""The run's length, batches, precision, recompute, evaluation and fusions; where checkpoints and logs go."""

from __future__ import annotations

import dataclasses
from typing import Optional

from megatron_ext.config import Section, option
from megatron_ext.errors import ConfigError
from megatron_ext.flag_types import int_range, nonneg_int, positive_float, positive_int


@dataclasses.dataclass
class Training(Section):
    GROUP = "training"
    micro_batch_size: int = option(1, type=positive_int)
    global_batch_size: Optional[int] = option(None, type=positive_int, help="default: micro-batch size x DP")
    seq_length: int = option(128, type=positive_int)
    train_samples: Optional[int] = option(
        None, type=positive_int, help="the run's length in samples instead (--train-samples // --global-batch-size "
        "steps; the learning-rate schedule then counts samples: --lr-*-samples)")
    train_iters: Optional[int] = option(
        None, type=nonneg_int, help="optimizer steps (default 10); 0 builds and loads the model and exports it "
        "(--save-hf, --save-peft) as it starts")
    seed: int = option(1234, type=int_range(0, 2**32 - 1))
    bf16: bool = option(False, exclusive="precision")
    fp16: bool = option(False, exclusive="precision")
    recompute_granularity: Optional[str] = option(None, choices=("full", "selective"))
    recompute_method: Optional[str] = option(
        None, choices=("uniform", "block"), help="with full recompute: uniform (default) checkpoints every group of "
        "--recompute-num-layers layers; block recomputes the first --recompute-num-layers layers of each pipeline "
        "chunk and keeps the rest's activations")
    recompute_num_layers: int = option(
        1, type=positive_int, help="with full recompute: layers per checkpointed group (uniform: DeepSpeed's "
        "activation_checkpoint_interval), or layers recomputed per pipeline chunk (block)")
    eval_interval: int = option(0, type=nonneg_int, help="validate every N steps and after the last; 0 disables")
    eval_iters: int = option(4, type=positive_int, help="validation global batches per evaluation")
    exit_interval: Optional[int] = option(None, type=positive_int, help="save (with --save) and exit after step N")
    manual_gc: bool = option(
        True, negate=False, help="Python's garbage collector off during training, run on every rank at the same "
        "steps (--manual-gc-interval): no rank pauses at its own moment and stalls the others' collectives "
        "(Megatron-LM's flag; torchtitan's default)")
    manual_gc_interval: int = option(50, type=nonneg_int,
                                     help="with --manual-gc: collect every N steps (0: never while training)")
    num_microbatches: int = option(1, cli=False)  # per step and DP rank: check() derives it

    @property
    def gc_interval(self) -> Optional[int]:
        return self.manual_gc_interval if self.manual_gc else None

    def params_dtype(self, engine: str):
        """The dtype parameters are built in: fp32 under --engine fsdp, whose master weights FSDP casts."""
        import torch

        if engine == "fsdp":
            return torch.float32
        return self.compute_dtype

    @property
    def compute_dtype(self):
        import torch

        return torch.bfloat16 if self.bf16 else torch.float16 if self.fp16 else torch.float32

    def check(self, run) -> None:
        """Fills in --global-batch-size and the micro-batches per step; the model against the mesh."""
        mesh, shape = run.mesh, run.shape
        if self.global_batch_size is None:
            self.global_batch_size = self.micro_batch_size * mesh.dp
        per_step = self.micro_batch_size * mesh.dp
        if self.global_batch_size % per_step:
            raise ConfigError(f"--global-batch-size {self.global_batch_size} is not a multiple of --micro-batch-size "
                              f"{self.micro_batch_size} x DP {mesh.dp} = {per_step}; gradient accumulation needs "
                              f"whole micro-batches")
        self.num_microbatches = self.global_batch_size // per_step
        if mesh.vpp and self.num_microbatches < mesh.pp:
            raise ConfigError(f"the interleaved schedule needs at least --pipeline-model-parallel-size {mesh.pp} "
                              f"micro-batches per step, got {self.num_microbatches}; raise --global-batch-size to "
                              f"{mesh.pp * per_step} or more")
        tp = mesh.tp
        if shape.num_attention_heads % tp:
            raise ConfigError(f"{shape.num_attention_heads} attention heads do not divide over "
                              f"--tensor-model-parallel-size {tp}; use a divisor of {shape.num_attention_heads}")
        if shape.num_query_groups % tp:
            raise ConfigError(f"{shape.num_query_groups} key/value groups (GQA) do not divide over "
                              f"--tensor-model-parallel-size {tp}; use a divisor of {shape.num_query_groups}")
        if mesh.sequence_parallel and self.seq_length % tp:
            raise ConfigError(f"--seq-length {self.seq_length} must be divisible by --tensor-model-parallel-size {tp} "
                              "with --sequence-parallel")
        if mesh.cp > 1:  # each CP rank holds 2 of 2 x CP chunks of the sequence (of every packed document)
            multiple = 2 * mesh.cp * (tp if mesh.sequence_parallel else 1)
            if self.seq_length % multiple:
                sp = f" x --tensor-model-parallel-size {tp} (--sequence-parallel)" if mesh.sequence_parallel else ""
                raise ConfigError(f"--seq-length {self.seq_length} must be divisible by 2 x --context-parallel-size "
                                  f"{mesh.cp}{sp} = {multiple}; use a multiple of {multiple}")
        per_chunk = shape.num_layers // (mesh.pp * (mesh.vpp or 1))
        if self.recompute_method is not None and self.recompute_granularity != "full":
            raise ConfigError(f"--recompute-method {self.recompute_method} chooses which layers full recompute "
                              "checkpoints; add --recompute-granularity full or drop it")
        if self.recompute_method == "block" and self.recompute_num_layers > per_chunk:
            raise ConfigError(f"--recompute-num-layers {self.recompute_num_layers} exceeds the {per_chunk} layers of "
                              f"each pipeline chunk (--recompute-method block recomputes that many of them); use at "
                              f"most {per_chunk}")
        if self.recompute_method != "block" and per_chunk % self.recompute_num_layers:
            raise ConfigError(f"--recompute-num-layers {self.recompute_num_layers} must divide the {per_chunk} layers "
                              f"of each pipeline chunk (or use --recompute-method block: that many layers of each "
                              f"recomputed)")


@dataclasses.dataclass
class Fusions(Section):
    GROUP = "fusions (torch stand-ins for what TransformerEngine/apex would fuse)"
    gradient_accumulation_fusion: bool = option(
        True, flags=("--no-gradient-accumulation-fusion",), help="megatron engine: add each weight gradient to the "
        "fp32 main_grad after its GEMM instead of accumulating inside it")
    cross_entropy_loss_fusion: bool = option(
        False, help="the output layer and the vocab-parallel cross entropy in chunks of tokens: the [tokens, "
        "vocabulary] logits never exist whole (GiBs at a 152k vocabulary), for one more output-layer GEMM in backward")
    compile_layers: bool = option(
        False, help="torch.compile each dense transformer layer (torchtitan's per-block compile): fuses the norms, "
        "RoPE, SwiGLU and residual adds inside megatron-core's layers without TransformerEngine (MoE layers stay "
        "eager; the megatron engine's gradient-accumulation fusion goes off: torch.compile cannot trace it)")

    def check(self, run) -> None:
        if self.compile_layers and run.engine.engine == "deepspeed" and run.engine.zero_stage == 3:
            raise ConfigError("--compile-layers with --zero-stage 3: ZeRO-3's gathering hooks on every submodule "
                              "split each layer's graph and recompile per module (nothing fused); use --zero-stage 1 "
                              "or 2, or --engine fsdp")


@dataclasses.dataclass
class Checkpoint(Section):
    GROUP = "checkpoints"
    save: Optional[str] = option(None, help="directory for megatron-core distributed checkpoints")
    save_interval: Optional[int] = option(None, type=positive_int)
    async_save: bool = option(False, help="write checkpoints in the background: training waits only while the "
                                          "state is copied out")
    load: Optional[str] = option(None, help="resume everything: model, optimizer, scheduler, data, RNG")
    finetune: bool = option(False, help="with --load: weights only, fresh optimizer and data")

    @property
    def resumes(self) -> bool:
        return bool(self.load) and not self.finetune

    def check(self, run) -> None:
        if self.async_save and not self.save:
            raise ConfigError("--async-save needs --save DIR (where the checkpoints go)")


@dataclasses.dataclass
class Logging(Section):
    GROUP = "logging"
    log_dir: Optional[str] = option(None, help="metrics.jsonl, summary and plots")
    tensorboard_dir: Optional[str] = option(None)
    wandb_project: Optional[str] = option(None)
    wandb_exp_name: Optional[str] = option(None)
    peak_tflops: Optional[float] = option(None, type=positive_float,
                                          help="per-device peak for MFU (default: by device)")
