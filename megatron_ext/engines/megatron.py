"""The megatron-core engine: model chunks in DDP (or the distributed optimizer), its schedules, its optimizer.

The training loop (and the parity tests) only use ``forward_backward``, ``optimizer_step`` and ``model``; the
DeepSpeed engine will implement the same three.
"""

from __future__ import annotations

import functools
import math
import weakref
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_ext import parallel
from megatron_ext.engines import distopt_fixes
from megatron_ext.engines.optimizer import OptimizerSettings, resume_schedule
from megatron_ext.models.lora import trainable_state
from megatron_ext.models.sharding import unwrap
from megatron_ext.observability.regions import timed
from megatron_ext.platform import kernels

Batch = Dict[str, torch.Tensor]


def build_model_chunks(build_chunk: Callable[..., torch.nn.Module], vpp: Optional[int]) -> List[torch.nn.Module]:
    """One chunk per virtual pipeline stage of this rank; ``build_chunk(pre_process, post_process, vp_stage)``."""
    chunks = []
    for vp_stage in (range(vpp) if vpp else [None]):
        pre = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
        post = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
        chunks.append(build_chunk(pre_process=pre, post_process=post, vp_stage=vp_stage))
    return chunks


def masked_token_loss(loss_mask: torch.Tensor, per_token_loss: torch.Tensor):
    """Sum of the loss over trained tokens and their count: megatron-core then normalises by the *global* count."""
    mask = loss_mask.reshape(-1).float()
    loss_sum = (per_token_loss.float().reshape(-1) * mask).sum()
    num_tokens = mask.sum().to(torch.int)
    return loss_sum, num_tokens, {"loss_sum_and_tokens": torch.stack([loss_sum.detach(), mask.sum()])}


def thd_params(cu_seqlens: torch.Tensor, seq_length: int) -> PackedSeqParams:
    """megatron-core's 'thd' description of packed documents. No document spans two packed rows, so the row
    length bounds every document: ``max_seqlen`` needs no look at ``cu_seqlens`` (a host sync on GPU)."""
    cu_seqlens = cu_seqlens.to(torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                             max_seqlen_q=seq_length, max_seqlen_kv=seq_length)
    params.row_length = seq_length  # our attention then attends row by row (models/attention.py: packed_rows)
    return params


def packed_as_thd(batch: Batch):
    """A packed micro-batch [b, S] as megatron-core's 'thd' layout: one row of b*S tokens whose documents are
    given by ``cu_seqlens``, so RoPE positions and attention restart at every document."""
    cu_seqlens = batch.pop("cu_seqlens")
    seq_length = batch["tokens"].shape[-1]
    return {k: v.reshape(1, -1) for k, v in batch.items()}, thd_params(cu_seqlens, seq_length)


def label_schedule_parts() -> None:
    """megatron-core's schedules call these module functions and p2p methods by name: wrapped once, they time and
    label every micro-batch's forward and backward and each pipeline exchange (``regions``)."""
    from megatron.core.pipeline_parallel import p2p_communication, schedules

    schedules.forward_step = timed("forward", schedules.forward_step)
    schedules.backward_step = timed("backward", schedules.backward_step)
    communicator = p2p_communication.P2PCommunicator
    communicator._communicate = timed("pipeline_comm", communicator._communicate)


def fuse_weight_gradient_accumulation(model: List[torch.nn.Module]) -> None:
    """megatron-core's gradient-accumulation fusion on every parallel linear layer whose weight has a DDP
    ``main_grad`` (the tied output layer borrows the embedding's), and grouped experts: weight-gradient GEMMs go into
    the fp32 buffer (``platform/kernels.py``). Set after DDP made the buffers, so other engines never see it."""
    for chunk in model:
        for module in chunk.modules():
            if isinstance(module, (tensor_parallel.ColumnParallelLinear, tensor_parallel.RowParallelLinear)):
                weight = getattr(module, "weight", None)
                if weight is None or hasattr(weight, "main_grad"):
                    module.gradient_accumulation_fusion = True
            elif hasattr(module, "per_expert") and hasattr(module.weight1, "main_grad"):  # grouped experts
                module.gradient_accumulation_fusion = True


