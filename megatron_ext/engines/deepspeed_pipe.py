"""DeepSpeed's pipeline engine around megatron-core pipeline stages (``--engine deepspeed`` with PP > 1).

Each rank's stage is the same ``GPTModel`` chunk the megatron engine trains (built, initialised and, with
``--finetune``, loaded before any engine sees it), wrapped as its stage's single layer of a ``PipelineModule``.
DeepSpeed then owns the schedule (1F1B over the micro-batches), the p2p of activations and gradients, gradient
accumulation, the data-parallel reduction, ZeRO-1 and the optimizer step; megatron-core owns TP inside the stage.

- Activations travel as ``(hidden, labels[, cu_seqlens])``: labels ride along so the last stage computes the
  vocab-parallel cross entropy inside the model; ``cu_seqlens`` gives every stage the packed (THD) documents.
- The tied embedding lives in megatron-core's embedding group (first and last stage); DeepSpeed's tied-gradient
  reduction is pointed at that group, and the last stage's copy is counted once in grad norms.
- Activation checkpointing by interval is megatron-core's ``--recompute-granularity full`` with
  ``--recompute-num-layers N`` (every group of N layers keeps only its input).
- Clipping: with ZeRO stage 0 DeepSpeed's pipeline computes the grad norm from the first stage's parameters only
  (platform-facts.md); ``_clip_fp32_gradients`` replaces it with the norm over every stage and TP rank.
"""

from __future__ import annotations

from typing import List, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_ext.engines.deepspeed import DeepSpeedEngine
from megatron_ext.engines.megatron import Batch, masked_token_loss, thd_params
from megatron_ext.observability.regions import timed


class MegatronStage(torch.nn.Module):
    """One megatron-core pipeline stage as a DeepSpeed pipe layer: ``(tokens, position_ids, labels[, cu_seqlens])``
    on the first stage, ``(hidden, labels[, cu_seqlens])`` after it; the last stage returns per-token losses."""

    def __init__(self, chunk: torch.nn.Module):
        super().__init__()
        self.chunk = chunk

    def forward(self, inputs):
        chunk = self.chunk
        if chunk.pre_process:
            tokens, position_ids, labels, *packed = inputs
        else:
            hidden, labels, *packed = inputs
            chunk.set_input_tensor(hidden)
            tokens = position_ids = None
        # Packed rows travel flattened; labels keep their [b, S] shape, which bounds every document's length.
        packed_seq_params = thd_params(packed[0], labels.shape[-1]) if packed else None
        flat_labels = labels.reshape(1, -1) if packed else labels
        output = chunk(tokens, position_ids, attention_mask=None,
                       labels=flat_labels if chunk.post_process else None, packed_seq_params=packed_seq_params)
        return output if chunk.post_process else (output, labels, *packed)


def _elsewhere(_):
    raise AssertionError("another rank's pipeline stage")


def pipeline_module(chunk: torch.nn.Module, loss_fn):
    """A ``PipelineModule`` whose layer on this rank's stage is ``chunk`` (the other stages' entries are never
    built here). Its topology is megatron-core's rank order (TP fastest, then DP, then PP), checked."""
    import deepspeed
    from deepspeed.pipe import PipelineModule
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    deepspeed.init_distributed(dist_backend=dist.get_backend())  # adopts the existing process group
    pp, tp = (parallel_state.get_pipeline_model_parallel_world_size(),
              parallel_state.get_tensor_model_parallel_world_size())
    stage = parallel_state.get_pipeline_model_parallel_rank()
    topology = PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dist.get_world_size() // (pp * tp))

    class MegatronPipelineModule(PipelineModule):
        def get_tied_weights_and_groups(self):
            """megatron-core's shared embedding: summed over the embedding group before the DP reduction."""
            if not parallel_state.is_rank_in_embedding_group(ignore_virtual=True):
                return []
            return [(chunk.shared_embedding_or_output_weight(), parallel_state.get_embedding_group())]

    layers = [MegatronStage(chunk) if s == stage else _elsewhere for s in range(pp)]
    module = MegatronPipelineModule(layers, topology=topology, loss_fn=loss_fn, partition_method="uniform",
                                    dynamic_shape=True)  # packed batches change cu_seqlens' length
    coord = topology.get_coord(dist.get_rank())
    if (coord.pipe, coord.model, coord.data) != (stage, parallel_state.get_tensor_model_parallel_rank(),
                                                 parallel_state.get_data_parallel_rank()):
        raise RuntimeError(f"DeepSpeed's pipeline topology {coord} does not match megatron-core's parallel state")
    if chunk.post_process and not chunk.pre_process and chunk.share_embeddings_and_output_weights:
        chunk.shared_embedding_or_output_weight().ds_pipe_replicated = True  # the first stage's copy counts
    return module


