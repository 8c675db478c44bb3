"""The output layer and the vocab-parallel cross entropy together, in chunks of tokens (--cross-entropy-loss-fusion).

megatron-core's loss path holds a micro-batch's whole [tokens, vocabulary] logits: in the parameters' dtype, again in
fp32, and the fp32 softmax saved for backward. At Qwen's 151,936-token vocabulary that is 2.5 GB of fp32 per 4,096
tokens, several times over, more than a small model's layers hold. Here the logits of at most ``CHUNK_ELEMENTS`` exist
at a time: the forward keeps each token's log-sum-exp, the backward computes each chunk's logits again (one more
output-layer GEMM) and turns them into the gradients at once (Liger's and torchtune's fused linear cross entropy, with
the vocabulary split over TP as megatron-core's ``vocab_parallel_cross_entropy`` splits it: two small all-reduces per
micro-batch). The same math as the unfused path: equal in fp32, the same roundings in bf16 (the logits GEMM in the
parameters' dtype, softmax in fp32).

The elementwise work on each chunk of logits (the forward's maximum, sum of exponentials and target logit; the
backward's softmax minus the one-hot target, times each token's gradient) is two functions, ``torch.compile``d on
CUDA (``platform.kernels.compiled_on_cuda``, as megatron-core's SwiGLU): one kernel reading the
GEMM's logits in their dtype instead of about ten fp32 passes over a [tokens, vocabulary] tensor; eager (and the
same math) on CPU.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import DistributedDataParallel

from megatron_ext.platform.kernels import TorchWgradAccumulation, compiled_on_cuda

CHUNK_ELEMENTS = 2**28  # fp32 logits of one chunk: 1 GiB (1,766 tokens of a 152k vocabulary)


def _chunks(tokens: int, width: int):
    step = max(1, CHUNK_ELEMENTS // max(width, 1))
    return [(start, min(start + step, tokens)) for start in range(0, tokens, step)]


@compiled_on_cuda
def _logit_statistics(logits: torch.Tensor, local: torch.Tensor, mine: torch.Tensor):
    """Each row's largest logit, sum of exp(logit - largest), and the target's logit (0 where another rank holds
    the target), in fp32, from one chunk's logits [t, V]: the GEMM's fresh output, used up (written in place when
    fp32, so that eager holds one chunk of fp32 logits)."""
    x = logits.float()
    target = x.gather(1, local[:, None]).squeeze(1).masked_fill(~mine, 0)
    top = x.amax(dim=-1)
    return top, x.sub_(top[:, None]).exp_().sum(dim=-1), target


@compiled_on_cuda
def _logit_gradients(logits, lse, local, mine, grad_loss):
    """d(loss)/d(logits) of one chunk, in the logits' dtype: (softmax - one-hot target) x each token's gradient,
    computed in fp32 and rounded once, as megatron-core's vocab-parallel cross entropy does (``logits`` used up as
    above)."""
    probs = logits.float().sub_(lse[:, None]).exp_()
    if torch.compiler.is_compiling():  # the target as a comparison: one pass (a scatter keeps an fp32 copy)
        columns = torch.arange(logits.shape[1], device=logits.device)
        probs = torch.where((columns[None, :] == local[:, None]) & mine[:, None], probs - 1, probs)
    else:  # eager: a scatter touches one entry per token (a comparison would build [t, V] masks)
        probs.scatter_add_(1, local[:, None], mine[:, None].to(probs.dtype).neg())
    return probs.mul_(grad_loss[:, None].float()).to(logits.dtype)


class _LinearCrossEntropy(torch.autograd.Function):
    """Per-token loss [T] of ``hidden`` [T, h] (every token, replicated over TP) against ``labels`` [T] (global ids),
    through this rank's rows ``weight`` [V/TP, h], of which the first ``valid`` are real vocabulary (the rest pad
    the vocabulary for TP and never enter the softmax)."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, valid: int, vocab_start: int, group):
        tokens = hidden.shape[0]
        rows = weight[:valid]
        top = torch.full((tokens,), -torch.inf, dtype=torch.float32, device=hidden.device)
        sums = torch.zeros(2, tokens, dtype=torch.float32, device=hidden.device)  # sum of exp(logit - top), target
        local = labels - vocab_start
        mine = (local >= 0) & (local < valid)
        local = local.clamp(0, max(valid - 1, 0))
        for start, end in _chunks(tokens, valid) if valid else []:
            top[start:end], sums[0, start:end], sums[1, start:end] = _logit_statistics(
                hidden[start:end] @ rows.t(), local[start:end], mine[start:end])  # one chunk's logits at a time
        if group is not None:
            local_top = top.clone()
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
            sums[0] *= (local_top - top).exp_()
            dist.all_reduce(sums, group=group)
        lse = top + sums[0].log()
        ctx.save_for_backward(hidden, weight, local, mine, lse)
        ctx.valid = valid
        return lse - sums[1]

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, weight, local, mine, lse = ctx.saved_tensors
        valid = ctx.valid
        rows = weight[:valid]
        grad_hidden = torch.zeros_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        grad_rows = grad_weight[:valid]  # (the padding rows' gradient stays 0)
        for start, end in _chunks(hidden.shape[0], valid) if valid else []:
            h = hidden[start:end]
            grad_logits = _logit_gradients(h @ rows.t(), lse[start:end], local[start:end], mine[start:end],
                                           grad_loss[start:end])
            grad_hidden[start:end] = grad_logits @ rows
            TorchWgradAccumulation.wgrad_gemm_accum_fp32(h, grad_logits, grad_rows)  # fp32 accumulation over chunks
            del grad_logits
        return grad_hidden, grad_weight.to(weight.dtype), None, None, None, None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, vocab_size: int,
                         sequence_parallel: bool) -> torch.Tensor:
    """The per-token loss [b, s] of the final hidden states [s, b, h] (under sequence parallelism this rank's part
    of s) through the vocab-parallel output ``weight`` [V/TP, h] (rows past ``vocab_size`` are padding) against
    ``labels`` [b, s]: what megatron-core's output layer and ``compute_language_model_loss`` return, without the
    whole logits."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if sequence_parallel:  # every token on every TP rank; backward: the partial gradients reduce-scattered
        hidden = tensor_parallel.gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=True)
    else:  # backward: the partial gradients (each rank's vocabulary rows) all-reduced
        hidden = tensor_parallel.copy_to_tensor_model_parallel_region(hidden)
    seq, batch, width = hidden.shape
    start = parallel_state.get_tensor_model_parallel_rank() * weight.shape[0]
    valid = max(0, min(weight.shape[0], vocab_size - start))
    group = parallel_state.get_tensor_model_parallel_group() if tp > 1 else None
    loss = _LinearCrossEntropy.apply(hidden.reshape(seq * batch, width), weight, labels.t().reshape(-1), valid,
                                     start, group)
    return loss.view(seq, batch).t().contiguous()


def _before_reading(module) -> None:
    """What calling ``module`` would run first, for a weight read without calling it: megatron-core's DDP waits there
    for the all-gather of that weight after a distributed-optimizer step (overlap_param_gather); ZeRO-3 fetches
    such a weight itself on access."""
    for hook in list(module._forward_pre_hooks.values()):
        if getattr(hook, "__module__", None) == DistributedDataParallel.__module__:
            hook(module, ())


def fuse_output_layer_and_loss(model, vocab_size: int):
    """``model`` (a megatron-core ``GPTModel``), with its config's ``cross_entropy_loss_fusion``, computing its loss
    with ``linear_cross_entropy`` whenever it is given labels; logits (no labels: generation, the parity card) still
    come from its output layer. Without the flag, ``model`` as it is."""
    if not model.config.cross_entropy_loss_fusion:
        return model
    unfused = model._postprocess

    def postprocess(hidden_states, labels=None, **kwargs):
        if labels is None or not model.post_process or kwargs.get("mtp_in_postprocess") or \
                kwargs.get("inference_context") is not None:
            return unfused(hidden_states=hidden_states, labels=labels, **kwargs)
        weight = model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights \
            else model.output_layer.weight
        if weight is getattr(model.output_layer, "weight", None):
            _before_reading(model.output_layer)
        return linear_cross_entropy(hidden_states, weight, labels, vocab_size=vocab_size,
                                    sequence_parallel=model.output_layer.sequence_parallel)

    model._postprocess = postprocess
    return model
