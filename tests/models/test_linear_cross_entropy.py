"""--cross-entropy-loss-fusion (models/linear_cross_entropy.py): the output layer and the cross entropy in chunks of
tokens compute what the unfused path computes. Here on one rank: the function against torch's cross entropy over
the real vocabulary (chunk boundaries, vocabulary padding, any per-token gradient), and a tiny Qwen (tied and untied
output layer) and GPT-2 fused against unfused: every token's loss and every parameter's gradient, fp32. Under TP2 +
SP, PP2 and CP2 x TP2 + SP: the parity matrix (``ce_fusion_*`` layouts, with a planted vocabulary-split mistake)."""

import dataclasses

import pytest
import torch

from megatron_ext.mesh import Mesh
from megatron_ext.models import linear_cross_entropy
from megatron_ext.models.gpt2 import model as gpt2
from megatron_ext.models.qwen import model as qwen
from megatron_ext.models.qwen.shape import PRESETS
from megatron_ext.models.gpt2.shape import GPT2_PRESETS


@pytest.fixture
def chunks_of_7_tokens(monkeypatch):
    monkeypatch.setattr(linear_cross_entropy, "CHUNK_ELEMENTS", 7 * 60)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equals_cross_entropy_over_the_real_vocabulary(single_rank, chunks_of_7_tokens, dtype):
    """37 x 3 tokens in chunks of 7; 64 output rows of which 60 are vocabulary (the rest pad it for TP and must
    neither enter the softmax nor get a gradient); each token's loss weighted differently."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(37, 3, 16, generator=g).to(dtype).requires_grad_()
    weight = torch.randn(64, 16, generator=g).to(dtype).requires_grad_()
    labels, weights = torch.randint(0, 60, (3, 37), generator=g), torch.rand(3, 37, generator=g)

    loss = linear_cross_entropy.linear_cross_entropy(hidden, weight, labels, vocab_size=60, sequence_parallel=False)
    (loss * weights).sum().backward()
    ours = loss.detach(), hidden.grad, weight.grad
    hidden.grad = weight.grad = None
    logits = (hidden @ weight.t()).float()[..., :60]  # [s, b, V]: the unfused path's logits in the same dtype
    reference = torch.nn.functional.cross_entropy(logits.permute(1, 2, 0), labels, reduction="none")
    (reference * weights).sum().backward()

    assert loss.shape == (3, 37) and loss.dtype == torch.float32
    torch.testing.assert_close(ours[0], reference.detach(), rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(ours[1], hidden.grad, rtol=1e-5, atol=1e-6)
    # bf16: ours accumulates the weight gradient over chunks in fp32, the reference rounds one bf16 GEMM
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(ours[2].float(), weight.grad.float(), **tol)
    assert ours[2][60:].abs().max() == 0 and ours[2].dtype == dtype


def _qwen(fused: bool, tied: bool):
    shape = dataclasses.replace(PRESETS["tiny"], tie_word_embeddings=tied)
    config = qwen.transformer_config(shape, Mesh(world=1), cross_entropy_fusion=fused)
    return qwen.build_qwen(config, shape, vocab_size=qwen.padded_vocab_size(shape.vocab_size, 128, 1)), shape.vocab_size


def _gpt2(fused: bool, tied: bool):
    shape = GPT2_PRESETS["tiny"]
    config = gpt2.transformer_config(shape, Mesh(world=1), cross_entropy_fusion=fused)
    return gpt2.build_gpt2(config, shape, vocab_size=shape.vocab_size), shape.vocab_size


@pytest.mark.parametrize("build, tied", [(_qwen, True), (_qwen, False), (_gpt2, True)],
                         ids=["qwen_tied", "qwen_untied", "gpt2"])
def test_a_fused_model_equals_the_unfused_one(single_rank, chunks_of_7_tokens, monkeypatch, build, tied):
    """Same weights, same batch: every token's loss and every parameter's gradient (fp32); without labels both
    return the same logits (generation and the parity card read those). Only the fused model's loss takes the
    chunked path."""
    calls = []
    chunked = linear_cross_entropy.linear_cross_entropy
    monkeypatch.setattr(linear_cross_entropy, "linear_cross_entropy",
                        lambda *args, **kwargs: calls.append(1) or chunked(*args, **kwargs))
    losses, grads, logits = [], [], []
    for fused in (False, True):
        torch.manual_seed(3)
        model, vocab = build(fused, tied)
        g = torch.Generator().manual_seed(1)
        tokens = torch.randint(0, vocab, (2, 33), generator=g)
        positions = torch.arange(32).expand(2, 32)
        loss = model(tokens[:, :-1], positions, attention_mask=None, labels=tokens[:, 1:])
        (loss * torch.rand(loss.shape, generator=g)).sum().backward()
        assert len(calls) == fused
        losses.append(loss.detach())
        grads.append({n: p.grad for n, p in model.named_parameters()})
        with torch.no_grad():
            logits.append(model(tokens[:, :-1], positions, attention_mask=None))
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=1e-6)
    assert grads[1].keys() == grads[0].keys() and all(g is not None for g in grads[1].values())
    for name, expected in grads[0].items():  # relative to the tensor's largest entry, as the parity matrix does
        assert (grads[1][name] - expected).abs().max() <= 1e-5 * expected.abs().max(), name
    assert torch.equal(logits[1], logits[0]) and len(calls) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_chunk_work_equals_eager_and_holds_no_logits_sized_temporary(dtype):
    """What CUDA runs (the two elementwise functions ``torch.compile``d, here by Inductor's CPU backend) equals the
    eager functions CPU runs, and the generated code allocates no [tokens, vocabulary] buffer but the gradient it
    returns (fp32: written over the used-up logits): one pass over the chunk's logits where eager makes about ten
    fp32 ones."""
    import re

    from torch._inductor.utils import run_and_get_code

    from megatron_ext.platform import kernels

    g = torch.Generator().manual_seed(0)
    tokens, vocab = 23, 97
    logits = torch.randn(tokens, vocab, generator=g).mul_(4).to(dtype)
    local, mine = torch.randint(0, vocab, (tokens,), generator=g), torch.rand(tokens, generator=g) > 0.3
    lse, grad_loss = torch.randn(tokens, generator=g) + 6, torch.randn(tokens, generator=g)
    for function, args, logits_sized in ((linear_cross_entropy._logit_statistics, (logits, local, mine), 0),
                                         (linear_cross_entropy._logit_gradients,
                                          (logits, lse, local, mine, grad_loss), 1)):
        torch._dynamo.reset()
        fresh = lambda: (args[0].clone(), *args[1:])  # noqa: E731 (the logits are used up: the GEMM's output)
        compiled, code = run_and_get_code(torch.compile(function.__wrapped__, **kernels.COMPILE), *fresh())
        eager = function(*fresh())  # (a CPU call: eager)
        for ours, expected in zip(*(x if isinstance(x, tuple) else (x,) for x in (compiled, eager))):
            assert ours.dtype == expected.dtype
            torch.testing.assert_close(ours, expected, rtol=1e-6, atol=1e-6)
        # (sizes are symbolic: a buffer of two dimensions is [tokens, vocabulary], the rest are per token)
        shapes = re.findall(r"empty_strided\w*\(\(([^()]*)\)", "\n".join(code))
        assert len([s for s in shapes if len(s.rstrip(", ").split(",")) == 2]) <= logits_sized, (function, code)
    torch._dynamo.reset()
