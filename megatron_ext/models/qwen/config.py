"""Each model family's own flags and its shape from them: Qwen2 (dense and MoE), ViT, GPT-2. The shared groups
(parallelism, engine, training, checkpoints, logging) live in ``arguments``; this module is torch-free too."""

from __future__ import annotations

import argparse
import dataclasses

from megatron_ext.convert import source as pretrained_source
from megatron_ext.data import chat
from megatron_ext.errors import ConfigError
from megatron_ext.flag_types import (fraction, int_at_least, nonneg_int, positive_float, positive_int,
                                     split_weights, split_weights3, shipped)
from megatron_ext.models import moe_flags
from megatron_ext.training import dpo_flags
from megatron_ext.models.shapes import (GPT2_PRESETS, PRESETS, VIT_PRESETS, ModelShape, ViTShape,
                                        decoder_shape_from_hf_config, shape_from_hf_config, vit_shape_from_hf_config)


def _language_model_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", default=None, choices=sorted(PRESETS),
                   help="published Qwen2.5/Qwen3 shape or 'tiny' (default; with --pretrained: its config)")
    g.add_argument("--hf-config", default=None,
                   help="build from a Hugging Face Qwen2/Qwen3 (or MoE) config.json (overrides --model)")
    g.add_argument("--num-layers", type=positive_int, default=None, help="override the preset's layer count")
    g.add_argument("--transformer-impl", default="local", choices=["local", "transformer_engine"],
                   help="local: our SDPA attention + torch norms; transformer_engine: TE's spec (needs TE)")
    g.add_argument("--make-vocab-size-divisible-by", type=positive_int, default=128)
    g = _lora_flags(p)
    g.add_argument("--pretrained-adapter", default=None, metavar="DIR",
                   help="start the adapters from a PEFT LoRA adapter (ours or one trained with peft) for --pretrained")
    g.add_argument("--save-peft", default=None, metavar="DIR",
                   help="at the end, the adapters as a PEFT LoRA adapter (peft.PeftModel.from_pretrained loads it)")
    moe_flags.add_flags(p)
    dpo_flags.add_flags(p)


def _vision_model_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", default=None, choices=sorted(VIT_PRESETS),
                   help="published ViT shape or 'tiny' (default; with --pretrained: its config)")
    g.add_argument("--hf-config", default=None, help="build from a Hugging Face ViT config.json (overrides --model)")
    g.add_argument("--num-layers", type=positive_int, default=None, help="override the preset's layer count")
    g.add_argument("--image-size", type=positive_int, default=None, help="override the preset's image size (pixels)")
    g.add_argument("--num-classes", type=int_at_least(2), default=None,
                   help="default: the data's (10 with --mock-data)")
    g.add_argument("--label-smoothing", type=fraction, default=0.0)
    p.set_defaults(num_experts=None, transformer_impl="local")
    _lora_flags(p)


def _language_data_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data")
    g.add_argument("--data-path", nargs="+", default=[shipped("examples/data/metamathqa_sample.jsonl")],
                   help="a datasets hub id (meta-math/MetaMathQA) or a local .json/.jsonl/.parquet; several with "
                        "weights: 0.7 a.jsonl 0.3 b.jsonl")
    g.add_argument("--mock-data", action="store_true", help="synthetic token sequences instead of --data-path")
    g.add_argument("--tokenizer", default=None,
                   help="Hugging Face tokenizer dir or id (default: --pretrained's, else "
                        "examples/tokenizers/tiny-qwen)")
    g.add_argument("--data-split", type=split_weights, default="98,2",
                   help="train,validation weights of the records")
    g.add_argument("--system-prompt", default=None)
    g.add_argument("--data-format", default="auto", choices=list(chat.FORMATS),
                   help="auto: by each row's columns (query/response, instruction/output, conversations, messages, "
                        "prompt/completion)")
    g.add_argument("--data-columns", default=None,
                   help="rename columns, e.g. query=question,response=answer (names: " + ",".join(chat.COLUMNS) + ")")
    g.add_argument("--data-role-tags", default=None,
                   help="ShareGPT tags, e.g. role_tag=from,content_tag=value,user_tag=human,assistant_tag=gpt")
    g.add_argument("--loss-on", default="assistant", choices=list(chat.LOSS_ON),
                   help="train every assistant turn, only the last, or every token")
    g.add_argument("--pack-sequences", action="store_true",
                   help="concatenate examples to --seq-length; attention and positions restart per example")
    g.add_argument("--bad-rows", default="skip", choices=["skip", "error"])
    g.add_argument("--data-cache-dir", default=None, help="tokenized-data cache (default: beside the data)")
    g.add_argument("--eval-generate-samples", type=nonneg_int, default=0,
                   help="at every evaluation, math accuracy of greedy answers (up to 512 tokens) to N held-out "
                        "problems (validation rows with '#### N', \\boxed{} or 'The answer is: X'); 0 disables")


