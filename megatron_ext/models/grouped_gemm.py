"""One grouped GEMM per local expert group (``torch._grouped_mm``) as an autograd function, shared by the grouped
experts (``models/grouped_experts.py``) and their LoRA adapters (``models/lora_experts.py``)."""

from __future__ import annotations

from typing import Optional, Tuple

import torch

ALIGN_BYTES = 16  # torch._grouped_mm's row alignment


class _GroupedLinear(torch.autograd.Function):
    """``out[rows of expert e] = x[rows of e] @ weight.view(shape)[e]``; the weight gradient is one grouped GEMM
    over the token dimension, added straight to ``main_grad`` when ``fuse`` (megatron-core's accumulation
    fusion contract: ``grad_added_to_main_grad``, a placeholder gradient for DDP's hook)."""

    @staticmethod
    def forward(ctx, x, weight, offs, shape: Tuple[int, int, int], fuse: bool, empty: Optional[torch.Tensor] = None):
        ctx.save_for_backward(x, weight, offs, empty)
        ctx.shape, ctx.fuse = shape, fuse
        if x.shape[0] == 0:  # no token reached this rank's experts: the kernel refuses empty operands
            return x.new_empty((0, shape[2]))
        return torch._grouped_mm(x, weight.view(shape), offs=offs)

    @staticmethod
    def backward(ctx, grad):
        x, weight, offs, empty = ctx.saved_tensors
        frozen = not ctx.needs_input_grad[1]  # (a LoRA base: no weight-gradient GEMM at all)
        if x.shape[0] == 0:  # (a shape, known on the host: no sync) every weight gradient is zero
            grad_x, grad_w = torch.zeros_like(x), None
        else:
            grad = grad.contiguous()  # an expanded (zero-stride) gradient breaks the kernel's stride checks
            w = weight.view(ctx.shape)
            grad_x = torch._grouped_mm(grad, w.transpose(1, 2), offs=offs) if ctx.needs_input_grad[0] else None
            if frozen:
                return grad_x, None, None, None, None, None
            grad_w = torch._grouped_mm(x.t(), grad, offs=offs)  # [E, in, out]
            # An expert that got no token has a zero gradient; the kernel leaves its block undefined on some GPUs.
            if empty is None:
                empty = torch.diff(offs, prepend=offs.new_zeros(1)) == 0
            grad_w = grad_w.masked_fill_(empty[:, None, None], 0).view_as(weight)
        if ctx.fuse and hasattr(weight, "main_grad"):
            if grad_w is not None:
                weight.main_grad.add_(grad_w)
            if hasattr(weight, "grad_added_to_main_grad"):
                weight.grad_added_to_main_grad = True
                return grad_x, torch.empty_like(weight), None, None, None, None
            return grad_x, None, None, None, None, None
        if frozen:
            return grad_x, None, None, None, None, None
        return grad_x, torch.zeros_like(weight) if grad_w is None else grad_w, None, None, None, None
