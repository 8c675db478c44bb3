"""torch stand-ins for the apex / TransformerEngine kernels megatron-core reaches for, so the megatron engine is fast
without either (``../shared/notes/research/profiling_perf.md`` B, levers 4 and 8).

- ``wgrad_gemm_accum_fp32/fp16`` (apex's ``fused_weight_gradient_mlp_cuda``): megatron-core's gradient-accumulation
  fusion writes each weight gradient GEMM straight into the fp32 ``main_grad`` buffer of its DDP, instead of
  materialising a bf16 gradient and ``add_``-ing it (7.5% of kernel time in the first H100 profile). On CUDA one
  cuBLAS call with bf16 operands, fp32 accumulation and beta=1 (``torch.addmm(..., out_dtype=torch.float32)``,
  torch >= 2.8); elsewhere ``addmm_`` in the accumulator's dtype.
- ``compiled_on_cuda``: the elementwise chains between GEMMs (RoPE's rotation, the fused loss's chunk work) as one
  ``torch.compile``d kernel each, as megatron-core's ``jit_fuser`` does its SwiGLU.
- multi-tensor L2 norm and scale: megatron-core's fallback builds the grad norm with ``torch.tensor(list of device
  scalars)``, one host sync per parameter, and clips one tensor at a time; ``torch._foreach_*`` does each in a few
  kernels and never leaves the device.
- the optimizer step, which starts after ``finalize_model_grads``' host read of the token count (the GPU then waits
  for every launch): megatron-core copies the fp32 main weights into bf16 ones one tensor at a time from Python (with
  or without apex), and its grad norm and clip take every gradient through DTensor checks that each open a
  ``no_grad`` context; ``foreach_copy``, ``clip_by_total_norm`` and ``dtensor_checks`` issue the same arithmetic
  in a few launches and skip the checks for plain tensors (``bench/host_ops.py``: the optimizer step's operators
  and host time).

``install()`` fills what neither TE nor apex provides, and replaces the optimizer step's per-tensor loops, which
they leave as they are; each replacement is checked against the reference it replaces in
``tests/models/test_kernels.py`` (CPU) and ``tests/gpu/test_gpu_megatron.py`` or ``test_kernels.py``'s GPU tests (CUDA).
"""

from __future__ import annotations

import functools

import torch

_ADDMM_OUT_DTYPE = True  # cleared on the first CUDA torch that lacks addmm(out_dtype=...) with an fp32 accumulator


# Sizes symbolic from the first call: one graph for q and k, every chunk and micro-batch size, so Inductor's caches
# serve every later process (the GPU tier starts a dozen runs at once) instead of each compiling per shape.
COMPILE = dict(dynamic=True)


def compiled_on_cuda(function):
    """``function`` ``torch.compile``d for CUDA tensors (its first argument's device decides, per call), itself for
    the rest: a CPU run neither imports TorchDynamo (``platform/imports.py``: seconds of start-up per rank) nor pays
    for compiling, and keeps the eager math that CPU tests compare bit for bit, whichever of megatron-core and
    megatron_ext was imported first. ``__wrapped__``: the eager function."""
    compiled = functools.cache(lambda: torch.compile(function, **COMPILE))  # (which compiles at its first call)

    @functools.wraps(function)
    def call(*args):
        return compiled()(*args) if args[0].is_cuda else function(*args)

    return call


