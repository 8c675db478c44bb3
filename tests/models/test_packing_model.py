"""Packed sequences through the whole model: each document's logits equal the document run alone."""

import pytest
import torch

from megatron_ext.mesh import Mesh
from megatron_ext.engines.megatron import packed_as_thd
from megatron_ext.models.qwen import model as qwen
from megatron_ext.models.qwen.shape import PRESETS


@pytest.mark.parametrize("lengths", [[[5, 7, 4], [9, 7]], [[5, 7, 4]]], ids=["two_rows", "one_row"])
def test_packed_rows_equal_documents_alone(single_rank, lengths):
    """Rows of 16 tokens, documents never cross rows. One row is the case where megatron-core's own packed RoPE
    would read the row as one long sequence (its max_seqlen equals the token count)."""
    torch.manual_seed(0)
    shape = PRESETS["tiny"]
    model = qwen.build_qwen(qwen.transformer_config(shape, Mesh(world=1)), shape, vocab_size=256).eval()
    docs = [[torch.randint(0, 256, (n,)) for n in row] for row in lengths]
    tokens = torch.stack([torch.cat(row) for row in docs])
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths])
    cu = torch.tensor([0] + [int(x) for x in torch.tensor(sum(lengths, [])).cumsum(0)], dtype=torch.int32)
    flat, params = packed_as_thd(dict(tokens=tokens, position_ids=positions, cu_seqlens=cu))
    with torch.no_grad():
        packed = model(flat["tokens"], flat["position_ids"], attention_mask=None, packed_seq_params=params)[0]
        alone = torch.cat([model(d[None], torch.arange(len(d))[None], attention_mask=None)[0]
                           for row in docs for d in row])
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)
