"""Upcycle a dense Qwen2/2.5 or Qwen3 model into a Qwen2-MoE or Qwen3-MoE that computes the same function at step 0.

    python tools/upcycle_moe.py --load Qwen2.5-3B/ --num-experts 8 --moe-router-topk 2 --save Qwen2.5-3B-8x
    python tools/upcycle_moe.py --load Qwen2.5-3B/ --num-experts 16 --moe-router-topk 4 --granularity 2 \
        --save Qwen2.5-3B-16x2            # fine-grained: each expert is half of the dense FFN
    python tools/convert_hf_to_mcore.py --hf-path Qwen2.5-3B-8x --save ckpt/qwen2.5-3b-8x
    torchrun --nproc-per-node 8 finetune_qwen.py --hf-config Qwen2.5-3B-8x --load ckpt/qwen2.5-3b-8x --finetune \
        --expert-model-parallel-size 8 --moe-aux-loss-coeff 1e-2 ...

--load is a Hugging Face Qwen2 or Qwen3 directory (config.json + safetensors) or one of our checkpoints (a training run or a
converted one: tools/convert_mcore_to_hf.py exports it first, in this process). The output is a Hugging Face
directory, per-expert tensors as save_pretrained writes them, with the source's tokenizer and generation files, so
transformers loads it and tools/convert_hf_to_mcore.py imports it for any TP/PP/EP mesh.

The recipe (sparse upcycling, arXiv 2212.05055; fine-grained "virtual groups", arXiv 2410.07524), chosen so that the
upcycled model's output equals the dense model's exactly (up to float rounding), not approximately:
- Every MoE layer's experts are copies of the dense MLP, or with --granularity G of one of its G slices along the
  intermediate dimension (expert e holds slice e mod G); attention, norms, embeddings and head are copied.
- Routing renormalises the top-k probabilities (norm_topk_prob=True; megatron-core: top-k, then softmax over the
  k). The k weights of a token then sum to 1, and a weighted sum of identical experts is the dense MLP. Without
  renormalisation (Qwen1.5-MoE's setting) the output would be scaled by the selected probability mass, about k/E.
- G > 1: the router's rows are identical within each group of G consecutive experts (one random row per group), so
  a token's top-k (k a multiple of G) selects whole groups and its weights are equal within a group, summing to
  1/G per slice of each group's share. SwiGLU is a sum over intermediate units, so the G slices add up to the
  dense MLP once each slice's down_proj is scaled by G. gate_proj/up_proj are not scaled: silu(a*x)*(b*x) is not
  a multiple of silu(x)*x. Megatron-LM's --moe-use-upcycling multiplies fc1 and fc2 by scale**(1/3) for gated
  MLPs, which is exact only for G=1 with renormalised routing; it also needs the first layer to be MoE, expert TP
  equal to TP, and fails with virtual pipelining (its VPP branch passes its arguments reversed); upcycling here, in
  Hugging Face space, has none of those couplings.
- A Qwen3 source gives a Qwen3-MoE (Qwen3MoeForCausalLM), which has no shared expert. The shared expert
  (Qwen2-MoE always has one; --shared-expert-size, default the expert size) contributes exactly
  0 and still trains: its down_proj and its sigmoid gate's weight start at 0 (gate 0.5), its gate_proj/up_proj
  are the dense MLP's first units (cycled), so its down_proj receives the dense features' gradient from step 1.
- The router is small and random (--router-init-std, default 0.02, --seed): an all-zero router ties every expert
  and sends the whole first batch to the same ones; small logits keep the routing near uniform.
Train with a load-balancing loss (e.g. --moe-aux-loss-coeff 1e-2) and a fresh optimizer (--finetune).
"""

import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_ext.cli import run_main  # noqa: E402
from megatron_ext.flag_types import Parser  # noqa: E402 (one-line errors)
from megatron_ext.convert.common import DTYPES  # noqa: E402

TOOLS = os.path.dirname(os.path.abspath(__file__))
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".index.json", ".h5", ".msgpack")


