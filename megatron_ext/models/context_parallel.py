"""Context parallelism (CP) for ``SDPAttention`` without TransformerEngine: K and V all-gathered over the CP group.

Llama 3's design (arXiv 2407.21783, section 3.3.2; TE's ``cp_comm_type="all_gather"``): each rank keeps its own
queries and attends to the whole gathered K/V, so every softmax row sees all its keys at once (no log-sum-exp
merging, no hand-written backward) and any mask, the per-document one included, is index arithmetic. The
all-gather's backward is a reduce-scatter of dK/dV: equal-size collectives, on gloo and NCCL alike.

The layout is megatron-core's: the sequence, or every packed document, is cut into 2*CP chunks and rank r holds
chunks r and 2CP-1-r, which balances causal work (``megatron.core.utils.get_batch_on_this_cp_rank``; its RoPE
follows the same split in ``rope_utils.get_pos_emb_on_this_cp_rank``). ``tests/models/test_context_parallel.py`` checks the
index arithmetic in one process; ``tests/training/test_parity_megatron.py`` checks whole training steps against one process.
"""

from __future__ import annotations

from typing import Callable, Dict, Tuple

import torch
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

Attend = Callable[..., torch.Tensor]  # (q, k, v, mask) on [batch, heads, seq, dim] -> same layout


def zigzag(cp_size: int, cp_rank: int) -> Tuple[int, int]:
    """The two global chunks (of 2*CP) a CP rank holds, in its local order."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def zigzag_slice(t: torch.Tensor, cp_size: int, cp_rank: int, dim: int = 1) -> torch.Tensor:
    """This rank's two chunks of ``t`` along ``dim`` (``get_batch_on_this_cp_rank`` for one tensor): views, no
    index tensor, so nothing is copied from the host."""
    chunk = t.shape[dim] // (2 * cp_size)
    return torch.cat([t.narrow(dim, g * chunk, chunk) for g in zigzag(cp_size, cp_rank)], dim=dim)


def thd_partition(cu_seqlens: torch.Tensor, cp_size: int, cp_rank: int,
                  local_tokens: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Global index, and position within its document, of each of a rank's ``local_tokens`` packed tokens: a torch
    version of TE's ``thd_get_partitioned_indices``. Every document (a multiple of 2*CP long, ``cu_seqlens`` over
    the whole packed sequence) is cut into 2*CP chunks; the rank keeps chunks r and 2CP-1-r of each, documents in
    order. Pure device arithmetic: no host read."""
    cu = cu_seqlens.to(torch.int64)
    local = torch.arange(local_tokens, device=cu.device)
    local_starts = cu // cp_size  # every document puts exactly length/CP tokens on every rank
    doc = torch.bucketize(local, local_starts[1:], right=True)
    within = local - local_starts[doc]
    chunk = (cu[doc + 1] - cu[doc]) // (2 * cp_size)
    second = within >= chunk
    position = torch.where(second, (2 * cp_size - 2 - cp_rank) * chunk + within, cp_rank * chunk + within)
    return cu[doc] + position, position


