"""Our SDPA core attention against megatron-core's reference DotProductAttention, and per-document masking."""

import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from megatron_ext.mesh import Mesh
from megatron_ext.models.qwen import model as qwen
from megatron_ext.models.attention import SDPAttention, document_causal_mask
from megatron_ext.models.qwen.shape import PRESETS


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


def reference_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1)):
    """torch 2.11's ``varlen_attn`` contract on CPU (its kernel is CUDA-only): every document of the packed tokens
    attends within itself; window (-1, 0) is causal; key/value with the query's head count."""
    assert cu_seq_q is cu_seq_k and key.shape[1] == query.shape[1], "2.11 takes no grouped-query heads"
    assert tuple(window_size) in ((-1, -1), (-1, 0))
    out = []
    for start, end in zip(cu_seq_q[:-1].tolist(), cu_seq_q[1:].tolist()):
        assert end - start <= max_q == max_k
        q, k, v = (t[start:end].transpose(0, 1) for t in (query, key, value))
        out.append(torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=window_size == (-1, 0),
                                                                    scale=scale).transpose(0, 1))
    return torch.cat(out)


def reference_varlen_gqa(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
                         enable_gqa=False):
    """torch 2.13's contract: grouped-query key/value heads taken as they are with ``enable_gqa``."""
    assert enable_gqa == (key.shape[1] != query.shape[1])
    repeat = query.shape[1] // key.shape[1]
    key, value = (t.repeat_interleave(repeat, dim=1) for t in (key, value))
    return reference_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale, window_size=window_size)


@pytest.mark.parametrize("kernel", [reference_varlen, reference_varlen_gqa], ids=["torch2.11", "torch2.13"])
def test_packed_documents_through_the_varlen_kernel_equal_the_document_mask(config, monkeypatch, kernel):
    """What a GPU runs for packed bf16 documents (torch's flash kernel for variable lengths, here its contract on
    CPU): the same outputs and q/k/v gradients as SDPA with the document mask, over two packed rows of three and
    two documents, grouped-query heads (tiny: 4 query heads, 2 key/value) and a softmax scale of its own."""
    from megatron_ext.engines.megatron import thd_params
    from megatron_ext.models import attention as module

    torch.manual_seed(0)
    rows, seq, d = 2, 12, config.kv_channels
    q, k, v = (torch.randn(rows * seq, heads, d, requires_grad=True)
               for heads in (config.num_attention_heads, config.num_query_groups, config.num_query_groups))
    params = thd_params(torch.tensor([0, 3, 7, 12, 13, 24]), seq)
    attention = SDPAttention(config, 1, AttnMaskType.causal, "self", softmax_scale=0.3)
    weights = torch.randn(rows * seq, config.num_attention_heads * d)
    results = []
    for varlen in (False, True):
        monkeypatch.setattr(module, "varlen_kernel", lambda query, dropout: kernel if varlen else None)
        out = attention(q, k, v, None, packed_seq_params=params)
        (out * weights).sum().backward()
        results.append((out.detach(), *(t.grad for t in (q, k, v))))
        q.grad = k.grad = v.grad = None
    for ours, expected in zip(*results):
        torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-6)



@pytest.mark.gpu
def test_packed_documents_take_the_varlen_kernel_on_the_gpu(config, monkeypatch):
    """On CUDA in bf16, packed documents go to torch's flash kernel for variable lengths, and its outputs and q/k/v
    gradients are as close to an fp32 reference (SDPA with the document mask) as bf16 SDPA with the mask is: two
    rows of 4,096 tokens in documents of 16 to 900 (bench/packed_attention.py's), Qwen2.5-0.5B's heads (14 query,
    2 key/value, 64 wide)."""
    import dataclasses

    from bench.packed_attention import documents
    from megatron_ext.engines.megatron import thd_params
    from megatron_ext.models import attention as module

    config = dataclasses.replace(config, num_attention_heads=14, num_query_groups=2, kv_channels=64)
    seq = 4096
    params = thd_params(torch.tensor(documents(2, seq, 900), device="cuda"), seq)
    g = torch.Generator().manual_seed(0)
    inputs = [torch.randn(2 * seq, heads, 64, generator=g).cuda() for heads in (14, 2, 2)]
    weights = torch.randn(2 * seq, 14 * 64, generator=g).cuda()
    attention = SDPAttention(config, 1, AttnMaskType.causal, "self")
    kernel = module.varlen_kernel
    assert kernel(inputs[0].bfloat16(), 0.0) is not None, "torch >= 2.11 has the varlen kernel"

    def run(dtype, mask: bool):
        q, k, v = (t.detach().to(dtype).requires_grad_() for t in inputs)
        monkeypatch.setattr(module, "varlen_kernel", (lambda query, dropout: None) if mask else kernel)
        out = attention(q, k, v, None, packed_seq_params=params)
        (out.float() * weights).sum().backward()
        return [t.float() for t in (out, q.grad, k.grad, v.grad)]

    reference, varlen, masked = run(torch.float32, True), run(torch.bfloat16, False), run(torch.bfloat16, True)
    for name, r, ours, theirs in zip(("out", "dq", "dk", "dv"), reference, varlen, masked):
        error, baseline = (ours - r).abs().max().item(), (theirs - r).abs().max().item()
        assert error <= 2 * baseline + 1e-3, (name, error, baseline)


def test_the_varlen_kernel_needs_cuda_half_precision_and_ampere(monkeypatch):
    """Where torch's flash kernel cannot run, packed documents keep SDPA with the document mask: CPU, fp32, dropout,
    and GPUs before Ampere (V100, T4: flash attention refuses them at run time)."""
    from megatron_ext.models import attention as module

    kernel = object()
    monkeypatch.setattr(module, "_torch_varlen", lambda: kernel)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: self.device.type == "meta"))
    capability = {0: (9, 0)}
    monkeypatch.setattr(module, "_flash_capable", lambda index: capability[index] >= (8, 0))
    bf16 = torch.zeros(2, 2, 8, dtype=torch.bfloat16, device="meta")
    assert module.varlen_kernel(bf16, 0.0) is kernel
    assert module.varlen_kernel(bf16.half(), 0.0) is kernel
    assert module.varlen_kernel(bf16.float(), 0.0) is None and module.varlen_kernel(bf16, 0.1) is None
    assert module.varlen_kernel(torch.zeros(2, 2, 8, dtype=torch.bfloat16), 0.0) is None  # CPU
    capability[0] = (7, 0)
    assert module.varlen_kernel(bf16, 0.0) is None