def parse(argv=None):
    p = Parser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--load", required=True, help="dense Qwen2 or Qwen3 model: a Hugging Face directory or one of our "
                                                 "megatron-core checkpoints")
    p.add_argument("--save", required=True, help="output Hugging Face directory (must be empty unless --overwrite)")
    p.add_argument("--num-experts", type=int, required=True, help="routed experts per layer")
    p.add_argument("--moe-router-topk", type=int, default=2, help="experts per token (a multiple of --granularity)")
    p.add_argument("--granularity", type=int, default=1,
                   help="G: each expert is one of G slices of the dense FFN (fine-grained experts)")
    p.add_argument("--shared-expert-size", type=int, default=None,
                   help="the shared expert's FFN size (default: the routed experts' size); Qwen2 only")
    p.add_argument("--router-init-std", type=float, default=0.02)
    p.add_argument("--seed", type=int, default=1234, help="for the router's initialisation")
    p.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="default: the source tensors' dtype")
    p.add_argument("--tokenizer", default=None, help="directory whose tokenizer files are copied (a Hugging Face "
                                                      "--load's own are copied anyway)")
    p.add_argument("--hf-config", default=None, help="for our checkpoints that do not record their model")
    p.add_argument("--max-shard-size", default="5GB")
    p.add_argument("--overwrite", action="store_true")
    return p.parse_args(argv)


def check_flags(args, ffn_hidden_size: int) -> int:
    """The routed experts' FFN size, or a one-line ConfigError naming the flag and the fix."""
    from megatron_ext.convert.upcycle import check
    from megatron_ext.errors import ConfigError

    expert_size = check(args.num_experts, args.moe_router_topk, args.granularity, ffn_hidden_size)
    if args.shared_expert_size is not None and args.shared_expert_size < 1:
        raise ConfigError(f"--shared-expert-size must be >= 1, got {args.shared_expert_size} (Qwen2-MoE always "
                          "has a shared expert)")
    if args.router_init_std < 0:
        raise ConfigError(f"--router-init-std must be >= 0, got {args.router_init_std}")
    return expert_size


def export_ours(load: str, hf_config, tokenizer, out: str) -> None:
    """One of our checkpoints as a Hugging Face directory: tools/convert_mcore_to_hf.py, in this process."""
    import importlib.util

    from megatron.core import dist_checkpointing

    from megatron_ext.errors import ConfigError
    from megatron_ext import checkpoint

    model_type = dist_checkpointing.load_common_state_dict(checkpoint.find(load)).get("model_type")
    if model_type not in (None, "qwen2", "qwen3"):
        raise ConfigError(f"--load {load} holds a {model_type} model; upcycling takes a dense Qwen2 or Qwen3 model")
    spec = importlib.util.spec_from_file_location("convert_mcore_to_hf", os.path.join(TOOLS, "convert_mcore_to_hf.py"))
    exporter = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(exporter)
    exporter.main(["--load", load, "--save", out, "--overwrite"] + (["--hf-config", hf_config] if hf_config else [])
                  + (["--tokenizer", tokenizer] if tokenizer else []))


def main(argv=None):
    args = parse(argv)
    from megatron_ext.errors import ConfigError

    if os.path.isfile(os.path.join(args.load, "config.json")):
        return upcycle(args, args.load)
    from megatron_ext import checkpoint

    if not os.path.isdir(args.load) or checkpoint.find(args.load) is None:
        raise ConfigError(f"--load {args.load}: neither a Hugging Face directory (config.json) nor a megatron-core "
                          "checkpoint")
    from megatron_ext.convert.common import check_output_dir

    check_output_dir(args.save, args.overwrite)  # before the export: nothing is done for a run that cannot finish
    parent = os.path.dirname(os.path.abspath(args.save))
    with tempfile.TemporaryDirectory(dir=parent, prefix=".upcycle-dense-") as dense:
        export_ours(args.load, args.hf_config, args.tokenizer, dense)
        return upcycle(args, dense, overwrite=True)