def batch_on_this_rank(batch: Dict[str, torch.Tensor], cp_size: int, cp_rank: int,
                       packed_seq_params=None) -> Dict[str, torch.Tensor]:
    """A full micro-batch (every CP rank of a DP replica reads the same one) cut to this rank's tokens. Packed
    ('thd', one row of b*S tokens): each document's chunks; the global ``cu_seqlens`` become the padded ones
    megatron-core hands to RoPE. Otherwise the 2*CP zig-zag of the sequence dimension."""
    if packed_seq_params is None:  # (a reward model's labels are None)
        return {k: v if v is None else zigzag_slice(v, cp_size, cp_rank) for k, v in batch.items()}
    cu = packed_seq_params.cu_seqlens_q
    packed_seq_params.cu_seqlens_q_padded = packed_seq_params.cu_seqlens_kv_padded = cu
    index, _ = thd_partition(cu, cp_size, cp_rank, batch["tokens"].shape[-1] // cp_size)
    return {k: v.index_select(1, index) for k, v in batch.items()}


def gather(t: torch.Tensor, group) -> torch.Tensor:
    """All-gather along dim 0 over the CP group, rank-major; backward reduce-scatters the gradient."""
    return gather_from_sequence_parallel_region(t.contiguous(), tensor_parallel_output_grad=True, group=group)


def causal_mask(q_len: int, k_len: int, device: torch.device):
    """Queries that are the *last* ``q_len`` of ``k_len`` positions: lower-right aligned causal. (SDPA's
    ``is_causal`` is top-left aligned when the lengths differ, which is wrong here.) On CUDA a ``CausalBias``, which
    flash/memory-efficient kernels take without a materialised mask; elsewhere the boolean mask."""
    if device.type == "cuda":
        from torch.nn.attention.bias import causal_lower_right

        return causal_lower_right(q_len, k_len)
    return torch.ones(q_len, k_len, dtype=torch.bool, device=device).tril(k_len - q_len)


def attention_bshd(query, key, value, group, attend: Attend) -> torch.Tensor:
    """[s/CP, b, heads, dim] in, [s/CP, b, heads*dim] out. Each local half (global chunk g, c tokens) attends to
    the gathered keys of chunks 0..g with a lower-right causal mask: exactly the causal work, no more."""
    cp_size, cp_rank = group.size(), group.rank()
    c = query.shape[0] // 2
    k_all, v_all = (gather(t, group) for t in (key, value))  # rank-major: rank i holds chunks i, 2CP-1-i

    def chunk_at(t, g):  # global chunk g inside the rank-major gathered tensor
        rank, half = (g, 0) if g < cp_size else (2 * cp_size - 1 - g, 1)
        return t[(2 * rank + half) * c:(2 * rank + half + 1) * c]

    halves = []
    for j, g in enumerate(zigzag(cp_size, cp_rank)):
        q = query[j * c:(j + 1) * c].permute(1, 2, 0, 3)  # [b, heads, c, dim]
        k, v = (torch.cat([chunk_at(t, i) for i in range(g + 1)]).permute(1, 2, 0, 3) for t in (k_all, v_all))
        halves.append(attend(q, k, v, causal_mask(c, (g + 1) * c, query.device)))
    out = torch.cat(halves, dim=2)  # [b, heads, s/CP, dim]
    return out.permute(2, 0, 1, 3).reshape(out.shape[2], out.shape[0], -1)


def thd_mask(cu_seqlens: torch.Tensor, cp_size: int, cp_rank: int, local_tokens: int, rows: int) -> torch.Tensor:
    """Boolean [rows, 1, S/CP, S] mask (True = may attend) of this rank's queries against the gathered keys, row by
    row (no document crosses a packed row of S tokens): same document and not later, from global indices."""
    index = torch.stack([thd_partition(cu_seqlens, cp_size, r, local_tokens)[0] for r in range(cp_size)])
    keys = index.view(cp_size, rows, -1).transpose(0, 1).reshape(rows, -1)  # the gathered order, per row
    queries = index[cp_rank].view(rows, -1)
    bounds = cu_seqlens[1:-1].to(torch.int64)
    doc_q, doc_k = (torch.bucketize(i, bounds, right=True) for i in (queries, keys))
    return ((doc_q[:, :, None] == doc_k[:, None, :]) & (queries[:, :, None] >= keys[:, None, :]))[:, None]


def attention_thd(query, key, value, packed_seq_params, group, attend: Attend) -> torch.Tensor:
    """Packed [t/CP, heads, dim] in, [t/CP, heads*dim] out: per-document causal attention of the local tokens to
    the gathered ones. Keys stay in gathered order (the mask says which are allowed; softmax is order-free)."""
    cp_size, cp_rank = group.size(), group.rank()
    tokens = query.shape[0]
    row = getattr(packed_seq_params, "row_length", None)
    rows = tokens * cp_size // row if row and (tokens * cp_size) % row == 0 else 1
    cu = packed_seq_params.cu_seqlens_q_padded
    cu = packed_seq_params.cu_seqlens_q if cu is None else cu
    cached = getattr(packed_seq_params, "_cp_mask", None)
    if cached is None or cached.shape[0] != rows or cached.shape[2] * rows != tokens:
        cached = thd_mask(cu, cp_size, cp_rank, tokens, rows)
        packed_seq_params._cp_mask = cached  # every layer of the micro-batch shares it
    q = query.view(rows, -1, *query.shape[1:]).transpose(1, 2)  # [rows, heads, S/CP, dim]
    k, v = (gather(t, group).view(cp_size, rows, -1, *t.shape[1:]).transpose(0, 1)
            .reshape(rows, -1, *t.shape[1:]).transpose(1, 2) for t in (key, value))  # [rows, kv heads, S, dim]
    out = attend(q, k, v, cached)
    return out.transpose(1, 2).reshape(tokens, -1)
