"""Our SDPA core attention against megatron-core's reference DotProductAttention, and per-document masking."""

import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from megatron_ext.mesh import Mesh
from megatron_ext.models import qwen
from megatron_ext.models.attention import SDPAttention, document_causal_mask
from megatron_ext.models.shapes import PRESETS


@pytest.fixture(scope="module")
def config(single_rank):
    return qwen.transformer_config(PRESETS["tiny"], Mesh(world=1))


def qkv(seq, batch, config, seed=0):
    g = torch.Generator().manual_seed(seed)
    d = config.kv_channels
    return (torch.randn(seq, batch, config.num_attention_heads, d, generator=g),
            torch.randn(seq, batch, config.num_query_groups, d, generator=g),
            torch.randn(seq, batch, config.num_query_groups, d, generator=g))


def test_matches_megatron_dot_product_attention(config):
    q, k, v = qkv(16, 3, config)
    ours = SDPAttention(config, 1, AttnMaskType.causal, "self")
    reference = DotProductAttention(config, 1, AttnMaskType.causal, "self")
    causal = torch.ones(16, 16, dtype=torch.bool).triu(1)[None, None]  # megatron: True = masked
    torch.testing.assert_close(ours(q, k, v, None), reference(q, k, v, causal), rtol=1e-5, atol=1e-6)


def test_packed_documents_attend_only_within_themselves(config):
    """Two documents packed in one row give the same outputs as each run alone."""
    q, k, v = qkv(12, 1, config, seed=1)
    attention = SDPAttention(config, 1, AttnMaskType.causal, "self")
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    packed = attention(q, k, v, None, packed_seq_params=PackedSeqParams(cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                                                        qkv_format="sbhd"))
    alone = torch.cat([attention(q[:5], k[:5], v[:5], None), attention(q[5:], k[5:], v[5:], None)])
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-6)


def test_document_mask_shape_and_rows():
    cu = torch.tensor([0, 2, 4, 8])  # batch 2 x seq 4: row 0 holds two documents, row 1 one
    mask = document_causal_mask(cu, batch=2, seq=4)
    assert mask.shape == (2, 1, 4, 4)
    assert mask[0, 0].tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]]
    assert mask[1, 0].equal(torch.ones(4, 4, dtype=torch.bool).tril())
