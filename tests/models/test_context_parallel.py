"""Context parallelism's index arithmetic in one process: every CP rank simulated, the all-gather replaced by the
concatenation it computes. Whole training steps on real CP groups: tests/training/test_parity_megatron.py (cp2*)."""

import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.utils import get_batch_on_this_cp_rank

from megatron_ext.mesh import Mesh
from megatron_ext.models import context_parallel, rope
from megatron_ext.models.qwen import model as qwen
from megatron_ext.models.attention import SDPAttention
from megatron_ext.models.qwen.shape import PRESETS


class FakeGroup:
    """What the CP code asks of a process group."""

    def __init__(self, size, rank):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


def reference_partition(lengths, cp):
    """Per rank: (global index, position) of its tokens, written out the slow way."""
    out = []
    for r in range(cp):
        index, position, start = [], [], 0
        for n in lengths:
            c = n // (2 * cp)
            for g in (r, 2 * cp - 1 - r):
                index += range(start + g * c, start + (g + 1) * c)
                position += range(g * c, (g + 1) * c)
            start += n
        out.append((index, position))
    return out


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_thd_partition_matches_the_chunk_definition(cp):
    lengths = [2 * cp * k for k in (1, 3, 2, 5, 1)]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    seen = []
    for r, (index, position) in enumerate(reference_partition(lengths, cp)):
        got_index, got_position = context_parallel.thd_partition(cu, cp, r, sum(lengths) // cp)
        assert got_index.tolist() == index and got_position.tolist() == position
        seen += index
    assert sorted(seen) == list(range(sum(lengths))), "the ranks' tokens partition the packed sequence"


@pytest.mark.parametrize("cp", [2, 4])
def test_zigzag_slice_is_megatrons_split(single_rank, cp):
    t = torch.arange(3 * 8 * cp).view(3, 8 * cp)
    for r in range(cp):
        expected = get_batch_on_this_cp_rank({"t": t.clone()}, cp_group=FakeGroup(cp, r))["t"]
        assert torch.equal(context_parallel.zigzag_slice(t, cp, r), expected)
        # A single document filling the row: the packed partition is the same split.
        index, _ = context_parallel.thd_partition(torch.tensor([0, t.shape[1]]), cp, r, t.shape[1] // cp)
        assert torch.equal(t[:, index], expected)


@pytest.fixture(scope="module")
def attention(single_rank):
    return SDPAttention(qwen.transformer_config(PRESETS["tiny"], Mesh(world=1)), 1, AttnMaskType.causal, "self")


def qkv(tokens, batch_dims, attention, seed=0):
    g = torch.Generator().manual_seed(seed)
    d, heads, groups = attention.config.kv_channels, attention.heads_per_partition, attention.groups_per_partition
    return tuple(torch.randn(tokens, *batch_dims, h, d, generator=g) for h in (heads, groups, groups))


def fake_gather(monkeypatch, gathered):
    """The all-gather of a local tensor: ``gathered[id(tensor)]``, the rank-major concatenation of every rank's."""
    monkeypatch.setattr(context_parallel, "gather", lambda t, group: gathered[id(t)])


@pytest.mark.parametrize("cp", [2, 4])
def test_bshd_ranks_reassemble_full_causal_attention(attention, monkeypatch, cp):
    """GQA heads, batch 2, 8*CP tokens: each rank's output is its chunks of the one-process output."""
    q, k, v = qkv(8 * cp, (2,), attention)
    full = attention(q, k, v, None)
    k_all, v_all = (torch.cat([context_parallel.zigzag_slice(t, cp, r, dim=0) for r in range(cp)]) for t in (k, v))
    for r in range(cp):
        local = [context_parallel.zigzag_slice(t, cp, r, dim=0) for t in (q, k, v)]
        fake_gather(monkeypatch, {id(local[1]): k_all, id(local[2]): v_all})
        out = context_parallel.attention_bshd(*local, FakeGroup(cp, r), attention.attend)
        torch.testing.assert_close(out, context_parallel.zigzag_slice(full, cp, r, dim=0), rtol=1e-5, atol=1e-6)


def test_top_left_causal_mask_is_wrong_under_cp(attention, monkeypatch):
    """SDPA's is_causal semantics (top-left aligned) for the shorter query block: the last rank's output differs."""
    cp, (q, k, v) = 2, qkv(16, (1,), attention)
    full = attention(q, k, v, None)
    local = [context_parallel.zigzag_slice(t, cp, 1, dim=0) for t in (q, k, v)]
    fake_gather(monkeypatch, {id(local[i]): torch.cat([context_parallel.zigzag_slice(t, cp, r, dim=0)
                                                       for r in range(cp)]) for i, t in ((1, k), (2, v))})
    monkeypatch.setattr(context_parallel, "causal_mask",
                        lambda q_len, k_len, device: torch.ones(q_len, k_len, dtype=torch.bool).tril())
    out = context_parallel.attention_bshd(*local, FakeGroup(cp, 1), attention.attend)
    assert (out - context_parallel.zigzag_slice(full, cp, 1, dim=0)).abs().max() > 1e-2


@pytest.mark.parametrize("cp", [2, 3])
def test_thd_ranks_reassemble_per_document_attention(attention, monkeypatch, cp):
    """Two packed rows of 8*CP tokens, documents of multiples of 2*CP: each rank's output is its partition of the
    one-process packed output (rows, per-document causal mask)."""
    row = 8 * cp
    lengths = [2 * cp, 4 * cp, 2 * cp, 6 * cp, 2 * cp]  # row 0: 2+4+2 chunks of 2*CP; row 1: 6+2
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    q, k, v = qkv(2 * row, (), attention, seed=1)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
    params.row_length = row
    full = attention(q, k, v, None, packed_seq_params=params)
    index = [context_parallel.thd_partition(cu, cp, r, 2 * row // cp)[0] for r in range(cp)]
    for r in range(cp):
        local = [t[index[r]] for t in (q, k, v)]
        fake_gather(monkeypatch, {id(local[1]): torch.cat([k[i] for i in index]),
                                  id(local[2]): torch.cat([v[i] for i in index])})
        local_params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu)
        local_params.row_length = row
        out = context_parallel.attention_thd(*local, local_params, FakeGroup(cp, r), attention.attend)
        torch.testing.assert_close(out, full[index[r]], rtol=1e-5, atol=1e-6)


def test_packed_rope_under_cp_is_megatrons_and_the_full_sequences(single_rank):
    """Our CP packed RoPE: bit-identical to megatron-core's (its no-offset case: frequencies longer than the tokens)
    and to slicing the one-process result."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    rope.install()
    freqs = RotaryEmbedding(kv_channels=16, rotary_percent=1.0, rotary_base=10000)(64)
    cu = torch.tensor([0, 8, 24, 28, 40], dtype=torch.int32)
    t = torch.randn(40, 3, 16, generator=torch.Generator().manual_seed(3))
    whole = rope.packed_rope(t, cu, freqs)
    for r in range(2):
        index = context_parallel.thd_partition(cu, 2, r, 20)[0]
        ours = rope.packed_rope(t[index], cu, freqs, cp_group=FakeGroup(2, r))
        assert torch.equal(ours, rope._MEGATRON["thd"](t[index], cu, freqs, cp_group=FakeGroup(2, r)))
        assert torch.equal(ours, whole[index])
