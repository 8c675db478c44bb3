"""Supervised fine-tuning (``--objective sft``): the language model's step (the next-token loss on the trained
tokens, also GPT-2's and continued pretraining's) and the SFT data (``--data-path`` rows or a mixture; ``data/sft.py``)."""

from __future__ import annotations

import functools

import torch
from megatron.core import parallel_state

from megatron_ext.engines.megatron import Batch, masked_token_loss, packed_as_thd
from megatron_ext.models import context_parallel, moe_aux
from megatron_ext.models.moe import stage_padding_mask
from megatron_ext.models.sharding import unwrap
from megatron_ext.objectives.base import Objective, print_rank0


def forward_step(device: torch.device, data_iterator, model):
    """megatron-core's forward-step contract for language models: the model output and the loss function to apply
    to it (the engines' ``step_func``)."""
    batch = {k: v.to(device, non_blocking=True) for k, v in next(data_iterator).items()}
    output, batch = language_model_forward(batch, model)
    return output, functools.partial(masked_token_loss, batch["loss_mask"])


def language_model_forward(batch: Batch, model):
    """The per-token loss [b, s] of a micro-batch (``tokens``, ``labels``, ``position_ids``, ``loss_mask``; packed:
    ``cu_seqlens``; MoE: ``padding_mask``) on this rank's part of it, and that part (context parallelism keeps this
    rank's chunks of the sequence)."""
    packed_seq_params = None
    if "cu_seqlens" in batch:
        batch, packed_seq_params = packed_as_thd(batch)
    cp_size = parallel_state.get_context_parallel_world_size()
    if cp_size > 1:  # every CP rank of a DP replica read this micro-batch whole: keep this rank's chunks
        batch = context_parallel.batch_on_this_rank(batch, cp_size, parallel_state.get_context_parallel_rank(),
                                                    packed_seq_params)
    padding = batch.pop("padding_mask", None)
    extra = {}
    if padding is not None and getattr(unwrap(model).config, "num_moe_experts", None):  # never routed
        extra["padding_mask"] = stage_padding_mask(padding, unwrap(model))
    moe_aux.set_loss_tokens(unwrap(model), batch["loss_mask"])  # Qwen's load-balancing loss is per loss token
    output = model(batch["tokens"], batch["position_ids"], attention_mask=None, labels=batch["labels"],
                   packed_seq_params=packed_seq_params, **extra)
    return output, batch


class SFT(Objective):
    step_func = staticmethod(forward_step)

    def data(self, batches: dict):
        """``--mock-data``, or the rows of --data-path (a mixture: each data set's part), tokenized and cached."""
        from megatron_ext.data import mixture, sft
        from megatron_ext.data.sources import MockData, SFTData

        opts, training, shape = self.run.data, self.run.training, self.run.shape
        if opts.mock_data:
            return MockData(vocab_size=shape.vocab_size, seq_length=training.seq_length, **batches), \
                dict(vocab_size=shape.vocab_size)
        train, valid, info = mixture.build(opts.mixture, lambda path: sft.build_datasets(
            path, opts.tokenizer, training.seq_length, pack=opts.pack_sequences, data_split=opts.data_split,
            system_prompt=opts.system_prompt, bad_rows=opts.bad_rows, seed=training.seed, cache_dir=opts.data_cache_dir,
            pad_multiple=2 * self.run.mesh.cp,  # context parallelism cuts every packed document into 2 x CP chunks
            how=opts.row_format, loss_on=opts.loss_on))
        print_rank0(f"megatron_ext: {info['records']} records ({info['bad_rows']} bad rows skipped, "
                    f"{info['truncated']} truncated) -> {info['train_samples']} train / {info['valid_samples']} "
                    f"validation samples of {training.seq_length} tokens; cache {info['cache']} in "
                    f"{info['seconds']:.1f}s")
        for line in mixture.describe(info):  # a mixture: each data set's part
            print_rank0(f"megatron_ext:   {line}")
        return SFTData(train, valid, **batches), info