def reduce_loss_and_metrics(outputs: List[Dict[str, torch.Tensor]], group) -> Tuple[float, Dict[str, float]]:
    """The loss functions' per-micro-batch sums -> (global loss per token, {metric: global sum per token}) with
    one all-reduce and one host read. ``loss_sum_and_tokens`` is required; any other entry (a classifier's
    ``top1``/``top5`` hit counts) is a sum to normalise the same way, but "max:NAME" and "min:NAME" entries, the
    global extremes (a reward model's), which take one more all-reduce."""
    extremes = [k for k in outputs[0] if k[:4] in ("max:", "min:")]
    names = [k for k in outputs[0] if k != "loss_sum_and_tokens" and k not in extremes]
    totals = torch.stack([torch.cat([out["loss_sum_and_tokens"].reshape(2).double(),
                                     *(out[k].reshape(1).double() for k in names)]) for out in outputs]).sum(0)
    dist.all_reduce(totals, group=group)
    values = (totals / totals[1].clamp(min=1)).tolist()
    metrics = dict(zip(names, values[2:]))
    if extremes:  # min as the max of the negated
        signs = torch.tensor([1.0 if k.startswith("max:") else -1.0 for k in extremes], dtype=torch.float64,
                             device=totals.device)
        peaks = torch.stack([torch.stack([out[k].reshape(()).double() for k in extremes]) for out in outputs])
        peaks = (peaks * signs).max(0).values
        dist.all_reduce(peaks, op=dist.ReduceOp.MAX, group=group)
        metrics.update(zip((k[4:] for k in extremes), (peaks * signs).tolist()))
    return values[0], metrics


def _unhook(config, dispatchers, wrappers) -> None:
    config.grad_scale_func = config.no_sync_func = config.grad_sync_func = config.finalize_model_grads_func = None
    config.param_sync_func = None
    for wrapper in wrappers:  # the all-gather waits DDP hangs on every module (overlap_param_gather) hold it
        if wrapper.remove_forward_pre_hook_handles:
            wrapper.disable_forward_pre_hook(param_sync=False)
    for dispatcher in dispatchers:  # megatron-core's MoE dispatchers keep the last micro-batch's probs, graph and all
        for name, value in list(vars(dispatcher).items()):
            if isinstance(value, torch.Tensor) and value.grad_fn is not None:
                setattr(dispatcher, name, None)


