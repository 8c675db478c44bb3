"""Logits of a converted checkpoint under several meshes vs transformers (one torchrun launch, 4 CPU ranks).

``torchrun --nproc-per-node 4 tests/convert_worker.py OUT.json HF_DIR:MCORE_DIR ...`` loads each megatron-core
checkpoint under TP1 (DP4), TP2, PP2, TP2 x PP2 and PP2 x VPP2 (Qwen2-MoE: EP2, EP4, TP2+SP x EP2, PP2 x EP2), runs
a forward pass through megatron-core's pipeline schedule, gathers the vocab-parallel logits and records the largest
difference from transformers' Qwen2ForCausalLM / Qwen2MoeForCausalLM / GPT2LMHeadModel.
"""

import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_ext import parallel  # noqa: E402
from megatron_ext.mesh import Mesh  # noqa: E402

LAYOUTS = {"tp1": dict(), "tp2": dict(tp=2), "pp2": dict(pp=2), "tp2_pp2": dict(tp=2, pp=2),
           "pp2_vpp2": dict(pp=2, vpp=2)}
MOE_LAYOUTS = {"ep2": dict(ep=2), "ep4": dict(ep=4), "tp2_sp_ep2": dict(tp=2, sequence_parallel=True, ep=2),
               "pp2_ep2": dict(pp=2, ep=2)}  # expert TP 1: gloo runs the alltoall dispatcher only so
BATCH, SEQ = 2, 16  # two micro-batches of one row: the interleaved schedule needs at least PP of them


def megatron_logits(mcore_dir: str, mesh: Mesh, shape, tokens: torch.Tensor):
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_ext.engines.megatron import build_model_chunks
    from megatron_ext.models import gpt2, qwen
    from megatron_ext.models.shapes import GPT2Shape
    from megatron_ext.models.sharding import all_gather_tp

    parallel.init_model_parallel(mesh, seed=0)
    family, build = (gpt2, gpt2.build_gpt2) if isinstance(shape, GPT2Shape) else (qwen, qwen.build_qwen)
    config = family.transformer_config(shape, mesh)
    config.batch_p2p_comm = False
    vocab = qwen.padded_vocab_size(shape.vocab_size, 128, mesh.tp)
    chunks = build_model_chunks(lambda **kw: build(config, shape, vocab_size=vocab, **kw), mesh.vpp)
    if mcore_dir.startswith("hf="):  # --pretrained's loader: straight from the HF directory into the shards
        from megatron_ext.convert import pretrained

        pretrained.load(pretrained.HFWeights(mcore_dir[3:], shape, 0), chunks)
    else:
        keys = ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]
        state = dist_checkpointing.load({k: c.sharded_state_dict() for k, c in zip(keys, chunks)}, mcore_dir)
        for key, chunk in zip(keys, chunks):
            chunk.load_state_dict(state[key])
    for chunk in chunks:
        chunk.eval()

    def forward_step(data_iterator, model):
        row = next(data_iterator)
        output = model(row, torch.arange(SEQ)[None], attention_mask=None)
        return output, lambda out: (out.sum() * 0, {"logits": torch.cat(all_gather_tp(out.detach()), dim=-1)})

    iterators = [iter(tokens.split(1)) for _ in chunks]
    with torch.no_grad():
        out = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iterators if len(chunks) > 1 else iterators[0],
            model=chunks, num_microbatches=BATCH, seq_length=SEQ, micro_batch_size=1, forward_only=True)
    if not parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        return None
    return torch.cat([o["logits"] for o in out])[..., :shape.vocab_size]


def main(out_path, pairs):
    from transformers import AutoModelForCausalLM

    from megatron_ext.convert import families

    parallel.init_distributed("gloo")
    results = {}
    for pair in pairs:
        hf_dir, mcore_dir = pair.split(":")  # MCORE_DIR "hf=DIR": load DIR with the --pretrained loader
        shape = families.from_hf_config(hf_dir, "hf")[1].shape_from_hf(hf_dir, "hf")
        tokens = torch.randint(0, shape.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            expected = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()(tokens).logits
        for name, layout in (MOE_LAYOUTS if getattr(shape, "moe", None) else LAYOUTS).items():
            logits = megatron_logits(mcore_dir, Mesh(world=dist.get_world_size(), **layout), shape, tokens)
            diff = -1.0 if logits is None else (logits - expected).abs().max().item()
            diffs = [None] * dist.get_world_size()
            dist.all_gather_object(diffs, diff)
            results[f"{os.path.basename(hf_dir)}/{name}"] = max(diffs)
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
