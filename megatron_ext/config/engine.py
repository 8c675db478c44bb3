"""The engine's options (``--engine megatron|deepspeed|fsdp`` and each one's knobs) and what each engine refuses,
checked before any process group exists (torch-free but for ZeRO++'s GPU count)."""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

from megatron_ext.config import Section, option
from megatron_ext.errors import ConfigError
from megatron_ext.flag_types import positive_int
from megatron_ext.mesh import Mesh


@dataclasses.dataclass
class Engine(Section):
    GROUP = "engine"
    engine: str = option("megatron", choices=("megatron", "deepspeed", "fsdp"),
                         help="fsdp: torch FSDP2 over DP (x TP), fp32 master weights, --bf16 compute")
    use_distributed_optimizer: bool = option(False, help="megatron engine: the optimizer's state sharded over DP")
    zero_stage: int = option(1, type=int, choices=(0, 1, 2, 3), help="--engine deepspeed")
    zeropp: bool = option(False, help="ZeRO++: quantized weights + quantized gradients + hpZ over the GPUs of a node "
                                      "(stage 3)")
    zero_quantized_weights: bool = option(False)
    zero_quantized_gradients: bool = option(False)
    zero_hpz_partition_size: int = option(1, type=positive_int)
    offload_optimizer: Optional[str] = option(None, choices=("cpu", "nvme"))
    offload_param: Optional[str] = option(None, choices=("cpu", "nvme"))
    offload_path: Optional[str] = option(None, help="nvme offload directory")
    deepspeed_config: Optional[str] = option(None, help="JSON with extra DeepSpeed settings (no conflicts)")
    ddp_bucket_size: Optional[int] = option(
        None, type=positive_int, help="megatron engine: gradient elements per data-parallel reduction, which starts "
        "during the backward once its gradients are ready (default: megatron-core's, max(40M, 1M x DP))")

    @property
    def shards_weights(self) -> bool:
        """FSDP and ZeRO-3 keep no whole replica of the weights on any rank."""
        return self.engine == "fsdp" or (self.engine == "deepspeed" and self.zero_stage == 3)

    def check(self, run) -> None:
        """What the chosen engine runs (DeepSpeed's flags need it; ZeRO++ expanded into its three knobs)."""
        mesh = run.mesh
        deepspeed_flags = [f for f in ("zeropp", "zero_quantized_weights", "zero_quantized_gradients",
                                       "offload_optimizer", "offload_param", "deepspeed_config") if getattr(self, f)]
        if self.engine == "deepspeed" and mesh.cp > 1:
            raise ConfigError("--context-parallel-size > 1 runs on --engine megatron only (DeepSpeed reduces "
                              "gradients over the data-parallel group, which leaves out the CP ranks); use --engine "
                              "megatron")
        if self.engine != "megatron" and self.ddp_bucket_size:
            raise ConfigError(f"--ddp-bucket-size is the megatron engine's; --engine {self.engine} buckets its own way "
                              "(DeepSpeed: reduce_bucket_size in --deepspeed-config)")
        if self.engine == "fsdp":
            check_fsdp(run)
        if self.engine != "deepspeed":
            if deepspeed_flags or self.zero_hpz_partition_size != 1:
                raise ConfigError(f"--{(deepspeed_flags or ['zero_hpz_partition_size'])[0].replace('_', '-')} needs "
                                  "--engine deepspeed")
            return
        if mesh.vpp:
            raise ConfigError("--engine deepspeed has no interleaved (virtual) pipeline; drop "
                              "--num-layers-per-virtual-pipeline-stage or use --engine megatron")
        if mesh.pp > 1 and self.zero_stage > 1:
            raise ConfigError(f"DeepSpeed's pipeline engine runs --zero-stage 0 or 1, not {self.zero_stage} (it does "
                              "not partition gradients); use --zero-stage 1, or --pipeline-model-parallel-size 1 for "
                              "ZeRO-2/3")
        if self.use_distributed_optimizer:
            raise ConfigError("--use-distributed-optimizer is the megatron engine's; with --engine deepspeed ZeRO "
                              "shards the optimizer (--zero-stage)")
        if self.zeropp or self.zero_quantized_weights or self.zero_quantized_gradients:
            import torch

            check_zeropp(self, mesh, torch.cuda.device_count() if torch.cuda.is_available() else 0)
        if self.zeropp and self.zero_hpz_partition_size == 1:
            # GPUs per node: torchrun's variable, then the deepspeed launcher's
            self.zero_hpz_partition_size = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", "1")))
        if mesh.dp % self.zero_hpz_partition_size:
            raise ConfigError(f"--zero-hpz-partition-size {self.zero_hpz_partition_size} must divide the "
                              f"data-parallel size {mesh.dp}")
        if "nvme" in (self.offload_optimizer, self.offload_param) and not self.offload_path:
            raise ConfigError("nvme offload needs --offload-path DIR")


def check_zeropp(engine: Engine, mesh: Mesh, gpus_per_machine: int) -> None:
    """ZeRO++'s quantization on this topology, as DeepSpeed 0.19.8 decides it: weights are gathered unquantized when
    the partition group has one rank (data-parallel size 1), and gradients are quantized only between nodes, which
    it counts as world size // GPUs visible per machine. An explicit flag that would quantize nothing is refused;
    --zeropp turns on what applies and says in one line what does not. Without GPUs the engine refuses both."""
    if not gpus_per_machine:
        engine.zero_quantized_weights |= engine.zeropp
        engine.zero_quantized_gradients |= engine.zeropp
        return
    nodes = mesh.world // gpus_per_machine
    inert = {}
    if mesh.dp == 1:
        inert["zero_quantized_weights"] = "qwZ (int8 weight all-gather): data-parallel size 1 gathers nothing"
    if nodes < 2:
        inert["zero_quantized_gradients"] = (f"qgZ (int4 gradient all-to-all): {mesh.world} rank(s) on machines of "
                                             f"{gpus_per_machine} GPU(s) are one node, and DeepSpeed quantizes "
                                             "gradients only between nodes")
    if engine.zeropp:
        engine.zero_quantized_weights = "zero_quantized_weights" not in inert
        engine.zero_quantized_gradients = "zero_quantized_gradients" not in inert
        if inert and os.environ.get("RANK", "0") == "0":
            print(f"megatron_ext: --zeropp without {'; without '.join(inert.values())}", flush=True)
        return
    for flag, why in inert.items():
        if getattr(engine, flag):
            raise ConfigError(f"--{flag.replace('_', '-')} would quantize nothing here, {why}; drop the flag")


def check_fsdp(run) -> None:
    """What --engine fsdp composes with so far: DP x TP, fp32 or bf16 compute, LoRA; dense models."""
    mesh, checkpoint = run.mesh, run.checkpoint
    refused = [(mesh.pp > 1, "--pipeline-model-parallel-size > 1"), (mesh.cp > 1, "--context-parallel-size > 1"),
               (mesh.ep > 1, "--expert-model-parallel-size > 1"), (mesh.sequence_parallel, "--sequence-parallel"),
               (run.training.fp16, "--fp16"),
               (run.engine.use_distributed_optimizer, "--use-distributed-optimizer (FSDP shards the optimizer "
                                                      "already)"),
               (bool(checkpoint.load) and checkpoint.finetune, "--load --finetune (it builds on the meta device)"),
               (bool(run.moe and run.moe.num_experts), "an MoE model made with --num-experts")]
    for refuse, what in refused:
        if refuse:
            raise ConfigError(f"--engine fsdp does not take {what} yet; use --engine megatron for it")
