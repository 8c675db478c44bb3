"""The ViT's own flags, as typed sections: the model (preset, config, layers, image size, classes) and the labelled
images; the shape from them. Torch-free."""

from __future__ import annotations

import dataclasses
from typing import Optional

from megatron_ext.config import Section, option
from megatron_ext.errors import ConfigError
from megatron_ext.flag_types import fraction, int_at_least, nonneg_int, positive_int, shipped, split_weights
from megatron_ext.models.vit.shape import VIT_PRESETS, ViTShape, vit_shape_from_hf_config


@dataclasses.dataclass
class ViTModel(Section):
    GROUP = "model"
    model: Optional[str] = option(None, choices=sorted(VIT_PRESETS),
                                  help="published ViT shape or 'tiny' (default; with --pretrained: its config)")
    hf_config: Optional[str] = option(None, help="build from a Hugging Face ViT config.json (overrides --model)")
    num_layers: Optional[int] = option(None, type=positive_int, help="override the preset's layer count")
    image_size: Optional[int] = option(None, type=positive_int, help="override the preset's image size (pixels)")
    num_classes: Optional[int] = option(None, type=int_at_least(2), help="default: the data's (10 with --mock-data)")
    label_smoothing: float = option(0.0, type=fraction)

    def shape(self, training, moe=None) -> ViTShape:
        """The ViT's shape; the training section's ``--seq-length`` becomes its token count (patches + class token)."""
        shape = vit_shape_from_hf_config(self.hf_config) if self.hf_config else VIT_PRESETS[self.model or 'tiny']
        for flag, value in (("--num-layers", self.num_layers), ("--image-size", self.image_size),
                            ("--num-classes", self.num_classes)):
            if value is not None and value < 1:
                raise ConfigError(f"{flag} must be >= 1, got {value}")
        if self.image_size is not None:
            if self.image_size % shape.patch_size:
                raise ConfigError(f"--image-size {self.image_size} is not a multiple of the patch size "
                                  f"{shape.patch_size}")
            shape = dataclasses.replace(shape, image_size=self.image_size)
        if self.num_layers is not None:
            shape = dataclasses.replace(shape, num_layers=self.num_layers)
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ConfigError(f"--label-smoothing must be in [0, 1), got {self.label_smoothing}")
        training.seq_length = shape.seq_length
        return shape

    def check(self, run) -> None:
        """What a ViT does not take."""
        mesh = run.mesh
        if mesh.cp > 1:
            raise ConfigError("--context-parallel-size > 1 is not supported for ViT (context parallelism here is "
                              "causal attention for language models; a ViT's few hundred tokens need no split); use 1")
        if mesh.sequence_parallel:
            raise ConfigError(f"--sequence-parallel is not supported for ViT: its {run.shape.seq_length} tokens would "
                              "need padding and a mask to split over TP; use TP without --sequence-parallel")
        if run.fusions.cross_entropy_loss_fusion:
            raise ConfigError("--cross-entropy-loss-fusion fuses a language model's output layer over its "
                              "vocabulary; a ViT's classifier head is small: drop the flag")
        if run.engine.engine == "deepspeed" and mesh.pp > 1:
            raise ConfigError("DeepSpeed's pipeline engine runs language models only so far; use --engine megatron "
                              "for a pipelined ViT, or --pipeline-model-parallel-size 1")


SAMPLE = "examples/data/shapes_sample.parquet"


@dataclasses.dataclass
class ViTData(Section):
    GROUP = "data"
    data_path: str = option(SAMPLE,
                            help="labelled images: a datasets hub id (ethz/food101, uoft-cs/cifar100), a save_to_disk "
                                 "or class-per-folder image directory, or .parquet/.arrow files")
    image_column: Optional[str] = option(None, help="default: the data set's image column")
    label_column: Optional[str] = option(None, help="default: label, fine_label or the only class column")
    data_split: str = option("90,10", type=split_weights,
                             help="train,validation weights, for data without a validation (or test) split")
    num_workers: int = option(2, type=nonneg_int, help="DataLoader processes decoding images")
    bad_images: str = option("skip", choices=["skip", "error"],
                             help="corrupt or unlabelled images: skip and count them, or stop naming the first")
    mock_data: bool = option(False, help="synthetic learnable images instead of --data-path")

    @staticmethod
    def shipped() -> dict:
        return dict(data_path=shipped(SAMPLE))  # as qwen.config.QwenData's

    def check_files(self) -> None:
        from megatron_ext.data import image_sources

        image_sources.check(self.data_path)
