"""Model FLOPs per token, per-device peak FLOP/s and MFU: how much of the hardware a run actually uses."""

from __future__ import annotations

from typing import Optional

import torch

from megatron_ext.models.qwen.shape import ModelShape
from megatron_ext.models.vit.shape import ViTShape


def training_flops_per_token(shape: ModelShape, seq_length: int, *, causal: bool = True,
                             recompute_full: bool = False) -> float:
    """FLOPs of one forward + backward pass per token of a dense Qwen2-style decoder.

    Per layer and token, with h = hidden, a = heads * kv_channels, k = query_groups * kv_channels, f = ffn, s =
    seq_length, the matmuls do these multiply-adds (MACs):

        Q h*a, K and V 2*h*k, attention output a*h, SwiGLU gate/up/down 3*h*f,
        scores Q K^T and weighted values P V: s*a each over the full square.

    plus h*vocab once for the LM head. A MAC is 2 FLOPs, and the backward pass costs twice the forward (gradients
    for the inputs and for the weights), so training is 3x the forward. With ``recompute_full`` the layers run their
    forward a second time inside backward (4x); the LM head is not recomputed (3x), as in Megatron-LM's
    recomputation. That count is hardware FLOPs (HFU); MFU proper leaves recompute out.

    Causal convention: with ``causal`` (the default) only the unmasked half of the s x s square is counted (s/2
    keys per query on average), because that is the work the model needs and the work causal SDPA/flash kernels
    do; counting the masked half would let wasted work raise MFU. ``causal=False`` gives the full square that
    Megatron-LM and the PaLM MFU formula (6N + 12*L*h*s) count, for comparing with their numbers.

    Left out: norms, softmax, RoPE, SwiGLU's elementwise product, residual adds and biases (O(h) per token, under
    0.1% at these sizes), and Megatron's vocabulary padding (hardware work, not model work): ``shape.vocab_size``
    is the real vocabulary.

        F = 2 * [passes * L * (2*h*a + 2*h*k + 3*h*f + c*s*a) + 3 * h*V],  c = 1 causal, 2 full; passes = 3 or 4

    MoE layers count their *active* parameters only, the work one token causes: the router h*E, top-k routed
    experts 3*h*f_e each, the shared expert 3*h*f_s and its gate h, in place of the dense 3*h*f. (Total parameters
    would credit idle experts; the MFU of a sparse model is always quoted on active ones.)

    GPT-2 (``shape.gated_mlp`` False): a plain MLP of two matrices, 2*h*f in place of 3*h*f; its learned position
    embedding is a lookup (no MACs).
    """
    h = shape.hidden_size
    attention_width = shape.num_attention_heads * shape.kv_channels
    kv_width = shape.num_query_groups * shape.kv_channels
    keys_per_query = seq_length / 2 if causal else seq_length
    attention_macs = 2 * h * attention_width + 2 * h * kv_width + 2 * keys_per_query * attention_width
    mlp_macs = [(3 if getattr(shape, "gated_mlp", True) else 2) * h * shape.ffn_hidden_size] * shape.num_layers
    if shape.moe:
        moe = shape.moe
        moe_macs = h * moe.num_experts + moe.topk * 3 * h * moe.ffn_hidden_size
        if moe.shared_expert_size:
            moe_macs += 3 * h * moe.shared_expert_size + h
        mlp_macs = [moe_macs if sparse else dense for sparse, dense in zip(moe.pattern(shape.num_layers), mlp_macs)]
    layer_passes = 4 if recompute_full else 3
    outputs = 1 if getattr(shape, "head", "lm") == "score" else shape.vocab_size  # a reward model: one score
    return 2 * (layer_passes * (shape.num_layers * attention_macs + sum(mlp_macs)) + 3 * h * outputs)


def vit_training_flops_per_image(shape: ViTShape, num_classes: int, frozen_base: bool = False) -> float:
    """FLOPs of one forward + backward pass of a ViT classifier per image (MFU for ``pretrain_vit.py``).

    Per layer and token (s = patches + 1 class token, full non-causal square): QKV and output projections 4*h^2,
    MLP 2*h*f, scores and weighted values 2*s*h multiply-adds; once per image the patch embedding (N patches x
    c*p^2*h) and the head h*C. 2 FLOPs per MAC, training = 3x forward. ViT-H/14 at 224px without a head:
    1,003.8 GFLOP per image, as ``../shared/notes/gpu-facts.md`` counts it.
    ``frozen_base`` (LoRA) counts what is computed: frozen linears skip their weight gradient (2x forward), the
    frozen patch embedding needs no backward at all (1x); attention and the head stay 3x; adapters are ignored
    (r << h). Recompute is never counted (model FLOPs, as Megatron-LM).
    """
    h, s = shape.hidden_size, shape.seq_length
    linear_macs, attention_macs = 4 * h * h + 2 * h * shape.ffn_hidden_size, 2 * s * h
    patch_macs = shape.num_patches * shape.num_channels * shape.patch_size ** 2 * h
    linear_passes, patch_passes = (2, 1) if frozen_base else (3, 3)
    return 2 * (shape.num_layers * s * (linear_passes * linear_macs + 3 * attention_macs)
                + patch_passes * patch_macs + 3 * h * num_classes)


# Dense (no sparsity) tensor-core peaks in TFLOP/s from NVIDIA's datasheets: (bf16/fp16, tf32, fp32 without tf32).
# The first entry whose words all occur in torch.cuda.get_device_name() wins, so variants come before the base name.
_PEAK_TFLOPS = (
    (("h100", "pcie"), (756.0, 378.0, 51.2)),
    (("h100", "nvl"), (835.5, 417.5, 60.0)),
    (("h200", "nvl"), (835.5, 417.5, 60.0)),
    (("h100",), (989.4, 494.7, 66.9)),
    (("h200",), (989.4, 494.7, 66.9)),
    (("a100",), (312.0, 156.0, 19.5)),
    (("l40s",), (362.05, 183.0, 91.6)),
)


def peak_flops(device: torch.device, dtype: torch.dtype, override_tflops: Optional[float] = None) -> Optional[float]:
    """Dense peak FLOP/s of one device for matmuls in ``dtype``; None where unknown (CPU, unlisted GPUs).

    ``override_tflops`` (--peak-tflops) wins everywhere. fp32 counts the TF32 tensor-core peak only when torch lets
    fp32 matmuls use TF32 (``torch.set_float32_matmul_precision`` other than "highest"), since that is the math the
    matmuls then run.
    """
    if override_tflops is not None:
        return override_tflops * 1e12
    if device.type != "cuda":
        return None
    if dtype in (torch.bfloat16, torch.float16):
        column = 0
    elif dtype == torch.float32:
        column = 1 if torch.get_float32_matmul_precision() != "highest" else 2
    else:
        return None
    name = torch.cuda.get_device_name(device).lower()
    for words, peaks in _PEAK_TFLOPS:
        if all(word in name for word in words):
            return peaks[column] * 1e12
    return None


def mfu(tokens_per_sec_per_device: Optional[float], flops_per_token: float,
        peak: Optional[float]) -> Optional[float]:
    """Model FLOPs utilization: achieved model FLOP/s over the device's peak; None when either is unknown."""
    if peak is None or tokens_per_sec_per_device is None:
        return None
    return tokens_per_sec_per_device * flops_per_token / peak
