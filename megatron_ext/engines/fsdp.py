"""torch FSDP2 (``fully_shard``) around a megatron-core model: parameters, gradients and AdamW state sharded over
the data-parallel group, every transformer layer gathered just in time for its forward and backward, fp32 master
weights with bf16 compute through FSDP's mixed-precision policy (torchtitan's recipe). Composes with megatron-core's
tensor parallelism (2D FSDP x TP): each rank's TP shard is what FSDP shards over DP.

Why torch's FSDP2 and not megatron-core's wrappers: ``TorchFullyShardedDataParallel`` (0.16.1) builds its device
mesh for "cuda" only and Megatron-FSDP keeps its buffers on CUDA, while ``fully_shard`` runs on gloo and NCCL alike,
so the layouts are proven on CPU ranks like every other one. Same interface as the other engines.
"""

from __future__ import annotations

import math
import os
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.transformer_layer import TransformerLayer
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from megatron_ext.engines.megatron import Batch, reduce_loss_and_metrics
from megatron_ext.engines.optimizer import OptimizerSettings, resume_schedule
from megatron_ext.errors import ConfigError
from megatron_ext.models.init import initial_value
from megatron_ext.models.sharding import global_named_parameters, parameter_pieces, tp_partial_grad, write_shard
from megatron_ext.observability.regions import region


FSDP_COMMON = "fsdp_common.pt"  # iteration, LR schedule, data position, mesh and model of an --engine fsdp checkpoint


@torch.no_grad()
def initialize_shards(model: torch.nn.Module, layout: dict, seed: int, values: Optional[Callable] = None) -> None:
    """Each DTensor parameter's local DP shard of its mesh-independent initial value (``models/init.py``), or of
    ``values(global name, name, parameter, model)`` (``--pretrained``): ``layout`` maps names to (global name, the
    parameter before sharding, with its TP attributes)."""
    for name, param in model.named_parameters():
        value = torch.empty(param.shape, dtype=torch.float32, device=param.device)
        for piece, part in parameter_pieces(model, name, value):  # grouped experts: expert by expert
            global_name, before = layout[piece]
            part.copy_(values(global_name, piece, before, model).to(param.device) if values
                       else initial_value(global_name, piece, before, model, seed, param.device))
        write_shard(param, value)


