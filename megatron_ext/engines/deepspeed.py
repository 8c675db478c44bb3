"""The DeepSpeed engine: ZeRO 1/2/3 (optimizer/parameter offload, hpZ) around the same megatron-core model.

It implements the megatron engine's interface (``forward_backward``, ``optimizer_step``, ``model``), so the loop,
data and metrics are shared. ZeRO partitions over the data-parallel group only: megatron-core's parallel state is
DeepSpeed's ``mpu``, so tensor parallelism runs inside ZeRO. Losses follow the megatron engine's convention (sum
over trained tokens / global token count) exactly; DeepSpeed's own 1/GAS and DP averaging are compensated.
"""

from __future__ import annotations

import json
import math
import os
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_ext import parallel
from megatron_ext.engines import deepspeed_checkpoint as ckpt
from megatron_ext.engines.megatron import Batch, reduce_loss_and_metrics
from megatron_ext.engines.optimizer import OptimizerSettings, resume_schedule
from megatron_ext.errors import ConfigError
from megatron_ext.models.sharding import tp_partial_grad
from megatron_ext.observability.regions import region, timed


class MegatronMpu:
    """megatron-core's parallel state under the names DeepSpeed asks for (model parallel = tensor parallel)."""

    get_model_parallel_group = staticmethod(parallel_state.get_tensor_model_parallel_group)
    get_model_parallel_rank = staticmethod(parallel_state.get_tensor_model_parallel_rank)
    get_model_parallel_world_size = staticmethod(parallel_state.get_tensor_model_parallel_world_size)
    get_tensor_model_parallel_group = staticmethod(parallel_state.get_tensor_model_parallel_group)
    get_tensor_model_parallel_rank = staticmethod(parallel_state.get_tensor_model_parallel_rank)
    get_tensor_model_parallel_world_size = staticmethod(parallel_state.get_tensor_model_parallel_world_size)
    get_tensor_model_parallel_src_rank = staticmethod(parallel_state.get_tensor_model_parallel_src_rank)
    get_data_parallel_group = staticmethod(parallel_state.get_data_parallel_group)
    get_data_parallel_rank = staticmethod(parallel_state.get_data_parallel_rank)
    get_data_parallel_world_size = staticmethod(parallel_state.get_data_parallel_world_size)

    @staticmethod
    def get_data_parallel_group_ranks():
        return dist.get_process_group_ranks(parallel_state.get_data_parallel_group())


def zero_config(*, stage: int, offload_optimizer: Optional[str], offload_param: Optional[str],
                offload_path: Optional[str], hpz_partition_size: int, quantized_weights: bool,
                quantized_gradients: bool, on_cuda: bool) -> dict:
    """The ``zero_optimization`` section; refuses what DeepSpeed would silently ignore or cannot run here."""
    if quantized_gradients and stage != 3:
        raise ConfigError(f"--zero-quantized-gradients needs --zero-stage 3 (DeepSpeed ignores it at stage {stage})")
    if (quantized_weights or hpz_partition_size > 1) and stage != 3:
        raise ConfigError("--zero-quantized-weights and --zero-hpz-partition-size need --zero-stage 3")
    if offload_param and stage != 3:
        raise ConfigError("--offload-param needs --zero-stage 3 (only stage 3 partitions parameters)")
    if (quantized_weights or quantized_gradients) and not on_cuda:
        raise ConfigError("ZeRO++ quantized weights/gradients (--zeropp, --zero-quantized-*) need CUDA GPUs; "
                          "DeepSpeed does not implement them on CPU")
    # overlap_comm stays DeepSpeed's own default (on for ZeRO-3: gradients reduced on a side stream during the
    # backward; off for 1/2, where it costs 4.5 reduce buckets of memory)
    config = {"stage": stage, "contiguous_gradients": True}
    for key, device in (("offload_optimizer", offload_optimizer), ("offload_param", offload_param)):
        if device:
            config[key] = {"device": device, **({"nvme_path": offload_path} if device == "nvme" else {})}
    if stage == 3:
        config.update(zero_hpz_partition_size=hpz_partition_size, zero_quantized_weights=quantized_weights,
                      zero_quantized_gradients=quantized_gradients)
    return config