def upcycle(args, source: str, overwrite: bool = False) -> None:
    import json

    import transformers

    from megatron_ext.convert.common import SafetensorsReader, ShardedSafetensorsWriter, check_output_dir, parse_size
    from megatron_ext.models.hf_rules import read_json
    from megatron_ext.convert.upcycle import DENSE_MLP, upcycled_layer
    from megatron_ext.errors import ConfigError
    from megatron_ext.models.qwen.shape import shape_from_hf_config

    flag = f"--load {args.load}"
    shape = shape_from_hf_config(source, flag)
    dense_config = read_json(os.path.join(source, "config.json"), flag)
    if shape.moe is not None:
        raise ConfigError(f"{flag} is already an MoE model; upcycling takes a dense Qwen2 or Qwen3 model")
    if dense_config.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{flag}: hidden_act {dense_config['hidden_act']!r}; the MoE experts are SwiGLU (silu)")
    expert_size = check_flags(args, shape.ffn_hidden_size)
    if shape.qk_norm and args.shared_expert_size is not None:
        raise ConfigError(f"--shared-expert-size: {flag} is a Qwen3 model, and Qwen3-MoE has no shared expert; "
                          "drop the flag")
    shared_size = None if shape.qk_norm else args.shared_expert_size or expert_size
    reader = SafetensorsReader(source, flag)
    check_output_dir(args.save, args.overwrite or overwrite)
    for name in os.listdir(args.save):  # --overwrite: no stale shard or index of an earlier run is left to load
        if name.endswith(WEIGHT_SUFFIXES):
            os.remove(os.path.join(args.save, name))
    start = time.perf_counter()
    names = reader.names()
    dtype = DTYPES[args.dtype] if args.dtype else reader.get(names[0]).dtype
    writer = ShardedSafetensorsWriter(args.save, parse_size(args.max_shard_size))
    for name in names:
        if not DENSE_MLP.match(name):
            writer.add(name, reader.get(name).to(dtype))
    for i in range(shape.num_layers):
        gate, up, down = (reader.get(f"model.layers.{i}.mlp.{p}_proj.weight").float() for p in ("gate", "up", "down"))
        for name, tensor in upcycled_layer(i, gate, up, down, args.num_experts, args.granularity, shared_size,
                                           args.router_init_std, args.seed):
            writer.add(name, tensor.to(dtype, copy=True))  # copies: safetensors refuses tensors sharing memory
    writer.close()
    keep = {k: v for k, v in dense_config.items()
            if k not in ("architectures", "model_type", "torch_dtype", "dtype", "transformers_version")}
    moe = {"num_experts": args.num_experts, "num_experts_per_tok": args.moe_router_topk,
           "moe_intermediate_size": expert_size, "norm_topk_prob": True, "decoder_sparse_step": 1,
           "mlp_only_layers": []}
    if shape.qk_norm:
        config_class, architecture = transformers.Qwen3MoeConfig, "Qwen3MoeForCausalLM"
        moe["head_dim"] = shape.kv_channels  # Qwen3MoeConfig has no default of 128, as Qwen3Config has
    else:
        config_class, architecture = transformers.Qwen2MoeConfig, "Qwen2MoeForCausalLM"
        moe.update(shared_expert_intermediate_size=shared_size, qkv_bias=True)
    config = config_class.from_dict({**keep, **moe})
    config.architectures, config.dtype = [architecture], dtype
    config.save_pretrained(args.save)
    with open(os.path.join(args.save, "megatron_ext_upcycle.json"), "w") as f:
        json.dump({"source": os.path.abspath(args.load), **{k: v for k, v in vars(args).items()
                                                             if k not in ("load", "save", "overwrite")}}, f, indent=2)
    for directory in [source] + ([args.tokenizer] if args.tokenizer else []):
        for name in os.listdir(directory):
            path = os.path.join(directory, name)
            if os.path.isfile(path) and name != "config.json" and not name.endswith(WEIGHT_SUFFIXES) \
                    and not name.startswith("megatron_ext_"):
                shutil.copy2(path, os.path.join(args.save, name))
    shared = f"shared expert {shared_size}" if shared_size else "no shared expert"
    print(f"upcycled {args.load} into {args.num_experts} experts (top-{args.moe_router_topk}, granularity "
          f"{args.granularity}, expert FFN {expert_size}, {shared}) per layer: {args.save} "
          f"({str(dtype).replace('torch.', '')}, {writer.total_bytes / 2**30:.2f} GiB) in "
          f"{time.perf_counter() - start:.1f}s")


if __name__ == "__main__":
    run_main(main)
