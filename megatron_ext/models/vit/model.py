"""Vision Transformer (ViT, as Hugging Face's ``ViTForImageClassification``) on megatron-core's ``TransformerBlock``.

Patch embedding (a strided Conv2d), class token and learned position embeddings on the first pipeline stage;
pre-LayerNorm blocks with biases everywhere and exact (erf) GELU, non-causal SDPA attention (our local spec); the
final LayerNorm and a linear head on the class token on the last stage. TP and PP come from megatron-core.
megatron-core's ``CLIPViTModel`` does not fit (no final norm or head, no pipeline stages, ``.cuda()`` in its
forward, a causal mask in its local spec): ``../shared/notes/research/vit.md`` 1.3.
"""

from __future__ import annotations

import functools
import json
import os
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.enums import ModelType
from megatron.core.transformer import MegatronModule, TransformerConfig
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_block import (TransformerBlock, TransformerBlockSubmodules,
                                                        get_num_layers_to_build)

from megatron_ext.mesh import Mesh
from megatron_ext.errors import ConfigError
from megatron_ext.models.vit.shape import VIT_PRESETS, ViTShape, vit_shape_from_hf_config  # noqa: F401 (re-export)
from megatron_ext.models.sharding import unwrap
from megatron_ext.models.spec import Recompute, TorchNorm, config_kwargs, local_layer_spec


def transformer_config(shape: ViTShape, mesh: Mesh, *, params_dtype: torch.dtype = torch.float32,
                       recompute: Recompute = Recompute(),
                       initialize: bool = True) -> TransformerConfig:
    """megatron-core's config for a ViT under ``mesh``. The bias-GELU fusion stays off on every device: it is the
    tanh approximation and would no longer match the published (erf) models."""
    if mesh.sequence_parallel:
        raise ConfigError(f"--sequence-parallel is not supported for ViT: its {shape.seq_length} tokens would need "
                          "padding and a mask to split over TP; use TP without --sequence-parallel")
    # per-token loss: "tokens" are images, the loss is normalised by the global image count
    return TransformerConfig(
        normalization="LayerNorm", layernorm_epsilon=shape.layer_norm_eps, gated_linear_unit=False,
        activation_func=F.gelu, add_bias_linear=True, add_qkv_bias=True, bias_activation_fusion=False,
        bias_dropout_fusion=False, **config_kwargs(shape, mesh, params_dtype, recompute, initialize, on_gpu=False))


class ViTClassifier(MegatronModule):
    """One pipeline chunk of a ViT classifier (the whole model when PP=1). Input pixels [b, c, H, W] on the first
    stage; logits [b, num_classes] from the last; hidden states [s, b, h] between stages."""

    model_type = ModelType.encoder_or_decoder  # read by megatron-core's schedules
    share_embeddings_and_output_weights = False  # read by megatron-core's finalize_model_grads under PP

    def __init__(self, config: TransformerConfig, shape: ViTShape, num_classes: int, *, pre_process: bool = True,
                 post_process: bool = True, vp_stage: Optional[int] = None):
        super().__init__(config=config)
        self.shape, self.pre_process, self.post_process = shape, pre_process, post_process
        h, dtype = shape.hidden_size, config.params_dtype
        if pre_process:
            self.patch_embed = torch.nn.Conv2d(shape.num_channels, h, kernel_size=shape.patch_size,
                                               stride=shape.patch_size, dtype=dtype)
            self.cls_token = torch.nn.Parameter(torch.zeros(1, 1, h, dtype=dtype))
            self.position_embeddings = torch.nn.Parameter(torch.zeros(1, shape.seq_length, h, dtype=dtype))
        layers = get_num_layers_to_build(config, vp_stage=vp_stage)
        spec = TransformerBlockSubmodules(layer_specs=[local_layer_spec(AttnMaskType.no_mask)] * layers,
                                          layer_norm=TorchNorm)
        self.decoder = TransformerBlock(config, spec, pre_process=pre_process, post_process=post_process,
                                        vp_stage=vp_stage)
        if post_process:
            self.head = torch.nn.Linear(h, num_classes, dtype=dtype)

    def set_input_tensor(self, input_tensor) -> None:
        """Pipeline stages after the first take their input from the previous stage (megatron-core's schedules)."""
        self.decoder.set_input_tensor(input_tensor[0] if isinstance(input_tensor, list) else input_tensor)

    def embed(self, pixels: torch.Tensor) -> torch.Tensor:
        """[b, c, H, W] -> [s, b, h]: patches, the class token first, plus position embeddings."""
        patches = self.patch_embed(pixels.to(self.patch_embed.weight.dtype)).flatten(2).transpose(1, 2)
        tokens = torch.cat([self.cls_token.expand(patches.shape[0], -1, -1), patches], dim=1)
        return (tokens + self.position_embeddings).transpose(0, 1).contiguous()

    def forward(self, pixels: Optional[torch.Tensor] = None) -> torch.Tensor:
        hidden = self.embed(pixels) if self.pre_process else None
        hidden = self.decoder(hidden, attention_mask=None)
        return self.head(hidden[0]) if self.post_process else hidden


