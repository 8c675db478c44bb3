"""Core attention on ``torch.nn.functional.scaled_dot_product_attention``.

megatron-core's own ``DotProductAttention`` materialises the full score matrix; without TransformerEngine this
module gives flash/memory-efficient kernels on GPU and the same math on CPU. It takes megatron-core's
core-attention interface (``[s, b, heads, dim]`` in, ``[s, b, heads*dim]`` out) so it drops into any layer spec.
Under context parallelism it all-gathers K/V over the CP group (``models/context_parallel.py``), which
megatron-core's own attention refuses without TransformerEngine. Packed documents on a GPU in bf16/fp16 go to torch's
flash-attention kernel for variable lengths (``varlen_kernel``): each document attends only within itself, where SDPA
with a document mask computes and masks every score of the row.
"""

from __future__ import annotations

import functools
import inspect
import math
from contextlib import nullcontext
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

from megatron_ext.models import context_parallel


def document_ids(cu_seqlens: torch.Tensor, batch: int, seq: int) -> torch.Tensor:
    """Per-token document index [batch, seq] from cumulative lengths over the flattened ``batch*seq`` tokens."""
    positions = torch.arange(batch * seq, device=cu_seqlens.device)
    return (torch.bucketize(positions, cu_seqlens[1:-1].to(positions.dtype), right=True)).view(batch, seq)


def document_causal_mask(cu_seqlens: torch.Tensor, batch: int, seq: int) -> torch.Tensor:
    """Boolean [batch, 1, seq, seq] mask (True = may attend): causal and confined to each packed document."""
    docs = document_ids(cu_seqlens, batch, seq)
    same_doc = docs[:, :, None] == docs[:, None, :]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=docs.device).tril()
    return (same_doc & causal)[:, None]


def packed_rows(packed_seq_params, tokens: int) -> int:
    """How many packed rows the ``tokens`` of a 'thd' micro-batch came from. megatron_ext's packed batches record
    their row length (``engines.megatron.thd_params``), and documents never cross rows, so attention can run per row:
    b x S^2 instead of (b x S)^2 mask entries and score blocks. One row when the length is unknown."""
    row = getattr(packed_seq_params, "row_length", None)
    return tokens // row if row and tokens % row == 0 else 1


def packed_mask(packed_seq_params, batch: int, seq: int) -> torch.Tensor:
    """The per-document causal mask, built once per micro-batch and shared by every layer."""
    cached = getattr(packed_seq_params, "_document_causal_mask", None)
    if cached is None or cached.shape[0] != batch or cached.shape[-1] != seq:
        cached = document_causal_mask(packed_seq_params.cu_seqlens_q, batch, seq)
        packed_seq_params._document_causal_mask = cached
    return cached


