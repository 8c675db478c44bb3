"""Convert a Hugging Face Qwen2/2.5 model directory into a megatron-core distributed checkpoint.

    python tools/convert_hf_to_mcore.py --hf-path Qwen2.5-3B/ --save ckpt/qwen2.5-3b-mcore
    torchrun --nproc-per-node 8 finetune_qwen.py --hf-config Qwen2.5-3B/ --load ckpt/qwen2.5-3b-mcore --finetune ...

The checkpoint holds the weights only, each with its global shape, so it loads under any TP/PP/DP mesh without
reconverting. Tensors are read one at a time from the safetensors shards into the single model copy.
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_ext.cli import run_main  # noqa: E402
from megatron_ext.convert.common import DTYPES  # noqa: E402


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--hf-path", required=True, help="directory with config.json and model*.safetensors")
    p.add_argument("--save", required=True, help="output directory (must be empty unless --overwrite)")
    p.add_argument("--dtype", default=None, choices=["bf16", "fp32", "fp16"],
                   help="parameter dtype of the checkpoint (default: the source tensors' dtype)")
    p.add_argument("--overwrite", action="store_true")
    return p.parse_args(argv)


def main(argv=None):
    args = parse(argv)
    from megatron_ext.convert.common import SafetensorsReader, check_output_dir, check_shape
    from megatron_ext.models.shapes import read_hf_config, shape_from_hf_config

    shape = shape_from_hf_config(args.hf_path, "--hf-path")
    original = read_hf_config(args.hf_path, "--hf-path")
    reader = SafetensorsReader(args.hf_path)
    check_output_dir(args.save, args.overwrite)

    import dataclasses

    import torch
    from megatron.core import dist_checkpointing

    from megatron_ext.convert import qwen as mapping
    from megatron_ext.convert.model import padded_vocab, parameters_by_name, single_process_qwen
    from megatron_ext.errors import ConfigError

    start = time.perf_counter()
    first = mapping.rules(shape)[0].hf[0]
    dtype = DTYPES[args.dtype] if args.dtype else reader.get(first).dtype  # the source's unless asked
    model = single_process_qwen(shape, dtype)
    params = parameters_by_name(model)
    ctx = mapping.Context(shape, padded_vocab(shape))
    used = set()
    with torch.no_grad():
        for rule in mapping.rules(shape):
            tensor = rule.to_mcore([reader.get(name) for name in rule.hf], ctx)
            check_shape(" + ".join(rule.hf), tensor.shape, params[rule.mcore].shape, "--hf-path")
            params[rule.mcore].copy_(tensor)
            used.update(rule.hf)
            del tensor
    ignorable = {"lm_head.weight"} if shape.tie_word_embeddings else set()  # some tied exports repeat it
    unused = sorted(n for n in set(reader.names()) - used - ignorable if not n.endswith("rotary_emb.inv_freq"))
    if unused:
        raise ConfigError(f"--hf-path {args.hf_path}: {len(unused)} tensors have no place in a Qwen2 model "
                          f"(first: {unused[0]}); is this a plain Qwen2 checkpoint?")
    dist_checkpointing.save({"model": model.sharded_state_dict(), "model_shape": dataclasses.asdict(shape),
                             "params_dtype": str(dtype), "hf_config": original, "weights_only": True}, args.save)
    with open(os.path.join(args.save, "megatron_ext_source.json"), "w") as f:
        json.dump({"hf_path": os.path.abspath(args.hf_path), "dtype": str(dtype)}, f, indent=2)
    print(f"converted {sum(p.numel() for p in params.values()):,} parameters from {args.hf_path} to {args.save} "
          f"({str(dtype).replace('torch.', '')}) in {time.perf_counter() - start:.1f}s")


if __name__ == "__main__":
    run_main(main)