class MegatronEngine:
    """Wraps model chunks, optimizer and LR schedule; one ``forward_backward`` + ``optimizer_step`` per step."""

    def __init__(self, chunks: List[torch.nn.Module], *, device: torch.device, settings: OptimizerSettings,
                 use_distributed_optimizer: bool = False, micro_batch_size: int, seq_length: int,
                 gradient_accumulation_fusion: bool = True, step_func: Callable,
                 ddp_bucket_size: Optional[int] = None):
        config = chunks[0].config
        if dist.get_backend() == "gloo":
            # Batched isend/irecv on gloo gives wrong gradients with the interleaved schedule (platform-facts.md).
            config.batch_p2p_comm = False
        if dist.get_backend() == "gloo" and len(chunks) > 1 and config.batch_p2p_comm:
            raise RuntimeError("interleaved pipeline with batched p2p on gloo computes wrong gradients")
        distopt_fixes.install()
        self.device = device
        self.config = config
        self.step_func = step_func  # the objective's forward step (objectives/base.py)
        self.last_metrics: Dict[str, float] = {}  # extra sums the loss function reports (accuracy), per token
        self.micro_batch_size = micro_batch_size
        self.seq_length = seq_length
        chunks = [chunk.to(device) for chunk in chunks]
        # The distributed optimizer's step updates this rank's shard of the weights; the all-gather of the others'
        # waits for the next forward, bucket by bucket, each just before the first module that reads it, while the
        # next bucket's is in flight (megatron-core's overlap_param_gather); under VPP the schedule starts each
        # chunk's ahead (Megatron-LM's align_param_gather, interleaved schedule only).
        gather = use_distributed_optimizer
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=True, bucket_size=ddp_bucket_size,
            use_distributed_optimizer=use_distributed_optimizer, check_for_nan_in_grad=False,
            overlap_param_gather=gather, align_param_gather=gather and len(chunks) > 1)
        self._stale_params = False  # a step's weights not yet all-gathered (finish_param_sync)
        self.model = [DistributedDataParallel(config=config, ddp_config=ddp_config, module=chunk,
                                              disable_bucketing=i > 0) for i, chunk in enumerate(chunks)]
        kernels.install()
        if gradient_accumulation_fusion:
            fuse_weight_gradient_accumulation(self.model)
        one = len(self.model) == 1
        config.no_sync_func = self.model[0].no_sync if one else [m.no_sync for m in self.model]
        # Each bucket's reduction starts as its last gradient is ready, behind the rest of the backward (the last
        # micro-batch's); under PP the schedules start a chunk's after its last backward (Megatron-LM's align).
        config.grad_sync_func = self.model[0].start_grad_sync if one else [m.start_grad_sync for m in self.model]
        config.finalize_model_grads_func = timed("grad_reduce", finalize_model_grads)
        if ddp_config.align_param_gather:
            config.param_sync_func = [m.start_param_sync for m in self.model]
        label_schedule_parts()
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=settings.lr, min_lr=settings.min_lr,
                            weight_decay=settings.weight_decay, adam_beta1=settings.adam_beta1,
                            adam_beta2=settings.adam_beta2, adam_eps=settings.adam_eps, clip_grad=settings.clip_grad,
                            bf16=config.bf16, fp16=config.fp16, params_dtype=config.params_dtype,
                            loss_scale=settings.loss_scale, initial_loss_scale=settings.initial_loss_scale,
                            use_distributed_optimizer=use_distributed_optimizer),
            self.model)
        for optimizer in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            kernels.use_fused_adam(optimizer.optimizer)
        # The schedules scale each micro-batch's loss through this hook (fp16 dynamic loss scaling; 1.0 otherwise).
        config.grad_scale_func = self.optimizer.scale_loss
        self.scheduler = settings.lr_schedule(self.optimizer)
        self._forward_backward = get_forward_backward_func()
        # What the engine hangs on the model's config (its optimizer's loss scaling, its DDP wrappers' no_sync and
        # grad reduction) and modules (the all-gather waits), and the autograd graph MoE dispatchers keep, are let go
        # when the engine goes or its mesh is destroyed: those cycles run through autograd's C++ nodes, out of the
        # collector's sight, and the model, the optimizer state and the mesh's groups outlived the engine.
        dispatchers = [m.token_dispatcher for c in chunks for m in c.modules() if hasattr(m, "token_dispatcher")]
        self.destroy = weakref.finalize(self, _unhook, config, dispatchers, list(self.model))
        parallel.release_with_mesh(self)

    @property
    def forward_modules(self) -> List[torch.nn.Module]:
        """What megatron-core's schedules run forward-only outside training (evaluation/generate.py)."""
        return self.model

    def forward_backward(self, microbatches: List[Batch], forward_only: bool = False) -> Optional[float]:
        """Run all micro-batches of this DP rank; grads end fully reduced. Returns the global per-token loss on the
        last pipeline stage (``None`` elsewhere)."""
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        # Every model chunk reads its own iterator over the same micro-batches (first chunk: tokens, last: labels).
        iterators = [iter(microbatches) for _ in self.model]
        # Pipeline p2p buffers are shaped [seq, micro-batch, hidden]; packed batches travel as one row of b*S.
        packed = "cu_seqlens" in microbatches[0]
        outputs = self._forward_backward(
            forward_step_func=functools.partial(self.step_func, self.device),
            data_iterator=iterators if len(iterators) > 1 else iterators[0], model=self.model,
            num_microbatches=len(microbatches),
            seq_length=self.seq_length * self.micro_batch_size if packed else self.seq_length,
            micro_batch_size=1 if packed else self.micro_batch_size, forward_only=forward_only)
        if not parallel_state.is_pipeline_last_stage(ignore_virtual=True):
            return None
        loss, self.last_metrics = reduce_loss_and_metrics(
            outputs, parallel_state.get_data_parallel_group(with_context_parallel=True))
        return loss

    def sharded_state_dict(self, is_loading: bool = False, weights_only: bool = False) -> dict:
        """megatron-core sharded state (global shapes, so it reshards to any mesh): model chunks, and unless
        ``weights_only`` the optimizer and LR schedule. The distributed optimizer saves 'fully_reshardable' (each
        DP group's shards gathered on its first rank over gloo, host memory only there, into one tensor per
        parameter, so it loads under any mesh): megatron-core 0.16.1's default, the deprecated
        'fully_sharded_model_space', fails its own checkpoint validation. Chained optimizers (MoE: dense and expert
        parameters) keep unprefixed keys, as Megatron-LM's new checkpoints do."""
        if not is_loading:
            self.finish_param_sync()
        state = {key: trainable_state(chunk) for key, chunk in zip(self._model_keys(), self.model)}
        if not weights_only:
            if is_loading:
                distopt_fixes.materialize_optimizer_state(self.optimizer)
            metadata = {"distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": True,
                        "distrib_optim_fully_reshardable_mem_efficient": True}
            state["optimizer"] = self.optimizer.sharded_state_dict(state, is_loading=is_loading, metadata=metadata)
            state["opt_param_scheduler"] = self.scheduler.state_dict()
        return state

    def load_state_dict(self, state: dict, weights_only: bool = False) -> None:
        for key, chunk in zip(self._model_keys(), self.model):
            missing, unexpected = unwrap(chunk).load_state_dict(state[key], strict=False)
            frozen = {name for name, p in unwrap(chunk).named_parameters() if not p.requires_grad}
            if set(missing) - frozen or unexpected:  # only a LoRA run's frozen base is left out of checkpoints
                raise RuntimeError(f"checkpoint load left {sorted(set(missing) - frozen)} unset, {unexpected} unused")
        if not weights_only:
            self.optimizer.load_state_dict(state["optimizer"])
            distopt_fixes.own_step_counters(self.optimizer)
            resume_schedule(self.scheduler, state["opt_param_scheduler"])

    def stage_checkpoint(self, root: str, iteration: int, extra: dict, background: bool = False):
        from megatron_ext import checkpoint

        return checkpoint.stage(root, iteration, self, extra)

    def load_checkpoint(self, root: str, *, mesh: dict, model_shape: Optional[dict]) -> Optional[dict]:
        from megatron_ext import checkpoint

        return checkpoint.load(root, self, mesh=mesh, model_shape=model_shape)

    def finish_param_sync(self) -> None:
        """Every rank's weights current, for what reads them outside a forward (checkpoints, exports): a step of
        the distributed optimizer leaves the all-gather of the other ranks' shards to the next forward."""
        if self._stale_params:
            for chunk in self.model:
                chunk.start_param_sync(force_sync=True)  # waits for a gather in flight, or gathers now
            self._stale_params = False

    def _model_keys(self) -> List[str]:
        return ["model"] if len(self.model) == 1 else [f"model{i}" for i in range(len(self.model))]

    def optimizer_step(self) -> Dict[str, float]:
        """megatron-core's optimizer step with one change: an update whose gradient norm is not finite is dropped,
        as an fp16 overflow is (the loop's --on-nan decides whether training goes on). The norm, already on the
        host in megatron-core, is now taken even without clipping, so every step reports it."""
        optimizer = self.optimizer
        with torch.no_grad():
            found_inf = optimizer.prepare_grads()  # fp16: unscale, look for inf, update the loss scale
            grad_norm = None if found_inf else optimizer.get_grad_norm()
            updated = grad_norm is not None and math.isfinite(grad_norm)
            if updated:
                for part in getattr(optimizer, "chained_optimizers", [optimizer]):
                    params = part.get_parameters()
                    if part.config.clip_grad > 0 and params:
                        kernels.clip_by_total_norm(params, part.config.clip_grad, grad_norm)
                updated = optimizer.step_with_ready_grads()
        if updated:
            self._stale_params = self.model[0].ddp_config.overlap_param_gather
            self.scheduler.step(increment=1)
        return {"grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
                "lr": self.optimizer.param_groups[0]["lr"], "skipped": not updated, "loss_scale_overflow": found_inf}