class TorchWgradAccumulation:
    """The two functions of apex's ``fused_weight_gradient_mlp_cuda``: ``main_grad += grad_output^T @ input`` for
    2-D ``input`` [tokens, in] and ``grad_output`` [tokens, out]."""

    @staticmethod
    def wgrad_gemm_accum_fp32(input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
        global _ADDMM_OUT_DTYPE
        if main_grad.is_cuda and input.dtype != torch.float32 and _ADDMM_OUT_DTYPE:
            try:
                torch.addmm(main_grad, grad_output.t(), input, out_dtype=torch.float32, out=main_grad)
                return
            except (TypeError, RuntimeError, NotImplementedError):
                _ADDMM_OUT_DTYPE = False
        main_grad.addmm_(grad_output.t().to(main_grad.dtype), input.to(main_grad.dtype))

    @staticmethod
    def wgrad_gemm_accum_fp16(input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
        main_grad.addmm_(grad_output.t(), input)


def foreach_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """Drop-in for ``amp_C.multi_tensor_l2norm``: the global L2 norm of ``tensor_lists[0]`` as a 1-element fp32
    tensor on their device (no host round trip)."""
    tensors = tensor_lists[0]
    norms = torch._foreach_norm(tensors)
    total = torch.linalg.vector_norm(torch.stack([n.float() for n in norms])).reshape(1)
    return total, (torch.stack(norms) if per_tensor else None)


def foreach_scale(chunk_size, noop_flag, tensor_lists, scale):
    """Drop-in for ``amp_C.multi_tensor_scale``: ``dst = src * scale`` for every pair (in place when the same)."""
    src, dst = tensor_lists
    if all(s is d for s, d in zip(src, dst)):
        torch._foreach_mul_(dst, scale)
    else:
        torch._foreach_copy_(dst, torch._foreach_mul(src, scale) if scale != 1.0 else src)


def foreach_copy(this, that, overflow_buf=None) -> None:
    """Drop-in for megatron-core's ``_multi_tensor_copy_this_to_that``: ``that[i].copy_(this[i])``, the same
    rounding, in a few launches instead of one Python call per tensor."""
    torch._foreach_copy_(that, this)


def clip_by_total_norm(params, max_norm: float, total_norm: float) -> None:
    """megatron-core's ``clip_grad_by_total_norm_fp32`` for the megatron engine's main parameters (plain tensors):
    the same coefficient and in-place scale of every ``.grad``, without its per-parameter DTensor and type checks."""
    coefficient = max_norm / (total_norm + 1.0e-6)
    if coefficient < 1.0:
        torch._foreach_mul_([p.grad for p in params if p.grad is not None], coefficient)


def dtensor_checks(to_local, data_parallel_group):
    """megatron-core's ``to_local_if_dtensor`` and ``get_data_parallel_group_if_dtensor`` (``to_local``,
    ``data_parallel_group``) answering a plain tensor at once (itself; no group), without the ``no_grad`` context the
    first opens for every tensor; a DTensor still goes to them."""
    from torch.distributed.tensor import DTensor

    def to_local_if_dtensor(tensor):
        return to_local(tensor) if isinstance(tensor, DTensor) else tensor

    def get_data_parallel_group_if_dtensor(tensor, group=None):
        return data_parallel_group(tensor, group) if isinstance(tensor, DTensor) else None

    return to_local_if_dtensor, get_data_parallel_group_if_dtensor


def install() -> None:
    """Point megatron-core's module globals at the torch stand-ins where it fell back to its slow local ones."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads, optimizer
    from megatron.core.tensor_parallel import layers

    if not layers._grad_accum_fusion_available:
        layers.fused_weight_gradient_mlp_cuda = TorchWgradAccumulation
        layers._grad_accum_fusion_available = True
    if clip_grads.l2_norm_impl is utils.local_multi_tensor_l2_norm:
        clip_grads.l2_norm_impl = foreach_l2_norm
    if clip_grads.multi_tensor_scale_impl is utils.local_multi_tensor_scale:
        clip_grads.multi_tensor_scale_impl = foreach_scale
    if optimizer.multi_tensor_scale_impl is utils.local_multi_tensor_scale:
        optimizer.multi_tensor_scale_impl = foreach_scale
    optimizer._multi_tensor_copy_this_to_that = foreach_copy  # its bf16 path loops even with apex
    if clip_grads.to_local_if_dtensor is utils.to_local_if_dtensor:
        clip_grads.to_local_if_dtensor, clip_grads.get_data_parallel_group_if_dtensor = dtensor_checks(
            utils.to_local_if_dtensor, utils.get_data_parallel_group_if_dtensor)


def use_fused_adam(torch_optimizer: torch.optim.Optimizer) -> None:
    """Switch a torch Adam/AdamW that megatron-core (or DeepSpeed) built to its fused implementation: one kernel
    per step instead of megatron-core's default foreach loop (``fused=True``; CUDA and CPU alike)."""
    for group in torch_optimizer.param_groups:
        group["foreach"], group["fused"] = False, True
