"""Export a megatron-core checkpoint (Qwen2/2.5, Qwen2-MoE, ViT; saved under any mesh) as a Hugging Face model.

    python tools/convert_mcore_to_hf.py --load runs/qwen3b_4d_8gpu/checkpoints --save Qwen2.5-3B-sft \
        --tokenizer Qwen2.5-3B/
    python tools/convert_mcore_to_hf.py --load runs/vit_b16_food101/checkpoints --save vit-base-patch16-224-food101

Writes config.json, model.safetensors (sharded, with an index, beyond --max-shard-size), the family's side files
(ViT: preprocessor_config.json) and, with --tokenizer, the tokenizer files. The result loads with
AutoModelForCausalLM / AutoTokenizer (Qwen2-MoE: per-expert tensors, as save_pretrained writes them; an MoE without
shared expert has no HF class and is refused) or ViTForImageClassification / AutoImageProcessor .from_pretrained (a
ViT made from google/vit-huge-patch14-224-in21k, a backbone, comes back without a classifier). The family is the one
the checkpoint records. --load takes a checkpoint root (the newest iteration is used), an iter_XXXXXXX directory, or a
converted checkpoint.
"""

import os
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_ext.cli import run_main  # noqa: E402
from megatron_ext.flag_types import Parser  # noqa: E402 (one-line errors)
from megatron_ext.convert.common import DTYPES  # noqa: E402

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".index.json")


def parse(argv=None):
    p = Parser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--load", required=True)
    p.add_argument("--save", required=True, help="output directory (must be empty unless --overwrite)")
    p.add_argument("--tokenizer", default=None, help="directory whose tokenizer files are copied alongside")
    p.add_argument("--hf-config", default=None, help="family and shape, for checkpoints that do not record them")
    p.add_argument("--dtype", default=None, choices=sorted(DTYPES),
                   help="dtype of the exported tensors (default: the checkpoint's)")
    p.add_argument("--lora", default="merge", choices=["merge", "adapters"],
                   help="a LoRA run: export the merged model (a plain HF model), or only its adapters and head "
                        "(adapters.safetensors in megatron-core names + lora_config.json)")
    p.add_argument("--max-shard-size", default="5GB")
    p.add_argument("--overwrite", action="store_true")
    return p.parse_args(argv)


def main(argv=None):
    args = parse(argv)
    import json

    from megatron.core import dist_checkpointing

    from megatron_ext.models import families
    from megatron_ext.convert.common import ShardedSafetensorsWriter, check_output_dir, mcore_to_hf_tensors, parse_size
    from megatron_ext.errors import ConfigError
    from megatron_ext import checkpoint

    path = checkpoint.find(args.load)
    if path is None:
        raise ConfigError(f"--load {args.load}: no megatron-core distributed checkpoint there")
    if args.tokenizer and not os.path.isdir(args.tokenizer):
        raise ConfigError(f"--tokenizer {args.tokenizer} is not a directory")
    record = dist_checkpointing.load_common_state_dict(path)
    if args.hf_config:
        _, family, config = families.from_hf_config(args.hf_config, "--hf-config")
        shape = family.shape_from_hf(args.hf_config, "--hf-config")
        record = dict(record, hf_config=record.get("hf_config") or config)
    else:
        family, shape = families.from_record(record, f"--load {args.load}")
    import torch

    saved_dtype = getattr(torch, record.get("params_dtype", "torch.float32").replace("torch.", ""))
    dtype = DTYPES[args.dtype] if args.dtype else saved_dtype
    # Made first: a model with no Hugging Face class (an MoE without shared expert) fails before anything is written.
    files = {"config.json": family.hf_config(shape, record, dtype),
             **(family.side_files(shape, record) if family.side_files else {})}
    check_output_dir(args.save, args.overwrite)

    from megatron_ext.convert.model import parameters_by_name

    start = time.perf_counter()
    model = family.build(shape, saved_dtype, record)
    if record.get("lora_base"):  # the checkpoint holds a LoRA run's adapters: the base comes from where it began
        load_lora_base(model, record["lora_base"], family, shape, record)
    template = model.sharded_state_dict()
    if record.get("lora"):
        from megatron_ext.models import lora

        lora.apply([model], lora.LoRAConfig.from_record(record["lora"]), 0)
        template = lora.trainable_state(model) if record.get("lora_base") else model.sharded_state_dict()
    state = dist_checkpointing.load({"model": template}, path)  # weights only
    model.load_state_dict(state["model"], strict=not record.get("lora_base"))
    del state
    if record.get("lora") and args.lora == "adapters":
        return export_adapters(model, record["lora"], args.save, dtype)
    if record.get("lora"):
        lora.merge([model])
    writer = ShardedSafetensorsWriter(args.save, parse_size(args.max_shard_size))
    with torch.no_grad():
        for name, tensor in mcore_to_hf_tensors(family.rules(shape, record), parameters_by_name(model).__getitem__,
                                                family.context(shape)):
            writer.add(name, tensor.to(dtype))
    writer.close()
    for name, content in files.items():
        with open(os.path.join(args.save, name), "w") as f:
            json.dump(content, f, indent=2)
    if args.tokenizer:
        for name in os.listdir(args.tokenizer):
            source = os.path.join(args.tokenizer, name)
            if os.path.isfile(source) and name != "config.json" and not name.endswith(WEIGHT_SUFFIXES):
                shutil.copy2(source, os.path.join(args.save, name))
        stop_at_turn_end_file(args.save)
    print(f"exported {path} ({family.label}) to {args.save} ({str(dtype).replace('torch.', '')}, "
          f"{writer.total_bytes / 2**30:.2f} GiB in {max(len(writer.shards), 1)} shard(s)) in "
          f"{time.perf_counter() - start:.1f}s")