def _vision_data_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data")
    g.add_argument("--data-path", default=shipped("examples/data/shapes_sample.parquet"),
                   help="labelled images: a datasets hub id (ethz/food101, uoft-cs/cifar100), a save_to_disk or "
                        "class-per-folder image directory, or .parquet/.arrow files")
    g.add_argument("--image-column", default=None, help="default: the data set's image column")
    g.add_argument("--label-column", default=None, help="default: label, fine_label or the only class column")
    g.add_argument("--data-split", type=split_weights, default="90,10",
                   help="train,validation weights, for data without a validation (or test) split")
    g.add_argument("--num-workers", type=nonneg_int, default=2, help="DataLoader processes decoding images")
    g.add_argument("--bad-images", default="skip", choices=["skip", "error"],
                   help="corrupt or unlabelled images: skip and count them, or stop naming the first")
    g.add_argument("--mock-data", action="store_true", help="synthetic learnable images instead of --data-path")


def _lora_flags(p: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    g = p.add_argument_group("LoRA (frozen base, trained adapters and head)")
    g.add_argument("--lora-rank", type=nonneg_int, default=0, help="adapter rank; 0 trains every weight")
    g.add_argument("--lora-alpha", type=positive_float, default=None, help="scale alpha/rank (default: alpha = rank)")
    g.add_argument("--lora-targets", default="qkv", help="comma list of qkv, proj, fc1, fc2")
    g.add_argument("--lora-dropout", type=fraction, default=0.0)
    return g


def vit_shape_from_args(args: argparse.Namespace) -> ViTShape:
    """The ViT's shape; ``--seq-length`` becomes its token count (patches + class token)."""
    shape = vit_shape_from_hf_config(args.hf_config) if args.hf_config else VIT_PRESETS[args.model or 'tiny']
    for flag, value in (("--num-layers", args.num_layers), ("--image-size", args.image_size),
                        ("--num-classes", args.num_classes)):
        if value is not None and value < 1:
            raise ConfigError(f"{flag} must be >= 1, got {value}")
    if args.image_size is not None:
        if args.image_size % shape.patch_size:
            raise ConfigError(f"--image-size {args.image_size} is not a multiple of the patch size "
                              f"{shape.patch_size}")
        shape = dataclasses.replace(shape, image_size=args.image_size)
    if args.num_layers is not None:
        shape = dataclasses.replace(shape, num_layers=args.num_layers)
    if not 0.0 <= args.label_smoothing < 1.0:
        raise ConfigError(f"--label-smoothing must be in [0, 1), got {args.label_smoothing}")
    args.seq_length = shape.seq_length
    return shape


def model_shape_from_args(args: argparse.Namespace) -> ModelShape:
    shape = shape_from_hf_config(args.hf_config) if args.hf_config else PRESETS[args.model or 'tiny']
    if args.num_layers is not None:
        shape = dataclasses.replace(shape, num_layers=args.num_layers)
    return moe_flags.shape_from_args(shape, args)




# What pretrain_gpt.py trains: GPT-2 from scratch, and continued pretraining of the Qwen models, dense and MoE
# ("tiny" is GPT-2's; tiny-qwen3 and tiny-moe are tiny Qwens).
DECODER_PRESETS = {**{name: shape for name, shape in PRESETS.items() if name != "tiny"}, **GPT2_PRESETS}


def _gpt_model_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", default=None, choices=sorted(DECODER_PRESETS),
                   help="published GPT-2 or Qwen2.5/Qwen3 (dense or MoE) shape, or 'tiny' (GPT-2's; the default; with "
                        "--pretrained: its config)")
    g.add_argument("--hf-config", default=None,
                   help="build from a Hugging Face GPT-2 or Qwen2/Qwen3 (or MoE) config.json (overrides --model)")
    g.add_argument("--num-layers", type=positive_int, default=None, help="override the preset's layer count")
    g.add_argument("--make-vocab-size-divisible-by", type=positive_int, default=128)
    moe_flags.add_flags(p)  # a Qwen MoE's (or one upcycled from a dense Qwen)
    p.set_defaults(transformer_impl="local", lora_rank=0)


