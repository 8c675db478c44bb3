"""Export a megatron-core checkpoint of a Qwen2/2.5 model (saved under any mesh) as a Hugging Face model directory.

    python tools/convert_mcore_to_hf.py --load runs/qwen3b_4d_8gpu/checkpoints --save Qwen2.5-3B-sft \
        --tokenizer Qwen2.5-3B/

Writes config.json, model.safetensors (sharded, with an index, beyond --max-shard-size) and, with --tokenizer, the
tokenizer files; the result loads with AutoModelForCausalLM / AutoTokenizer.from_pretrained. --load takes a
checkpoint root (the newest iteration is used), an iter_XXXXXXX directory, or a converted checkpoint.
"""

import argparse
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_ext.cli import run_main  # noqa: E402

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".index.json")


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--load", required=True)
    p.add_argument("--save", required=True, help="output directory (must be empty unless --overwrite)")
    p.add_argument("--tokenizer", default=None, help="directory whose tokenizer files are copied alongside")
    p.add_argument("--hf-config", default=None, help="shape, for checkpoints that do not carry one")
    p.add_argument("--dtype", default=None, choices=["bf16", "fp32", "fp16"],
                   help="dtype of the exported tensors (default: the checkpoint's)")
    p.add_argument("--max-shard-size", default="5GB")
    p.add_argument("--overwrite", action="store_true")
    return p.parse_args(argv)


def main(argv=None):
    args = parse(argv)
    import json

    import torch
    from megatron.core import dist_checkpointing

    from megatron_ext.convert import qwen as mapping
    from megatron_ext.convert.common import DTYPES, ShardedSafetensorsWriter, check_output_dir, parse_size
    from megatron_ext.convert.model import padded_vocab, parameters_by_name, single_process_qwen
    from megatron_ext.errors import ConfigError
    from megatron_ext.models.shapes import ModelShape, shape_from_hf_config
    from megatron_ext.training import checkpoint

    path = checkpoint.find(args.load)
    if path is None:
        raise ConfigError(f"--load {args.load}: no megatron-core distributed checkpoint there")
    if args.tokenizer and not os.path.isdir(args.tokenizer):
        raise ConfigError(f"--tokenizer {args.tokenizer} is not a directory")
    common = dist_checkpointing.load_common_state_dict(path)
    if args.hf_config:
        shape = shape_from_hf_config(args.hf_config)
    elif "model_shape" in common:
        shape = ModelShape(**common["model_shape"])
    else:
        raise ConfigError(f"--load {args.load}: the checkpoint does not record its model; pass --hf-config")
    check_output_dir(args.save, args.overwrite)

    start = time.perf_counter()
    saved_dtype = getattr(torch, common.get("params_dtype", "torch.float32").replace("torch.", ""))
    model = single_process_qwen(shape, saved_dtype)
    state = dist_checkpointing.load({"model": model.sharded_state_dict()}, path)  # weights only
    model.load_state_dict(state["model"])
    del state
    dtype = DTYPES[args.dtype] if args.dtype else saved_dtype
    writer = ShardedSafetensorsWriter(args.save, parse_size(args.max_shard_size))
    with torch.no_grad():
        for name, tensor in mapping.mcore_to_hf_tensors(parameters_by_name(model).__getitem__,
                                                        mapping.Context(shape, padded_vocab(shape))):
            writer.add(name, tensor.to(dtype))
    writer.close()
    with open(os.path.join(args.save, "config.json"), "w") as f:
        json.dump(mapping.hf_config(shape, common.get("hf_config"), dtype), f, indent=2)
    if args.tokenizer:
        for name in os.listdir(args.tokenizer):
            source = os.path.join(args.tokenizer, name)
            if os.path.isfile(source) and name != "config.json" and not name.endswith(WEIGHT_SUFFIXES):
                shutil.copy2(source, os.path.join(args.save, name))
    print(f"exported {path} to {args.save} ({str(dtype).replace('torch.', '')}, {writer.total_bytes / 2**30:.2f} GiB in "
          f"{max(len(writer.shards), 1)} shard(s)) in {time.perf_counter() - start:.1f}s")


if __name__ == "__main__":
    run_main(main)