def stop_at_turn_end_file(directory: str) -> None:
    """A copied generation_config.json also stops at the chat template's end of turn (convert/export.py)."""
    import json

    from transformers import AutoTokenizer

    from megatron_ext.convert.export import stop_at_turn_end
    from megatron_ext.data.chat import turn_end

    path = os.path.join(directory, "generation_config.json")
    if not os.path.isfile(path):
        return
    try:
        end = turn_end(AutoTokenizer.from_pretrained(directory))
    except (OSError, ValueError, TypeError):  # tokenizer files that do not load: the config stays as it was
        return
    with open(path) as f:
        generation = json.load(f)
    with open(path, "w") as f:
        json.dump(stop_at_turn_end(generation, end), f, indent=2)


def load_lora_base(model, base: dict, family, shape, record) -> None:
    """A LoRA run's frozen base into ``model``: its --pretrained Hugging Face weights (the directory it read them
    from), or the random init of its seed."""
    from megatron_ext.convert.common import SafetensorsReader
    from megatron_ext.convert.model import fill_from_hf
    from megatron_ext.errors import ConfigError
    from megatron_ext.models.init import init_mesh_independent

    if base["pretrained"] is None:
        init_mesh_independent([model], base["seed"])
        return
    directory = base.get("directory")
    if not directory or not os.path.isdir(directory):
        raise ConfigError(f"--load holds LoRA adapters for {base['pretrained']}, whose weights are not at "
                          f"{directory} any more; restore that directory (or the Hugging Face cache) first")
    fill_from_hf(model, SafetensorsReader(directory, "--load's base"), family, shape, family.rules(shape, record),
                 "--load's base")


def export_adapters(model, config: dict, save: str, dtype) -> None:
    """The trained part of a LoRA run alone: adapters and head, full (TP=1) tensors under megatron-core names."""
    import json

    from safetensors.torch import save_file

    from megatron_ext.convert.model import parameters_by_name

    os.makedirs(save, exist_ok=True)
    tensors = {name: p.detach().to(dtype).contiguous() for name, p in parameters_by_name(model).items()
               if ".lora_" in name or name.startswith("head.")}
    save_file(tensors, os.path.join(save, "adapters.safetensors"))
    with open(os.path.join(save, "lora_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    print(f"exported {len(tensors)} adapter/head tensors ({sum(t.numel() for t in tensors.values()):,} values) "
          f"to {save}")


if __name__ == "__main__":
    run_main(main)