def deepspeed_config(*, micro_batch_size: int, global_batch_size: int, settings: OptimizerSettings,
                     zero: dict, bf16: bool, fp16: bool, user_config: Optional[str]) -> dict:
    """The whole DeepSpeed config from our flags; a ``--deepspeed-config`` file may add settings but not
    contradict one the flags set."""
    config = {
        "train_batch_size": global_batch_size,
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_clipping": settings.clip_grad,  # DeepSpeed's default would be 1.0
        "zero_optimization": zero,
        "bf16": {"enabled": bf16},
        "fp16": {"enabled": fp16, **({"loss_scale": settings.loss_scale} if settings.loss_scale else
                                     {"initial_scale_power": int(settings.initial_loss_scale).bit_length() - 1})},
        "steps_per_print": 10**9,
        "zero_force_ds_cpu_optimizer": False,  # offload with torch's AdamW: no JIT-built CPU Adam needed
        "wall_clock_breakdown": False,
    }
    if user_config:
        try:
            with open(user_config) as f:
                extra = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"--deepspeed-config {user_config}: cannot read JSON ({e})") from None
        _merge_without_conflicts(config, extra, user_config)
    return config


def _merge_without_conflicts(config: dict, extra: dict, source: str, path: str = "") -> None:
    for key, value in extra.items():
        here = f"{path}{key}"
        if isinstance(value, dict) and isinstance(config.get(key), dict):
            _merge_without_conflicts(config[key], value, source, here + ".")
        elif key in config and config[key] != value:
            raise ConfigError(f"--deepspeed-config {source} sets {here}={value!r} but the flags set "
                              f"{config[key]!r}; change the flag instead")
        else:
            config[key] = value


def _without_the_inference_all_reduce_op() -> None:
    """DeepSpeed's comm backend compiles its shared-memory all-reduce op at start-up on CPU ranks (a minute of C++
    on a fresh machine, then a build check in every process); only ``inference_all_reduce`` uses it, never
    training, so it is marked unavailable before DeepSpeed's comm starts (its own fallback then applies)."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def partitioned_construction(dtype: torch.dtype, offload_param: Optional[str]):
    """ZeRO-3: a model built inside this context is partitioned over DP as each module is made
    (``deepspeed.zero.Init``), so no rank ever holds more than one module's full parameters."""
    import deepspeed

    _without_the_inference_all_reduce_op()
    _local_rank_for_deepspeed()
    # The dtype goes through the config: DeepSpeed 0.19.8 ignores ``dtype=`` on accelerators without fp16 (CPU)
    # and builds bf16 parameters (``Init._set_dtype``'s operator precedence).
    config = {"train_batch_size": 1, "zero_optimization": {"stage": 3},
              "bf16": {"enabled": dtype == torch.bfloat16}, "fp16": {"enabled": dtype == torch.float16}}
    return deepspeed.zero.Init(data_parallel_group=parallel_state.get_data_parallel_group(),
                               remote_device=offload_param, mpu=MegatronMpu, config_dict_or_path=config)


def _local_rank_for_deepspeed() -> None:
    """DeepSpeed reads its device from LOCAL_RANK (``zero.Init`` and the engine), which only launchers set: a plain
    ``python`` process is a world of one, on the device ``parallel.init_distributed`` chose."""
    os.environ.setdefault("LOCAL_RANK", str(torch.cuda.current_device() if torch.cuda.is_available() else 0))


@torch.no_grad()
def fill_partitioned(chunks: List[torch.nn.Module], value: Callable) -> None:
    """Every parameter of a partitioned model from ``value(global name, name, param, chunk)``, one at a time, each
    rank copying only its own flat partition (DeepSpeed's layout: the flattened parameter cut in equal parts, the
    last padded): a memory-mapped source is only read where a rank's part lies. Partitions offloaded to NVMe are
    written through DeepSpeed instead (gathered, set by the first rank of the group, partitioned again)."""
    import deepspeed

    from megatron_ext.models.sharding import global_named_parameters

    for chunk in chunks:
        for global_name, name, param in global_named_parameters(chunk):
            part = param.ds_tensor
            if getattr(part, "final_location", None) is not None:  # on NVMe
                with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
                    if dist.get_rank(param.ds_process_group) == 0:
                        param.data.copy_(value(global_name, name, param, chunk))
                continue
            flat = value(global_name, name, param, chunk).reshape(-1)
            size = part.ds_numel
            start = size * dist.get_rank(param.ds_process_group)
            count = max(0, min(size, flat.numel() - start))
            part.narrow(0, 0, count).copy_(flat.narrow(0, start, count))
            part.narrow(0, count, size - count).zero_()