@functools.cache
def _torch_varlen():
    """``torch.nn.attention.varlen.varlen_attn`` in its torch >= 2.11 form (``scale``, ``window_size``), or None."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn if "window_size" in inspect.signature(varlen_attn).parameters else None


@functools.cache
def _flash_capable(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (8, 0)  # flash attention: Ampere or newer


def varlen_kernel(query: torch.Tensor, dropout_p: float):
    """The flash kernel for packed documents where it runs (CUDA from Ampere on, bf16/fp16, no dropout), else None
    (SDPA with the document mask: CPU, fp32, a V100 or T4)."""
    if not query.is_cuda or query.dtype not in (torch.bfloat16, torch.float16) or dropout_p:
        return None
    return _torch_varlen() if _flash_capable(query.device.index or 0) else None


@functools.cache
def _takes_gqa(kernel) -> bool:
    return "enable_gqa" in inspect.signature(kernel).parameters  # torch >= 2.13


def attend_varlen(kernel, query, key, value, packed_seq_params, scale: float) -> torch.Tensor:
    """Causal attention within each document of packed 'thd' tokens [t, heads, dim] -> [t, heads * dim]. The row
    length bounds every document (``engines.megatron.thd_params``), so no host read of ``cu_seqlens``."""
    kwargs = dict(scale=scale, window_size=(-1, 0))  # (-1, 0): causal
    if key.shape[1] != query.shape[1]:  # grouped-query heads: the kernel shares them itself from torch 2.13
        if _takes_gqa(kernel):
            kwargs["enable_gqa"] = True
        else:
            repeat = query.shape[1] // key.shape[1]
            key, value = (t.repeat_interleave(repeat, dim=1) for t in (key, value))
    cu, longest = packed_seq_params.cu_seqlens_q, packed_seq_params.max_seqlen_q
    return kernel(query, key, value, cu, cu, longest, longest, **kwargs).reshape(query.shape[0], -1)


class SDPAttention(MegatronModule):
    """Causal (optionally per-document) grouped-query attention for one tensor-parallel shard of heads."""

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str,
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 cp_comm_type: Optional[str] = None, pg_collection=None):
        super().__init__(config=config)
        self.cp_group = None  # context parallelism: K/V all-gathered over this group (models/context_parallel.py)
        if config.context_parallel_size > 1:
            self.cp_group = pg_collection.cp if pg_collection is not None else (
                parallel_state.get_context_parallel_group())
        tp_size = pg_collection.tp.size() if pg_collection is not None else (
            parallel_state.get_tensor_model_parallel_world_size())
        self.attn_mask_type = attn_mask_type
        self.heads_per_partition = config.num_attention_heads // tp_size
        self.groups_per_partition = config.num_query_groups // tp_size
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(config.kv_channels)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if attention_bias is not None:
            raise NotImplementedError("SDPAttention does not take an attention bias")
        thd = query.dim() == 3  # packed 'thd' format: [tokens, heads, dim], documents given by cu_seqlens
        mask_type = attn_mask_type or self.attn_mask_type
        if self.cp_group is not None:
            if mask_type != AttnMaskType.causal:
                raise NotImplementedError("SDPAttention's context parallelism is causal only")
            if thd:
                return context_parallel.attention_thd(query, key, value, packed_seq_params, self.cp_group,
                                                      self.attend)
            return context_parallel.attention_bshd(query, key, value, self.cp_group, self.attend)
        dropout_p = self.dropout_p if self.training else 0.0
        kernel = varlen_kernel(query, dropout_p) if thd and mask_type == AttnMaskType.causal else None
        if kernel is not None and packed_seq_params.max_seqlen_q:
            return attend_varlen(kernel, query, key, value, packed_seq_params, self.softmax_scale)
        if thd:  # back to the packed rows, which no document crosses: [rows, heads, row length, dim]
            rows = packed_rows(packed_seq_params, query.shape[0])
            q, k, v = (t.reshape(rows, -1, *t.shape[1:]).transpose(1, 2) for t in (query, key, value))
        else:
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [s, b, heads, dim] -> [b, heads, s, dim]
        batch, seq = q.shape[0], q.shape[2]
        mask, causal = None, False
        if packed_seq_params is not None:
            mask = packed_mask(packed_seq_params, batch, seq)
        elif mask_type == AttnMaskType.causal:
            causal = True
        elif attention_mask is not None:
            mask = ~attention_mask  # megatron-core masks are True where attention is *not* allowed
        out = self.attend(q, k, v, mask, causal)
        if thd:
            return out.transpose(1, 2).reshape(batch * seq, -1)
        return out.permute(2, 0, 1, 3).reshape(seq, batch, -1)

    def attend(self, q, k, v, mask=None, causal: bool = False):
        """SDPA on [b, heads, s, dim] (K/V with the query-group heads); ``mask``: boolean (True = may attend) or a
        ``CausalBias``."""
        gqa = self.groups_per_partition != self.heads_per_partition
        if gqa and mask is not None:
            # SDPA runs GQA only in its flash and math kernels on CUDA, and flash takes no mask: with a document
            # mask the math kernel would materialise every score. Shared KV heads expanded, the memory-efficient
            # kernel takes the mask (same math: enable_gqa is this repeat_interleave). A CausalBias needs it too.
            repeat = self.heads_per_partition // self.groups_per_partition
            k, v = (t.repeat_interleave(repeat, dim=1) for t in (k, v))
            gqa = False
        dropout_p = self.dropout_p if self.training else 0.0
        # Dropout inside a TP region must draw from the model-parallel RNG stream, as DotProductAttention does.
        rng = tensor_parallel.get_cuda_rng_tracker().fork() if dropout_p and not self.config.sequence_parallel \
            else nullcontext()
        with rng:
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=causal, scale=self.softmax_scale,
                enable_gqa=gqa)