class FSDPEngine:
    def __init__(self, chunks: List[torch.nn.Module], *, device: torch.device, settings: OptimizerSettings,
                 compute_dtype: torch.dtype = torch.float32, step_func: Callable,
                 seed: Optional[int] = None, initial_values: Optional[Callable] = None):
        """``chunks`` built on the meta device are initialised here, after sharding (``seed`` given): each rank
        allocates only its shards, and draws one full parameter at a time (deferred initialisation)."""
        if len(chunks) != 1:
            raise ConfigError("--engine fsdp runs one model chunk per rank (no pipeline stages)")
        model = chunks[0]
        deferred = next(model.parameters()).is_meta
        if not deferred:
            model = model.to(device)
        self.device, self.config, self.settings = device, model.config, settings
        self.step_func = step_func
        self.last_metrics: Dict[str, float] = {}
        # Which parameters TP splits (their norms add over TP) and which it replicates (counted on TP rank 0 only):
        # fully_shard replaces the parameters, and megatron-core's attributes with them.
        self._tp_split = {name for name, p in model.named_parameters() if getattr(p, "tensor_model_parallel", False)}
        # ... and which hold partial gradients to sum over TP (Qwen3's query/key norms: each TP rank has its heads')
        self._tp_partial = {name for name, p in model.named_parameters() if tp_partial_grad(p, model.config)} \
            if parallel_state.get_tensor_model_parallel_world_size() > 1 else set()
        layout = {name: (global_name, param) for global_name, name, param in global_named_parameters(model)}
        self.dp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        mesh = DeviceMesh.from_group(self.dp_group, device.type)
        policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
        for module in model.modules():
            if isinstance(module, TransformerLayer):
                fully_shard(module, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        self.layout = layout  # name -> (global name, the parameter before sharding): its TP layout, for gathers
        if deferred:
            model.to_empty(device=device)
            initialize_shards(model, layout, seed, initial_values)
        self.module, self.model = model, [model]
        trained = [p for p in model.parameters() if p.requires_grad]  # LoRA: no optimizer state for the base
        decay, no_decay = [p for p in trained if p.ndim > 1], [p for p in trained if p.ndim <= 1]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": settings.weight_decay, "wd_mult": 1.0},  # (the scheduler's factor)
             {"params": no_decay, "weight_decay": 0.0, "wd_mult": 0.0}],
            lr=settings.lr, betas=(settings.adam_beta1, settings.adam_beta2), eps=settings.adam_eps)
        self.scheduler = settings.lr_schedule(self.optimizer)

    @property
    def forward_modules(self) -> List[torch.nn.Module]:
        """What megatron-core's schedules run forward-only outside training (evaluation/generate.py)."""
        return self.model

    def forward_backward(self, microbatches: List[Batch], forward_only: bool = False) -> Optional[float]:
        """All micro-batches of this DP rank; gradients reduce-scattered once, after the last. FSDP averages over
        DP, so each micro-batch's token-loss sum is scaled by DP / (global token count): the gradient is then
        d(sum of token losses)/(global token count), as in the megatron engine."""
        tokens = torch.stack([mb["loss_mask"].sum() for mb in microbatches]).sum().to(self.device, torch.float64)
        dist.all_reduce(tokens, group=self.dp_group)
        scale = (dist.get_world_size(self.dp_group) / tokens.clamp(min=1)).float()
        self.module.train(not forward_only)
        if not forward_only:
            self.optimizer.zero_grad(set_to_none=True)
        reported = []
        for i, batch in enumerate(microbatches):
            if not forward_only:
                self.module.set_requires_gradient_sync(i == len(microbatches) - 1)
            with torch.set_grad_enabled(not forward_only):
                with region("forward"):
                    output, loss_func = self.step_func(self.device, iter([batch]), self.module)
                    micro_sum, _, sums = loss_func(output)
                if not forward_only:
                    with region("backward"):
                        (micro_sum * scale).backward()
            reported.append(sums)
        if not forward_only and self._tp_partial:
            with region("grad_reduce"):
                for name, param in self.module.named_parameters():
                    if name in self._tp_partial and param.grad is not None:
                        grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
                        dist.all_reduce(grad, group=parallel_state.get_tensor_model_parallel_group())
        loss, self.last_metrics = reduce_loss_and_metrics(reported, self.dp_group)
        return loss

    def _grad_norm(self) -> torch.Tensor:
        """The global L2 norm: each rank's DP shard, TP-split parameters on every TP rank, replicated ones once."""
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        squares = torch.zeros((), dtype=torch.float32, device=self.device)
        for name, param in self.module.named_parameters():
            if param.grad is None or (name not in self._tp_split and tp_rank != 0):
                continue
            grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
            squares += grad.float().pow(2).sum()
        dist.all_reduce(squares)  # DP x TP is the whole world: no pipeline, context or expert parallelism here
        return squares.sqrt()

    def optimizer_step(self) -> Dict[str, float]:
        norm = self._grad_norm()
        value = norm.item()  # the step's one host read; a non-finite update is dropped, as megatron-core drops fp16's
        if not math.isfinite(value):
            return {"grad_norm": value, "lr": self.optimizer.param_groups[0]["lr"], "skipped": True}
        if self.settings.clip_grad > 0:
            coeff = (self.settings.clip_grad / (norm + 1e-6)).clamp(max=1.0)  # megatron-core's clipping
            for param in self.module.parameters():
                if param.grad is not None:
                    (param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad).mul_(coeff)
        self.optimizer.step()
        self.scheduler.step(increment=1)
        return {"grad_norm": value, "lr": self.optimizer.param_groups[0]["lr"], "skipped": False}

    def stage_checkpoint(self, root: str, iteration: int, extra: dict, background: bool = False):
        """torch.distributed.checkpoint of the sharded model and AdamW state (each rank writes its shards; loads
        under any DP size and the same TP size), in Megatron-LM's ``iter_XXXXXXX`` + tracker layout, with the LR
        schedule and ``extra`` (data position, mesh, model) beside it; staged (``checkpoint.writer``) through
        megatron-core's DCP planner and writer, which split DCP's save into its collective and its writing parts.
        The megatron and DeepSpeed engines and the HF exporter do not read this format yet."""
        from functools import partial

        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
        from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
        from megatron.core.dist_checkpointing.strategies.state_dict_saver import (
            save_state_dict_async_finalize, save_state_dict_async_plan)
        from torch.distributed.checkpoint import DefaultSavePlanner

        from megatron_ext.checkpoint import files
        from megatron_ext.checkpoint.writer import StagedSave, preloaded

        staging = files.begin_save(root, iteration)
        model_state, optimizer_state = self._state()
        writer = FileSystemWriterAsync(staging, thread_count=1)
        planned = save_state_dict_async_plan({self._tp_key(): {"model": model_state, "optimizer": optimizer_state}},
                                             writer, None, 0, planner=DefaultSavePlanner())[0]
        write, preload, args = writer.get_save_function_and_args()
        request = AsyncRequest(write, args, [partial(save_state_dict_async_finalize, *planned)], preload_fn=preload)
        common = dict(extra, iteration=iteration, scheduler=self.scheduler.state_dict(), engine="fsdp")
        written = [(os.path.join(staging, FSDP_COMMON), common)] if dist.get_rank() == 0 else []
        return StagedSave(root, iteration, staging, requests=[preloaded(request)], files=written)

    def _frozen(self) -> set:
        """LoRA's frozen base under its state-dict names (the adapters' wrapper keeps the base's own names)."""
        from megatron_ext.models.sharding import plain_name

        return {plain_name(n) for n, p in self.module.named_parameters() if not p.requires_grad}

    def _state(self):
        """The model and optimizer state a checkpoint holds: a LoRA run's without the frozen base, which comes
        back from where the run began (its ``lora_base`` record)."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        # The module's own state dict (DTensors: each rank its shards), not get_state_dict's: it maps every key back
        # to an attribute path, which LoRA's base-name keys are not.
        frozen = self._frozen()
        model_state = {k: v for k, v in self.module.state_dict().items() if k not in frozen}
        return model_state, get_optimizer_state_dict(self.module, self.optimizer)

    @staticmethod
    def _tp_key() -> str:
        """FSDP's DTensors span DP only: each TP rank's shards live under a key of their own."""
        return f"tp{parallel_state.get_tensor_model_parallel_rank()}"

    def load_checkpoint(self, root: str, *, mesh: dict, model_shape: Optional[dict]) -> Optional[dict]:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        from megatron_ext import checkpoint
        from megatron_ext.checkpoint import files, safe_load

        path = files.locate(root)  # None: nothing there yet; an incomplete one is a one-line error
        if path is None:
            if files.holds_checkpoints(root):
                raise ConfigError(f"--load {root} holds no --engine fsdp checkpoint ({files.TRACKER} is "
                                  "missing): resume it with the engine that wrote it, or use a new directory")
            return None
        if not os.path.isfile(os.path.join(path, FSDP_COMMON)):
            raise ConfigError(f"--load {root}: {path} is not an --engine fsdp checkpoint (no {FSDP_COMMON}); "
                              "resume it with the engine that wrote it")
        metadata = os.path.join(path, ".metadata")
        safe_load.check_file(metadata, f"--load {root}: {metadata}")  # DCP reads it with plain pickle.load
        with checkpoint.reading(root, path):
            common = torch.load(os.path.join(path, FSDP_COMMON), map_location="cpu", weights_only=True)
        if model_shape is not None and common.get("model_shape") not in (None, model_shape):
            raise ConfigError(f"--load {root} holds a model of shape {common['model_shape']}, but the flags build "
                              f"{model_shape}")
        saved_tp = (common.get("mesh") or {}).get("tp", 1)
        if saved_tp != parallel_state.get_tensor_model_parallel_world_size():
            raise ConfigError(f"--load {root} was saved with --tensor-model-parallel-size {saved_tp}; an --engine fsdp "
                              "checkpoint resumes under the same TP size (any DP size)")
        model_state, optimizer_state = self._state()
        state = {self._tp_key(): {"model": model_state, "optimizer": optimizer_state}}
        with checkpoint.reading(root, path):
            dcp.load(state, checkpoint_id=path)
        loaded = state[self._tp_key()]
        self.module.load_state_dict(loaded["model"], strict=not self._frozen())
        set_optimizer_state_dict(self.module, self.optimizer, loaded["optimizer"])
        resume_schedule(self.scheduler, common.pop("scheduler"))
        return common