def _param_groups(model: torch.nn.Module, weight_decay: float) -> List[dict]:
    """megatron-core's default: no weight decay on biases and norm weights (1-D parameters; a ZeRO-3 partitioned
    parameter keeps its shape in ``ds_shape``). ``wd_mult``: megatron-core's scheduler sets every group's decay to
    its schedule's value times this."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (no_decay if len(getattr(param, "ds_shape", param.shape)) == 1 else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay, "wd_mult": 1.0},
            {"params": no_decay, "weight_decay": 0.0, "wd_mult": 0.0}]


def reduce_tp_partial_grads_in_backward(model: torch.nn.Module, config) -> None:
    """Under sequence parallelism each TP rank holds a partial gradient of the replicated norm weights (its own
    sequence shard), and of Qwen3's query/key norms under any TP (its own heads); the megatron engine sums them in
    ``finalize_model_grads``. DeepSpeed never calls that, so a tensor hook sums them over TP as autograd produces
    them, before ZeRO's hooks reduce over DP."""
    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return
    group = parallel_state.get_tensor_model_parallel_group()

    def all_reduce(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        dist.all_reduce(grad, group=group)
        return grad

    for param in model.parameters():
        if tp_partial_grad(param, config):
            param.register_hook(all_reduce)


def _adamw(model: torch.nn.Module, settings: OptimizerSettings, offloaded: bool) -> torch.optim.Optimizer:
    """torch's fused AdamW (one kernel per step, as in the megatron engine); for optimizer states offloaded from
    GPUs, DeepSpeed's C++ CPU Adam (the same update, several times faster on host memory than torch's; JIT-built on
    first use, so not on CPU runs, where torch's is fine)."""
    groups = _param_groups(model, settings.weight_decay)
    kwargs = dict(lr=settings.lr, betas=(settings.adam_beta1, settings.adam_beta2), eps=settings.adam_eps)
    if offloaded:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(groups, adamw_mode=True, **kwargs)
    return torch.optim.AdamW(groups, fused=True, **kwargs)


class DeepSpeedEngine:
    def __init__(self, chunks: List[torch.nn.Module], *, device: torch.device, settings: OptimizerSettings,
                 ds_config: dict, step_func: Callable):
        if len(chunks) != 1:
            raise ConfigError("--engine deepspeed runs one model chunk per rank (no virtual pipeline stages)")
        self.device, self.config = device, chunks[0].config
        self.step_func = step_func
        self.last_metrics: Dict[str, float] = {}
        _local_rank_for_deepspeed()
        _without_the_inference_all_reduce_op()
        model = self._wrap(chunks[0].to(device), ds_config)
        reduce_tp_partial_grads_in_backward(model, self.config)
        optimizer = _adamw(model, settings, offloaded=device.type == "cuda" and
                           "offload_optimizer" in ds_config["zero_optimization"])
        self.engine, self.optimizer = self._initialize(model, optimizer, ds_config)
        ckpt.load_module_state(self.engine)
        parallel.release_with_mesh(self.engine)  # its hooks go with the mesh (parallel.destroy_model_parallel)
        # Called inside backward at the accumulation boundary: its time is taken out of backward's (``regions``).
        self.engine.allreduce_gradients = timed("grad_reduce", self.engine.allreduce_gradients)
        self.model = [self.engine]
        self.scheduler = settings.lr_schedule(self.optimizer)

    def _wrap(self, chunk: torch.nn.Module, ds_config: dict) -> torch.nn.Module:
        """The module DeepSpeed receives (the pipeline engine wraps the stage in a ``PipelineModule``)."""
        return chunk

    def _initialize(self, model: torch.nn.Module, optimizer, ds_config: dict):
        import deepspeed

        # what ds_to_universal needs to re-partition this model's checkpoints (saved with each one)
        gated = getattr(self.config, "gated_linear_unit", False)
        model.universal_checkpoint_info = ckpt.checkpoint_info(model, gated)
        ckpt.annotate(model, gated)  # and how each parameter is split, for its universal loader
        engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config,
                                                       mpu=MegatronMpu)
        if engine.zero_optimization_stage() == 0:
            engine.clip_fp32_gradients = self._clip_fp32_gradients
        return engine, optimizer

    def _clip_fp32_gradients(self) -> None:
        """DeepSpeed's fp32 ZeRO-0 clipping, plus what its ZeRO and fp16/bf16 optimizers do already: a non-finite
        update is dropped."""
        from deepspeed.runtime.utils import clip_grad_norm_

        norm = float(clip_grad_norm_(parameters=self.engine.module.parameters(),
                                     max_norm=self.engine.gradient_clipping(), mpu=self.engine.mpu))
        self.engine._global_grad_norm = norm
        self._drop_nonfinite_update(norm)

    def _drop_nonfinite_update(self, norm: float) -> None:
        """ZeRO-0 steps the plain optimizer even on NaN gradients; without gradients torch's AdamW leaves every
        parameter (and its moments) as they are. Only runs with clipping on, where DeepSpeed computes the norm."""
        if not math.isfinite(norm):
            for param in self.engine.module.parameters():
                param.grad = None

    @property
    def megatron_chunk(self) -> torch.nn.Module:
        """The megatron-core model (stage) inside DeepSpeed's wrapper: what checkpoints export."""
        return self.engine.module

    @property
    def forward_modules(self) -> List[torch.nn.Module]:
        """What megatron-core's schedules run forward-only outside training (evaluation/generate.py): the stage
        itself (DeepSpeed's engine has a ``config`` of its own; ZeRO-3's gathers hook the modules inside)."""
        return [self.megatron_chunk]

    def forward_backward(self, microbatches: List[Batch], forward_only: bool = False) -> Optional[float]:
        """All micro-batches of this DP rank; returns the global per-token loss (every rank holds it). DeepSpeed
        counts micro-steps to find the accumulation boundary, so ``engine.step()`` follows every backward and the
        update itself happens after the last one; ``optimizer_step`` then reports it. Everything stays on the
        device: the loss is read once, at the end."""
        _, scale = self._token_count_and_scale(microbatches)
        self.engine.train(not forward_only)
        reported = []
        for batch in microbatches:
            context = torch.no_grad() if forward_only else torch.enable_grad()
            with context:
                with region("forward"):
                    output, loss_func = self.step_func(self.device, iter([batch]), self.engine)
                    micro_sum, _, sums = loss_func(output)
                if not forward_only:
                    with region("backward"):
                        self.engine.backward(micro_sum * scale)
                    with region("optimizer"):
                        self.engine.step()
            reported.append(sums)
        loss, self.last_metrics = reduce_loss_and_metrics(reported, parallel_state.get_data_parallel_group())
        return loss

    def _token_count_and_scale(self, microbatches: List[Batch]):
        """The global count of trained tokens (the loss denominator) and the factor that undoes DeepSpeed's 1/GAS
        and DP averaging, so the gradient is d(sum of token losses)/(global token count) as in the megatron
        engine. Both on the engine's device: the masks are the loader's host tensors, NCCL takes device ones."""
        dp_group = parallel_state.get_data_parallel_group()
        tokens = torch.stack([mb["loss_mask"].sum() for mb in microbatches]).sum()
        tokens = tokens.to(self.device, torch.float64)
        dist.all_reduce(tokens, group=dp_group)
        tokens = tokens.clamp(min=1)
        return tokens, (len(microbatches) * dist.get_world_size(dp_group) / tokens).float()

    def stage_checkpoint(self, root: str, iteration: int, extra: dict, background: bool = False):
        """DeepSpeed's own checkpoint (partitioned optimizer state; exact resume) as ``<root>/iter_XXXXXXX``, and
        inside it in ``mcore/`` the weights in megatron-core's distributed format (any mesh, the megatron engine,
        tools/convert_mcore_to_hf.py), staged (``checkpoint.writer``): DeepSpeed's files are taken from its
        checkpoint engine instead of written (serialized now for a ``background`` write). Committed as
        ``iter_XXXXXXX`` without DeepSpeed's ``latest`` until every rank is done, then ``latest`` and our tracker."""
        import deepspeed
        from megatron.core import dist_checkpointing

        from megatron_ext.checkpoint import files
        from megatron_ext.checkpoint.writer import StagedSave, preloaded, serialized
        from megatron_ext.models import lora

        staging = files.begin_save(root, iteration)
        written = []
        writer = self.engine.checkpoint_engine
        writer.save = lambda state_dict, path: written.append((path, serialized(state_dict) if background
                                                            else state_dict))  # DeepSpeed passes keywords
        module = self.megatron_chunk
        frozen = self._frozen_base()
        try:
            with ckpt.saved_module_state(self.engine, module, frozen):
                self.engine.save_checkpoint(root, tag=os.path.basename(staging), save_latest=False,
                                            client_state=dict(extra, iteration=iteration,
                                                              scheduler=self.scheduler.state_dict()),
                                            exclude_frozen_parameters=frozen)
        finally:
            del writer.save  # the class's own again
        meta = {k: v for k, v in extra.items() if k not in ("data", "mesh")}  # what the model is, not the run
        export = os.path.join(staging, "mcore")
        if dist.get_rank() == 0:
            os.makedirs(export, exist_ok=True)
        dist.barrier()
        stage3 = self.engine.zero_optimization_stage() == 3
        with deepspeed.zero.GatheredParameters(list(module.parameters()), enabled=stage3):
            state = lora.trainable_state(module) if frozen else module.sharded_state_dict()
            request = dist_checkpointing.save({"model": state, "weights_only": True, **meta},
                                              export, async_sharded_save=True)
            request = preloaded(request, copy=stage3)  # gathered weights are freed as the context closes
        tag = os.path.basename(files.iteration_dir(root, iteration))
        return StagedSave(root, iteration, staging, requests=[request], files=written,
                          trackers={files.TRACKER: str(iteration), files.DS_LATEST: tag})

    def _frozen_base(self) -> bool:
        """LoRA: frozen weights, which checkpoints leave out (their ``lora_base`` record says where they come from)."""
        return any(not p.requires_grad for p in self.megatron_chunk.parameters())

    def load_checkpoint(self, root: str, *, mesh: dict, model_shape: Optional[dict]) -> Optional[dict]:
        from megatron_ext import checkpoint

        found = ckpt.checked_checkpoint_tag(root)
        if found is None:
            return None
        directory, tag = found
        path = os.path.join(directory, tag)
        universal = ckpt.universal_if_resharded(path, self.megatron_chunk)
        with checkpoint.reading(root, path), ckpt.loading_universal(self.engine, self.optimizer, universal):
            # a LoRA run's checkpoint leaves the frozen base out: it is already in place (where the run began)
            loaded, client = self.engine.load_checkpoint(*(universal or (directory, tag)),
                                                         load_module_strict=not self._frozen_base())
        if loaded is None:  # DeepSpeed only logs a missing model-states file
            raise ConfigError(f"--load {root}: {path} lacks DeepSpeed's model states "
                              "(mp_rank_*_model_states.pt); point latest at an older iter_ directory or delete it")
        if model_shape is not None and client.get("model_shape") not in (None, model_shape):
            raise ConfigError(f"--load {root} holds a model of shape {client['model_shape']}, but the flags build "
                              f"{model_shape}")
        resume_schedule(self.scheduler, client["scheduler"])
        return client

    def optimizer_step(self) -> Dict[str, float]:
        norm = self.engine.get_global_grad_norm()
        # fp16 overflow, or a non-finite gradient (ZeRO-1/2/3 skip it; ZeRO-0: ``_drop_nonfinite_update``)
        skipped = not self.engine.was_step_applied() or (norm is not None and not math.isfinite(norm))
        if not skipped:
            self.scheduler.step(increment=1)
        return {"grad_norm": float(norm) if norm is not None else float("nan"),
                "lr": self.optimizer.param_groups[0]["lr"], "skipped": skipped,
                "loss_scale_overflow": skipped and self.engine.fp16_enabled()}