def _gpt_data_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data (megatron-core's GPTDataset; data/pretrain.py)")
    g.add_argument("--data-path", nargs="+", default=None,
                   help="Megatron .bin/.idx prefixes with optional weights (0.3 wiki_text_document 0.7 "
                        "web_text_document), or text preprocessed once into the cache: a .txt/.jsonl/.json/.parquet with a text field, a "
                        "datasets hub id (karpathy/tiny_shakespeare), nanoGPT's .bin (default: the shipped Shakespeare "
                        "sample)")
    g.add_argument("--train-data-path", nargs="+", default=None, help="the training blend alone (no --split)")
    g.add_argument("--valid-data-path", nargs="+", default=None, help="the validation blend alone")
    g.add_argument("--mock-data", action="store_true", help="megatron-core's MockGPTDataset instead of --data-path")
    g.add_argument("--tokenizer", default=None,
                   help="GPT-2 tokenizer dir or hub id (default: --pretrained's, else examples/tokenizers/tiny-gpt2)")
    g.add_argument("--split", "--data-split", dest="data_split", type=split_weights3, default="99,1,0",
                   help="train,validation[,test] weights: each corpus is cut by documents (Megatron-LM's --split)")
    g.add_argument("--data-cache-path", "--data-cache-dir", dest="data_cache_dir", default=None,
                   help="where preprocessed text and megatron-core's sample indices are cached, on storage every rank "
                        "sees (default: beside the data)")
    g.add_argument("--reset-position-ids", action="store_true",
                   help="positions restart after every end-of-text token (Megatron-LM's)")
    g.add_argument("--reset-attention-mask", action="store_true",
                   help="attention stays within each document of a sample (cut after every end-of-text token: packed "
                        "documents, torch's flash kernel for variable lengths on a GPU; Megatron-LM's)")
    g.add_argument("--eod-mask-loss", action="store_true", help="no loss on the predictions from end-of-text tokens")


def gpt_shape_from_args(args: argparse.Namespace):
    shape = decoder_shape_from_hf_config(args.hf_config) if args.hf_config else DECODER_PRESETS[args.model or 'tiny']
    if args.num_layers is not None:
        if args.num_layers < 1:
            raise ConfigError(f"--num-layers must be >= 1, got {args.num_layers}")
        shape = dataclasses.replace(shape, num_layers=args.num_layers)
    if isinstance(shape, ModelShape):
        return moe_flags.shape_from_args(shape, args)
    if args.num_experts is not None:
        raise ConfigError(f"--num-experts {args.num_experts} makes a Qwen model MoE; GPT-2 has no MoE form here: "
                          "drop it")
    if args.seq_length > shape.max_position_embeddings:
        raise ConfigError(f"--seq-length {args.seq_length} exceeds the model's {shape.max_position_embeddings} learned "
                          "positions; use a shorter sequence")
    return shape


@dataclasses.dataclass(frozen=True)
class Family:
    model_flags: object
    data_flags: object
    shape_from_args: object
    presets: dict
    shape_from_hf: object


FAMILIES = {
    "qwen": Family(_language_model_flags, _language_data_flags, model_shape_from_args, PRESETS, shape_from_hf_config),
    "vit": Family(_vision_model_flags, _vision_data_flags, vit_shape_from_args, VIT_PRESETS, vit_shape_from_hf_config),
    "gpt": Family(_gpt_model_flags, _gpt_data_flags, gpt_shape_from_args, DECODER_PRESETS,
                  decoder_shape_from_hf_config),
}


def apply_pretrained(args: argparse.Namespace, family: str) -> None:
    """--pretrained: the model's shape from its config.json (an explicit --model must agree, or be the MoE model
    a dense source upcycles into), the language families' tokenizer from it too."""
    if args.pretrained not in (None, "none") and args.finetune:
        raise ConfigError(f"--pretrained {args.pretrained} and --load {args.load} --finetune both choose the first "
                          "weights; keep one (--pretrained also takes one of our checkpoints)")
    data = getattr(args, "data_path", None)
    named = [args.pretrained, getattr(args, "tokenizer", None), *(data if isinstance(data, list) else [data])]
    if any(isinstance(n, str) and pretrained_source.is_hub_id(n) for n in named):
        pretrained_source.offline_unless_reachable()  # no network: the cache, at once
    source = pretrained_source.resolve(args, family)
    upcycle = False
    if source is not None and source.config_path is not None:
        fam = FAMILIES[family]
        loaded = fam.shape_from_hf(source.config_path, f"--pretrained {source.name}")
        if args.model is not None:
            preset = fam.presets[args.model]
            upcycle = (getattr(preset, "moe", None) is not None and getattr(loaded, "moe", 0) is None
                       and dataclasses.replace(preset, moe=None) == loaded)  # dense source, MoE model: upcycled
            if preset != loaded and not upcycle:
                raise ConfigError(f"--model {args.model} is not the model of --pretrained {source.name}; drop --model "
                                  "(the shape comes from the source's config.json)")
        if args.model is None or not upcycle:
            args.hf_config = source.config_path
        if family != "vit" and args.tokenizer is None:
            args.tokenizer = source.directory or source.name  # a hub id: its snapshot once fetched
    if family != "vit" and args.tokenizer is None:
        args.tokenizer = shipped(pretrained_source.DEFAULT_TOKENIZER[family])
    args.pretrained_source = source
    pretrained_source.check_export_dir(args.save_hf)


def check_data_files(args: argparse.Namespace, family: str) -> None:
    """A local --data-path that is missing or unreadable, in one line before any rank starts (megatron_ext.launch);
    without it, the same line comes as the data loads. Hub ids are looked up as they load."""
    if getattr(args, "mock_data", False):
        return
    from megatron_ext.data import indexed, mixture, rows

    if family == "qwen":
        for _, path in args.data_mixture:
            rows.check_path(path)
    elif family == "gpt":
        for flag in ("--data-path", "--train-data-path", "--valid-data-path"):
            values = getattr(args, flag[2:].replace("-", "_"))
            for _, path in mixture.parse(values) if values else ():
                indexed.check_path(path, flag)
    elif family == "vit":
        from megatron_ext.data import image_sources

        image_sources.check(args.data_path)
