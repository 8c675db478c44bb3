"""Convert a Hugging Face model directory (Qwen2/2.5, Qwen2-MoE, ViT) into a megatron-core distributed checkpoint.

    python tools/convert_hf_to_mcore.py --hf-path Qwen2.5-3B/ --save ckpt/qwen2.5-3b-mcore
    torchrun --nproc-per-node 8 finetune_qwen.py --hf-config Qwen2.5-3B/ --load ckpt/qwen2.5-3b-mcore --finetune ...

    python tools/convert_hf_to_mcore.py --hf-path Qwen1.5-MoE-A2.7B/ --save ckpt/qwen-moe   # loads under any EP too
    python tools/convert_hf_to_mcore.py --hf-path vit-base-patch16-224/ --save ckpt/vit-b16   # google/..., 1000 classes
    python tools/convert_hf_to_mcore.py --hf-path vit-huge-patch14-224-in21k/ --save ckpt/vit-h14  # backbone, no head
    torchrun --nproc-per-node 8 pretrain_vit.py --hf-config vit-huge-patch14-224-in21k/ --load ckpt/vit-h14 \
        --finetune --num-classes 101 ...   # a new, zero-initialised head

The family comes from config.json's model_type (tools: models/families.py). The checkpoint holds the weights only,
each with its global shape, so it loads under any TP/PP/DP/EP mesh without reconverting. Tensors are read one at a
time from the safetensors shards into the single model copy.
"""

import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_ext.cli import run_main  # noqa: E402
from megatron_ext.flag_types import Parser  # noqa: E402 (one-line errors)
from megatron_ext.convert.common import DTYPES  # noqa: E402


def parse(argv=None):
    p = Parser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--hf-path", required=True, help="directory with config.json and model*.safetensors")
    p.add_argument("--save", required=True, help="output directory (must be empty unless --overwrite)")
    p.add_argument("--dtype", default=None, choices=sorted(DTYPES),
                   help="parameter dtype of the checkpoint (default: the source tensors' dtype)")
    p.add_argument("--overwrite", action="store_true")
    return p.parse_args(argv)


def main(argv=None):
    args = parse(argv)
    import json

    from megatron_ext.models import families
    from megatron_ext.convert.common import SafetensorsReader, check_output_dir

    model_type, family, original = families.from_hf_config(args.hf_path, "--hf-path")
    shape = family.shape_from_hf(args.hf_path, "--hf-path")
    reader = SafetensorsReader(args.hf_path)
    rules, record = family.source(shape, reader.names(), reader.get)
    record.update(model_type=model_type, hf_config=original,
                  hf_files=families.carried_files(family, args.hf_path, "--hf-path"))
    check_output_dir(args.save, args.overwrite)

    from megatron.core import dist_checkpointing

    from megatron_ext.convert.model import fill_from_hf, parameters_by_name
    from megatron_ext.errors import ConfigError

    start = time.perf_counter()
    dtype = DTYPES[args.dtype] if args.dtype else reader.get(rules[0].hf[0]).dtype  # the source's unless asked
    model = family.build(shape, dtype, record)
    params = parameters_by_name(model)
    unset = sorted(set(params) - {rule.mcore for rule in rules})
    if unset:  # a bug in the family's table or builder, never the user's: nothing is saved uninitialised
        raise RuntimeError(f"the {family.label} table leaves {len(unset)} parameters unset (first: {unset[0]})")
    used = fill_from_hf(model, reader, family, shape, rules, "--hf-path")
    unused = sorted(n for n in set(reader.names()) - used if not family.ignorable(n, shape))
    if unused:
        raise ConfigError(f"--hf-path {args.hf_path}: {len(unused)} tensors have no place in a {family.label} model "
                          f"(first: {unused[0]}); is this a plain {family.label} checkpoint?")
    dist_checkpointing.save({"model": model.sharded_state_dict(), "model_shape": dataclasses.asdict(shape),
                             "params_dtype": str(dtype), "weights_only": True, **record}, args.save)
    with open(os.path.join(args.save, "megatron_ext_source.json"), "w") as f:
        json.dump({"hf_path": os.path.abspath(args.hf_path), "dtype": str(dtype)}, f, indent=2)
    print(f"converted {sum(p.numel() for p in params.values()):,} parameters of a {family.label} model from "
          f"{args.hf_path} to {args.save} ({str(dtype).replace('torch.', '')}) in {time.perf_counter() - start:.1f}s")


if __name__ == "__main__":
    run_main(main)
