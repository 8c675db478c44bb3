"""Peak memory and time of converting a Qwen2.5-3B-sized model HF -> megatron-core -> HF (random weights).

    python bench/convert_memory.py --model qwen2.5-3b --workdir /tmp/convert3b --out bench/results/convert_3b.json

Builds a random-init model of the preset's published shape in bf16 (no download), saves it as HF safetensors
shards, then runs tools/convert_hf_to_mcore.py and tools/convert_mcore_to_hf.py as child processes and records
each one's peak resident memory (ru_maxrss) and wall time. The weights alone are 2 bytes x parameters: a converter
that held two full copies would peak above twice that.
"""

import argparse
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def make_model(shape, path):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=shape.vocab_size, hidden_size=shape.hidden_size,
                         intermediate_size=shape.ffn_hidden_size, num_hidden_layers=shape.num_layers,
                         num_attention_heads=shape.num_attention_heads, num_key_value_heads=shape.num_query_groups,
                         max_position_embeddings=shape.max_position_embeddings, rope_theta=shape.rope_theta,
                         rms_norm_eps=shape.rms_norm_eps, tie_word_embeddings=shape.tie_word_embeddings,
                         dtype="bfloat16")
    with torch.device("meta"):
        model = Qwen2ForCausalLM(config)
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    model.tie_weights()  # to_empty allocates lm_head separately; Qwen2.5-3B shares it with the embedding
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.02, generator=generator)
    model.save_pretrained(path, max_shard_size="2GB")
    return sum(p.numel() for p in model.parameters())


def run_child(args):
    """Run a tool in a fresh child; return (seconds, that child's own peak RSS in bytes, from wait4)."""
    start = time.perf_counter()
    child = subprocess.Popen([sys.executable, *args], cwd=REPO, env=dict(os.environ, PYTHONWARNINGS="ignore"))
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode != 0:
        raise SystemExit(f"{args[0]} failed with exit code {child.returncode}")
    return time.perf_counter() - start, usage.ru_maxrss * 1024


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-3b")
    p.add_argument("--workdir", default="/tmp/convert_memory")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    from megatron_ext.models.qwen.shape import PRESETS

    shape = PRESETS[args.model]
    hf, mcore, back = (os.path.join(args.workdir, d) for d in ("hf", "mcore", "hf_back"))
    os.makedirs(args.workdir, exist_ok=True)
    # Built in a child too, so its memory is not charged to the converters.
    build = ("import sys; sys.path.insert(0, %r); from bench.convert_memory import make_model; "
             "from megatron_ext.models.qwen.shape import PRESETS; print(make_model(PRESETS[%r], %r))"
             % (REPO, args.model, hf))
    params = int(subprocess.run([sys.executable, "-c", build], check=True, capture_output=True,
                                text=True).stdout.split()[-1])
    weights = 2 * params
    rows = {}
    rows["hf -> mcore"] = run_child(["tools/convert_hf_to_mcore.py", "--hf-path", hf, "--save", mcore,
                                     "--dtype", "bf16", "--overwrite"])
    rows["mcore -> hf"] = run_child(["tools/convert_mcore_to_hf.py", "--load", mcore, "--save", back,
                                     "--dtype", "bf16", "--max-shard-size", "2GB", "--overwrite"])
    gib = 2 ** 30
    print(f"\n{args.model}: {params:,} parameters, bf16 weights {weights / gib:.2f} GiB")
    print(f"{'step':<14}{'seconds':>10}{'peak RSS GiB':>15}{'peak / weights':>16}")
    for name, (seconds, peak) in rows.items():
        print(f"{name:<14}{seconds:>10.1f}{peak / gib:>15.2f}{peak / weights:>16.2f}")
    result = dict(model=args.model, parameters=params, weights_bytes=weights,
                  steps={name: dict(seconds=s, peak_rss_bytes=m) for name, (s, m) in rows.items()})
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
