"""RoPE for our spec without TransformerEngine: megatron-core's unfused math, minus its per-layer host work.

megatron-core's fused RoPE needs TE (``apply_rope_fusion``); its unfused path recomputes cos/sin of the same
frequencies in every layer for q and for k, and for packed ('thd') batches reads ``cu_seqlens.tolist()`` (a host
sync on a GPU) and splits the tokens per document, again in every layer. Here the frequencies of one forward pass are
turned into cos/sin (and, packed, into per-token frequencies) once, on the device, and reused by every layer: the
same operations in the same order, so results are bit-identical (``tests/models/test_kernels.py``). On CUDA the rotation
itself is ``torch.compile``d (``platform.kernels.compiled_on_cuda``, as megatron-core's SwiGLU): one kernel for q and
one for k per layer instead of five (multiply, negate, concatenate, multiply, add), and so in backward.
``install()`` points megatron-core's module globals here; multi-latent attention keeps megatron-core's own code.
Under context parallelism the packed path takes each local token's position from the CP partition
(``models/context_parallel``): megatron-core's own reads a micro-batch of one packed row as one long document (its
offset mode) and splits on the host.
"""

from __future__ import annotations

import torch
from megatron.core.models.common.embeddings.rope_utils import _rotate_half

from megatron_ext.platform.kernels import compiled_on_cuda

_MEGATRON = {}  # the replaced megatron-core functions
# One-entry caches keyed by tensor identity: every layer of a forward pass receives the same freqs/cu_seqlens
# objects (megatron-core's RotaryEmbedding even returns the same freqs across steps). Holding the key alive means its
# identity cannot be reused by another tensor while cached.
_COS_SIN = (None, None, None, None, None)  # (freqs, dtype, mscale, cos, sin)
_PACKED_FREQS = (None, None, None, None)  # (cu_seqlens, freqs, CP (size, rank), per-token freqs)


@compiled_on_cuda
def _rotate(t: torch.Tensor, cos_: torch.Tensor, sin_: torch.Tensor, rotary_interleaved: bool) -> torch.Tensor:
    return (t * cos_) + (_rotate_half(t, rotary_interleaved) * sin_)


def rope_bshd(t: torch.Tensor, freqs: torch.Tensor, rotary_interleaved: bool = False,
              multi_latent_attention: bool = False, mscale: float = 1.0) -> torch.Tensor:
    """megatron-core's ``_apply_rotary_pos_emb_bshd`` with cos/sin computed once per ``freqs`` tensor and no
    concatenation of an empty pass-through part."""
    global _COS_SIN
    if multi_latent_attention:
        return _MEGATRON["bshd"](t, freqs, rotary_interleaved, multi_latent_attention, mscale)
    key, dtype, scale, cos_, sin_ = _COS_SIN
    if key is not freqs or dtype != t.dtype or scale != mscale:
        cos_ = (torch.cos(freqs) * mscale).to(t.dtype)
        sin_ = (torch.sin(freqs) * mscale).to(t.dtype)
        _COS_SIN = (freqs, t.dtype, mscale, cos_, sin_)
    rot_dim = freqs.shape[-1]
    if rot_dim == t.shape[-1]:
        return _rotate(t, cos_, sin_, rotary_interleaved)
    t, t_pass = t[..., :rot_dim], t[..., rot_dim:]
    return torch.cat((_rotate(t, cos_, sin_, rotary_interleaved), t_pass), dim=-1)


def packed_rope(t: torch.Tensor, cu_seqlens: torch.Tensor, freqs: torch.Tensor, rotary_interleaved: bool = False,
                multi_latent_attention: bool = False, mscale: float = 1.0, cp_group=None) -> torch.Tensor:
    """RoPE for packed 'thd' tokens [t, heads, dim], positions restarting at every document: megatron-core's
    ``_apply_rotary_pos_emb_thd`` (its case without offsets, CP's chunks included), with each token's position
    found from ``cu_seqlens`` on the device, once per micro-batch."""
    global _PACKED_FREQS
    cp = (cp_group.size(), cp_group.rank()) if cp_group is not None and cp_group.size() > 1 else None
    cached_cu, cached_freqs, cached_cp, packed_freqs = _PACKED_FREQS
    if (cached_cu is not cu_seqlens or cached_freqs is not freqs or cached_cp != cp
            or packed_freqs.shape[0] != t.size(0)):
        if cp is not None:  # cu_seqlens: the whole (padded) packed sequence's; t: this rank's chunks of it
            from megatron_ext.models.context_parallel import thd_partition

            position = thd_partition(cu_seqlens, *cp, t.size(0))[1]
        else:
            index = torch.arange(t.size(0), device=t.device)
            starts = cu_seqlens.to(index.dtype)
            position = index - starts[torch.bucketize(index, starts[1:], right=True)]
        packed_freqs = freqs[position]
        _PACKED_FREQS = (cu_seqlens, freqs, cp, packed_freqs)
    return rope_bshd(t.unsqueeze(1), packed_freqs, rotary_interleaved, multi_latent_attention, mscale).squeeze(1)


def install() -> None:
    """Route megatron-core's unfused RoPE (plain and packed) through this module (idempotent)."""
    from megatron.core.models.common.embeddings import rope_utils

    for name, ours in (("bshd", rope_bshd), ("thd", packed_rope)):
        attribute = f"_apply_rotary_pos_emb_{name}"
        if getattr(rope_utils, attribute) is not ours:
            _MEGATRON[name] = getattr(rope_utils, attribute)
            setattr(rope_utils, attribute, ours)