def classification_loss(loss_mask: torch.Tensor, label_smoothing: float, labels: torch.Tensor,
                        logits: torch.Tensor):
    """Cross entropy summed over the images ``loss_mask`` keeps, and their count: the engines normalise by the
    global count (the language models' per-token convention, one "token" per image). Top-1/top-5 hits ride along
    as sums the engines normalise the same way (accuracy), at no extra sync; top-5 only with more than 5 classes
    (with 5 or fewer it is always 100%)."""
    logits = logits.float()
    losses = F.cross_entropy(logits, labels, reduction="none", label_smoothing=label_smoothing)
    mask = loss_mask.reshape(-1).float()
    loss_sum = (losses * mask).sum()
    ranked = logits.detach().topk(min(5, logits.shape[-1]), dim=-1).indices == labels[:, None]
    hits = {"top1": (ranked[:, 0] * mask).sum()}
    if logits.shape[-1] > 5:
        hits["top5"] = (ranked.any(-1) * mask).sum()
    return loss_sum, mask.sum().to(torch.int), {"loss_sum_and_tokens": torch.stack([loss_sum.detach(), mask.sum()]),
                                                **hits}


HF_MEAN_STD = ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))  # google/vit-*: transformers' IMAGENET_STANDARD_MEAN/STD


def normalization(hf_config: Optional[str]) -> dict:
    """``mean``/``std`` (forward_step's keywords) the model was trained with: ``preprocessor_config.json`` beside
    ``--hf-config`` if there is one, else the published ViTs' 0.5 / 0.5."""
    directory = hf_config if hf_config and os.path.isdir(hf_config) else os.path.dirname(hf_config or "")
    path = os.path.join(directory, "preprocessor_config.json")
    cfg = {}
    if hf_config and os.path.isfile(path):
        with open(path) as f:
            cfg = json.load(f)
    return dict(mean=tuple(cfg.get("image_mean", HF_MEAN_STD[0])), std=tuple(cfg.get("image_std", HF_MEAN_STD[1])))


def device_pixels(pixels: torch.Tensor, image_size: int, mean, std) -> torch.Tensor:
    """The loader's uint8 [b, c, h, w] -> normalised float32 at the model's size, on the device: the loader ships
    1 byte per value, and small images (CIFAR's 32 px) are upsampled here, not in the CPU workers. Float input
    (synthetic images) is taken as already normalised."""
    if pixels.dtype != torch.uint8:
        return pixels
    x = pixels.float()
    if x.shape[-2:] != (image_size, image_size):
        x = F.interpolate(x, size=(image_size, image_size), mode="bilinear", align_corners=False)
    mean, std = _scaled_mean_std(tuple(mean), tuple(std), x.device)
    return (x - mean) / std


@functools.lru_cache(maxsize=8)
def _scaled_mean_std(mean: tuple, std: tuple, device: torch.device):
    """Per-channel mean/std in 0-255 units on ``device``, made once (a host->device copy per micro-batch would
    wait for the GPU)."""
    return tuple(torch.tensor(v, device=device).view(1, -1, 1, 1) * 255.0 for v in (mean, std))


def forward_step(device: torch.device, data_iterator, model, label_smoothing: float = 0.0, image_size: int = 0,
                 mean=HF_MEAN_STD[0], std=HF_MEAN_STD[1]):
    """The engines' forward step for images: micro-batches of ``pixels`` [b, c, H, W] (uint8 from the loader, or
    float), ``labels`` [b] and ``loss_mask`` [b] (which images count: the same key the engines read to count loss
    units)."""
    batch = next(data_iterator)
    pixels = None
    if unwrap(model).pre_process:  # later pipeline stages take the previous stage's activations instead
        pixels = batch["pixels"].to(device, non_blocking=True)
        pixels = device_pixels(pixels, image_size or pixels.shape[-1], mean, std)
    logits = model(pixels)
    labels, mask = (batch[k].to(device, non_blocking=True) for k in ("labels", "loss_mask"))
    return logits, functools.partial(classification_loss, mask, label_smoothing, labels)