INSTRUCTION_REGIONS = dict(
    LoadMicroBatch="data", ForwardPass="forward", BackwardPass="backward", SendActivation="pipeline_comm",
    RecvActivation="pipeline_comm", SendGrad="pipeline_comm", RecvGrad="pipeline_comm", ReduceGrads="grad_reduce",
    ReduceTiedGrads="grad_reduce", OptimizerStep="optimizer")


class DeepSpeedPipelineEngine(DeepSpeedEngine):
    """The DeepSpeed engine's interface (``forward_backward``, ``optimizer_step``, checkpoints) on
    ``deepspeed.PipelineEngine``. ZeRO stage 0 or 1 (DeepSpeed's pipeline does not partition gradients)."""

    def _wrap(self, chunk, ds_config: dict):
        self._chunk = chunk
        self._loss_scale = torch.ones((), device=self.device)
        self._loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        if chunk.config.sequence_parallel:
            # DeepSpeed would split the first activation over TP ranks assuming they all hold the same tensor;
            # under SP each holds its own sequence shard.
            ds_config["pipeline"] = {"pipe_partitioned": False, "grad_partitioned": False}
        return pipeline_module(chunk, self._loss)

    def _initialize(self, model, optimizer, ds_config: dict):
        import deepspeed

        engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
        if engine.zero_optimization_stage() == 0:
            engine.clip_fp32_gradients = self._clip_fp32_gradients
        # The schedule looks each instruction up in this map: per engine, each one timed and labelled (``regions``).
        engine._INSTRUCTION_MAP = {kind: timed(INSTRUCTION_REGIONS[kind.__name__], method)
                                   for kind, method in engine._INSTRUCTION_MAP.items()}
        return engine, optimizer

    @property
    def megatron_chunk(self) -> torch.nn.Module:
        return self._chunk

    def _loss(self, per_token_loss: torch.Tensor, labels) -> torch.Tensor:
        """DeepSpeed's ``loss_fn`` on the last stage: the micro-batch's summed token loss, scaled so DeepSpeed's
        1/GAS and DP averaging leave d(sum of token losses)/(global token count), as in the megatron engine."""
        (loss_mask,) = labels
        micro_sum, _, _ = masked_token_loss(loss_mask, per_token_loss)
        self._loss_sum += micro_sum.detach()
        return micro_sum * self._loss_scale

    def forward_backward(self, microbatches: List[Batch], forward_only: bool = False) -> Optional[float]:
        """One ``train_batch`` (or ``eval_batch``) over this DP rank's micro-batches; the global per-token loss on
        the last stage, ``None`` elsewhere. The optimizer step happens inside; ``optimizer_step`` reports it."""
        tokens, self._loss_scale = self._token_count_and_scale(microbatches)
        self._loss_sum.zero_()
        items = iter([self._pipe_item(mb) for mb in microbatches])
        if forward_only:
            self.engine.eval_batch(items, num_micro_batches=len(microbatches), reduce_output=None, bcast_loss=False)
        else:
            self.engine.train_batch(items)
        if not parallel_state.is_pipeline_last_stage(ignore_virtual=True):
            return None
        loss_sum = self._loss_sum.clone()
        dist.all_reduce(loss_sum, group=parallel_state.get_data_parallel_group())
        return (loss_sum / tokens).item()

    @staticmethod
    def _pipe_item(batch: Batch):
        """(first stage's inputs, last stage's labels) in DeepSpeed's data format; packed batches as one row."""
        batch = dict(batch)
        cu_seqlens = batch.pop("cu_seqlens", None)
        if cu_seqlens is not None:
            batch.update({k: batch[k].reshape(1, -1) for k in ("tokens", "position_ids")})
        inputs = (batch["tokens"], batch["position_ids"], batch["labels"])
        if cu_seqlens is not None:
            inputs += (cu_seqlens.to(torch.int32),)
        return inputs, (batch["loss_mask"],)

    def _clip_fp32_gradients(self) -> None:
        """Global-norm clipping over every pipeline stage and TP rank: each parameter counted once (TP-replicated
        ones on TP rank 0, the tied embedding on the first stage), as megatron-core does."""
        max_norm = self.engine.gradient_clipping()
        grads, counted = [], []
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        for param in self.engine.module.parameters():
            if param.grad is None:
                continue
            grads.append(param.grad)
            replicated = getattr(param, "ds_pipe_replicated", False)
            if not replicated and (tp_rank == 0 or getattr(param, "tensor_model_parallel", False)):
                counted.append(param.grad)
        square = torch.stack([g.detach().float().pow(2).sum() for g in counted]).sum() if counted \
            else torch.zeros((), device=self.device)
        dist.all_reduce(square, group=parallel_state.get_model_parallel_group())  # TP x PP
        norm = square.sqrt()
        coefficient = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for grad in grads:
            grad.mul_(coefficient)
        self.engine._global_grad_norm = norm.item()
        self._drop_nonfinite_update(self.engine._global_grad_norm)
