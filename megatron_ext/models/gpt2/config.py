"""pretrain_gpt.py's own flags, as typed sections: the model (GPT-2 from scratch, and continued pretraining of the
Qwen models, dense and MoE) and megatron-core's pretraining data; the shape from them. Torch-free."""

from __future__ import annotations

import dataclasses
from typing import List, Optional

from megatron_ext.config import Section, option
from megatron_ext.errors import ConfigError
from megatron_ext.flag_types import positive_int, shipped, split_weights3
from megatron_ext.models import moe_flags
from megatron_ext.models.gpt2.shape import GPT2_PRESETS, decoder_shape_from_hf_config
from megatron_ext.models.qwen.shape import PRESETS, ModelShape

# "tiny" is GPT-2's; tiny-qwen3 and tiny-moe are tiny Qwens.
DECODER_PRESETS = {**{name: shape for name, shape in PRESETS.items() if name != "tiny"}, **GPT2_PRESETS}


@dataclasses.dataclass
class GPTModel(Section):
    GROUP = "model"
    model: Optional[str] = option(None, choices=sorted(DECODER_PRESETS),
                                  help="published GPT-2 or Qwen2.5/Qwen3 (dense or MoE) shape, or 'tiny' (GPT-2's; the "
                                       "default; with --pretrained: its config)")
    hf_config: Optional[str] = option(None, help="build from a Hugging Face GPT-2 or Qwen2/Qwen3 (or MoE) config.json "
                                                 "(overrides --model)")
    num_layers: Optional[int] = option(None, type=positive_int, help="override the preset's layer count")
    make_vocab_size_divisible_by: int = option(128, type=positive_int)

    def shape(self, training, moe: moe_flags.MoESettings):
        """A Qwen's shape takes the MoE flags; GPT-2's none, and --seq-length within its learned positions."""
        shape = decoder_shape_from_hf_config(self.hf_config) if self.hf_config else \
            DECODER_PRESETS[self.model or 'tiny']
        if self.num_layers is not None:
            if self.num_layers < 1:
                raise ConfigError(f"--num-layers must be >= 1, got {self.num_layers}")
            shape = dataclasses.replace(shape, num_layers=self.num_layers)
        if isinstance(shape, ModelShape):
            return moe.shape(shape)
        if moe.num_experts is not None:
            raise ConfigError(f"--num-experts {moe.num_experts} makes a Qwen model MoE; GPT-2 has no MoE form here: "
                              "drop it")
        if training.seq_length > shape.max_position_embeddings:
            raise ConfigError(f"--seq-length {training.seq_length} exceeds the model's {shape.max_position_embeddings} "
                              "learned positions; use a shorter sequence")
        return shape


@dataclasses.dataclass
class GPTData(Section):
    GROUP = "data (megatron-core's GPTDataset; data/pretrain.py)"
    data_path: Optional[List[str]] = option(
        None, nargs="+", help="Megatron .bin/.idx prefixes with optional weights (0.3 wiki_text_document 0.7 "
                              "web_text_document), or text preprocessed once into the cache: a .txt/.jsonl/.json/"
                              ".parquet with a text field, a datasets hub id (karpathy/tiny_shakespeare), nanoGPT's "
                              ".bin (default: the shipped Shakespeare sample)")
    train_data_path: Optional[List[str]] = option(None, nargs="+", help="the training blend alone (no --split)")
    valid_data_path: Optional[List[str]] = option(None, nargs="+", help="the validation blend alone")
    mock_data: bool = option(False, help="megatron-core's MockGPTDataset instead of --data-path")
    tokenizer: Optional[str] = option(None, help="GPT-2 tokenizer dir or hub id (default: --pretrained's, else "
                                                 "examples/tokenizers/tiny-gpt2)")
    # the first flag names the attribute (the data code reads data_split, data_cache_dir); Megatron-LM's names too
    data_split: str = option("99,1,0", flags=("--split", "--data-split"), type=split_weights3,
                             help="train,validation[,test] weights: each corpus is cut by documents (Megatron-LM's "
                                  "--split)")
    data_cache_dir: Optional[str] = option(None, flags=("--data-cache-path", "--data-cache-dir"),
                                           help="where preprocessed text and megatron-core's sample indices are "
                                                "cached, on storage every rank sees (default: beside the data)")
    reset_position_ids: bool = option(False, help="positions restart after every end-of-text token (Megatron-LM's)")
    reset_attention_mask: bool = option(False, help="attention stays within each document of a sample (cut after "
                                                    "every end-of-text token: packed documents, torch's flash kernel "
                                                    "for variable lengths on a GPU; Megatron-LM's)")
    eod_mask_loss: bool = option(False, help="no loss on the predictions from end-of-text tokens")

    @staticmethod
    def shipped() -> dict:
        return {}  # the data's default is decided with --train-data-path (arguments.parse)

    def check(self, run) -> None:
        """Which corpora: checked now (weights, combinations), read by data/pretrain.py."""
        from megatron_ext.data import mixture

        if self.train_data_path and self.data_path:
            raise ConfigError("--data-path and --train-data-path both choose the training data; keep one (--split "
                              "cuts --data-path, --train-data-path/--valid-data-path are the splits themselves)")
        if self.valid_data_path and not self.train_data_path:
            raise ConfigError("--valid-data-path needs --train-data-path (with --data-path, --split makes "
                              "validation)")
        if not (self.train_data_path or self.data_path):
            self.data_path = [shipped("examples/data/tiny_shakespeare_sample.txt")]
        for values in (self.data_path, self.train_data_path, self.valid_data_path):
            if values:
                mixture.parse(values)
        if self.reset_attention_mask and not self.reset_position_ids:
            raise ConfigError("--reset-attention-mask packs each sample's documents, whose positions restart too: "
                              "add --reset-position-ids")
        if isinstance(run.shape, ModelShape) and self.reset_position_ids and not self.reset_attention_mask:
            raise ConfigError("--reset-position-ids: a Qwen's rotary positions restart with its packed documents "
                              "only; add --reset-attention-mask")
        if self.reset_attention_mask and run.mesh.cp > 1:
            raise ConfigError("--reset-attention-mask with --context-parallel-size > 1 would need every document "
                              "padded to a multiple of 2 x CP; drop one of them")

    def check_files(self) -> None:
        from megatron_ext.data import indexed, mixture

        for flag in ("--data-path", "--train-data-path", "--valid-data-path"):
            values = getattr(self, flag[2:].replace("-", "_"))
            for _, path in mixture.parse(values) if values else ():
                indexed.check_path(path, flag)
