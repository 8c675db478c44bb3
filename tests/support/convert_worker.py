"""Logits of a converted checkpoint under several meshes vs transformers (one torchrun launch, 4 CPU ranks).

``torchrun --nproc-per-node 4 tests/support/convert_worker.py OUT.json SPEC ...``, each SPEC one of:

- ``HF_DIR:MCORE_DIR``: loads the megatron-core checkpoint under TP1 (DP4), TP2, PP2, TP2 x PP2, PP2 x VPP2 and CP2
  (Qwen2-MoE: TP1, TP2, EP2, EP4, TP2+SP x EP2, PP2 x EP2, PP2, PP2 x VPP2, CP2), runs a forward pass through
  megatron-core's pipeline schedule (CP: each rank its zig-zag chunks of the sequence), gathers the logits and
  records the largest difference from transformers' model (``NAME/LAYOUT``; ``NAME@ckpt/LAYOUT`` for a checkpoint).
  MCORE_DIR ``hf=DIR`` loads DIR with the --pretrained loader, and then exports each layout with ``--save-hf``'s
  writer (in blocks of 4 KiB: TP shards and pipeline stages streamed block by block) and records whether every
  tensor came back bit for bit (``.../export``: 0, else 1). ``HF_DIR:MCORE_DIR@tp1,tp2``: those layouts only;
- ``vit:HF_DIR``: a ViT classifier, or a headless backbone (class-token features through an identity head), loaded
  by --pretrained's loader under TP2 x PP2 against transformers' ViTForImageClassification / ViTModel;
- ``memory:HF_DIR``: a Qwen2 with a wide vocabulary, loaded under TP2 x DP2 and under ZeRO-3 TP2 x DP2 (built
  partitioned), exported: the export's peak resident memory above what the rank held before it, as a fraction of
  the embedding (``.../export_peak``; the embedding is streamed, never gathered), and bit-exactness;
- ``engines:HF_DIR``: a language model loaded under TP2 x DP2 on the megatron engine with the distributed optimizer
  and on DeepSpeed ZeRO-3: two lr-0 steps' losses against transformers' and the export after them (``engines``).
"""

import ctypes
import json
import os
import sys
import types

import torch
import torch.distributed as dist

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.dirname(TESTS), TESTS]  # megatron_ext and support, run as a script

from support import thread_guard  # noqa: E402
from support.engines import build as build_engine  # noqa: E402
from support.step_checks import worst  # noqa: E402
from megatron_ext import parallel  # noqa: E402
from megatron_ext.mesh import Mesh  # noqa: E402

LAYOUTS = {"tp1": dict(), "tp2": dict(tp=2), "pp2": dict(pp=2), "tp2_pp2": dict(tp=2, pp=2),
           "pp2_vpp2": dict(pp=2, vpp=2), "cp2": dict(cp=2)}
MOE_LAYOUTS = {"tp1": dict(), "tp2": dict(tp=2, etp=2), "ep2": dict(ep=2), "ep4": dict(ep=4),
               "tp2_sp_ep2": dict(tp=2, sequence_parallel=True, ep=2),
               "pp2_ep2": dict(pp=2, ep=2), "pp2": dict(pp=2), "pp2_vpp2": dict(pp=2, vpp=2),
               "cp2": dict(cp=2)}  # expert TP 1: gloo runs the alltoall dispatcher only so
BATCH, SEQ = 2, 16  # two micro-batches of one row: the interleaved schedule needs at least PP of them


def chunk_builder(mesh: Mesh, shape):
    """The model-parallel groups of ``mesh``, and ``build(pre_process=, post_process=, vp_stage=)`` of the family."""
    from megatron_ext.models.gpt2 import model as gpt2
    from megatron_ext.models.qwen import model as qwen
    from megatron_ext.models.gpt2.shape import GPT2Shape

    parallel.init_model_parallel(mesh, seed=0)
    thread_guard.check(f"building {mesh.describe()}")
    family, build = (gpt2, gpt2.build_gpt2) if isinstance(shape, GPT2Shape) else (qwen, qwen.build_qwen)
    config = family.transformer_config(shape, mesh)
    config.batch_p2p_comm = False
    vocab = qwen.padded_vocab_size(shape.vocab_size, 128, mesh.tp)
    return lambda **kw: build(config, shape, vocab_size=vocab, **kw)


def build_chunks(mcore_dir: str, mesh: Mesh, shape):
    from megatron.core import dist_checkpointing

    from megatron_ext.engines.megatron import build_model_chunks

    chunks = build_model_chunks(chunk_builder(mesh, shape), mesh.vpp)
    if mcore_dir.startswith("hf="):  # --pretrained's loader: straight from the HF directory into the shards
        from megatron_ext.convert import pretrained

        pretrained.load(pretrained.HFWeights(mcore_dir[3:], shape, 0), chunks)
    else:
        keys = ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]
        state = dist_checkpointing.load({k: c.sharded_state_dict() for k, c in zip(keys, chunks)}, mcore_dir)
        for key, chunk in zip(keys, chunks):
            chunk.load_state_dict(state[key])
    return chunks


def megatron_logits(chunks, mesh: Mesh, shape, tokens: torch.Tensor):
    """The gathered logits on the last pipeline stage (None elsewhere); ``chunks``: the model chunks, or a
    directory (as build_chunks') to build and load them from. tools/verify_model.py's own function."""
    from megatron_ext.convert import verify

    if isinstance(chunks, str):
        chunks = build_chunks(chunks, mesh, shape)
    return verify.logits(chunks, tokens, shape.vocab_size)


def _meta(hf_dir: str, shape) -> dict:
    import dataclasses

    config = json.load(open(os.path.join(hf_dir, "config.json")))
    return dict(model_type=config["model_type"], model_shape=dataclasses.asdict(shape), hf_config=config)


def export_exact(engine, hf_dir: str, shape, out_dir: str, peak=None) -> float:
    """--save-hf's export of ``engine`` (collective; ``peak()`` after it); 0.0 when it gives back every tensor of
    ``hf_dir`` bit for bit."""
    from megatron_ext.convert import export, verify

    export.save_hf(engine, out_dir, model_meta=_meta(hf_dir, shape), dtype=torch.float32)
    if peak is not None:
        peak()
    if dist.get_rank() != 0:
        return 0.0
    return 0.0 if verify.exact_round_trip(verify.read_tensors(out_dir), verify.read_tensors(hf_dir)) is None else 1.0


def language(out_root: str, hf_dir: str, mcore_dir: str, results: dict) -> None:
    mcore_dir, _, only = mcore_dir.partition("@")
    from transformers import AutoModelForCausalLM

    from megatron_ext.convert import stream
    from megatron_ext.models import families

    stream.BLOCK_BYTES = 4096
    shape = families.from_hf_config(hf_dir, "hf")[1].shape_from_hf(hf_dir, "hf")
    tokens = torch.randint(0, shape.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()(tokens).logits
    for name, layout in (MOE_LAYOUTS if getattr(shape, "moe", None) else LAYOUTS).items():
        if only and name not in only.split(","):
            continue
        mesh = Mesh(world=dist.get_world_size(), **layout)
        chunks = build_chunks(mcore_dir, mesh, shape)
        logits = megatron_logits(chunks, mesh, shape, tokens)
        key = f"{os.path.basename(hf_dir)}{'' if mcore_dir.startswith('hf=') else '@ckpt'}/{name}"
        record(results, key, -1.0 if logits is None else (logits - expected).abs().max().item())
        if mcore_dir.startswith("hf="):
            export = os.path.join(out_root, f"{os.path.basename(hf_dir)}_{name}")
            record(results, f"{key}/export", export_exact(types.SimpleNamespace(model=chunks), hf_dir, shape, export))
        del chunks  # the next mesh is built without this one's model (and the groups it holds) alive


def record(results: dict, key: str, value: float) -> None:
    """The largest value over every rank (a NaN anywhere is infinitely wrong)."""
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    results[key] = worst(values)


def vit(hf_dir: str, results: dict) -> None:
    """A ViT classifier or backbone under TP2 x PP2, through the --pretrained loader."""
    from transformers import ViTForImageClassification, ViTModel
    from support.vit_worker import logits_under

    from megatron_ext.convert import pretrained
    from megatron_ext.models.vit import model as vit_model

    shape = vit_model.vit_shape_from_hf_config(hf_dir)
    reader = pretrained.SafetensorsReader(hf_dir)
    head = "classifier.weight" in reader.weight_map
    classes = reader.get("classifier.weight").shape[0] if head else shape.hidden_size
    pixels = torch.randn(2, 3, shape.image_size, shape.image_size, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        if head:
            expected = ViTForImageClassification.from_pretrained(hf_dir).eval()(pixel_values=pixels).logits
        else:
            model = ViTModel.from_pretrained(hf_dir, add_pooling_layer=False).eval()
            expected = model(pixel_values=pixels).last_hidden_state[:, 0]

    def load(model):
        fresh = pretrained.load(pretrained.HFWeights(hf_dir, shape, 0), [model],
                                replaceable={"head.weight", "head.bias"})
        if fresh and model.post_process:  # a backbone: its class-token features through an identity head
            with torch.no_grad():
                model.head.weight.copy_(torch.eye(shape.hidden_size))

    logits = logits_under(Mesh(world=dist.get_world_size(), tp=2, pp=2), load, shape, pixels, classes)
    record(results, f"{os.path.basename(hf_dir)}/tp2_pp2", -1.0 if logits is None else
           (logits - expected).abs().max().item())


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))


def memory(out_root: str, hf_dir: str, results: dict) -> None:
    """The export's peak above what the rank held before it, per embedding byte, under TP2 and ZeRO-3 TP2 x DP2.
    Freed blocks go back to the system at once (glibc's mmap threshold fixed, as bench/pretrained_memory.py)."""
    import gc

    from megatron_ext.convert import pretrained, stream
    from megatron_ext.models import families
    from megatron_ext.engines.deepspeed import fill_partitioned, partitioned_construction
    from megatron_ext.models.qwen import model as qwen

    ctypes.CDLL("libc.so.6").mallopt(-3, 65536)  # M_MMAP_THRESHOLD
    stream.BLOCK_BYTES = 2**20
    shape = families.from_hf_config(hf_dir, "hf")[1].shape_from_hf(hf_dir, "hf")
    embedding = shape.vocab_size * shape.hidden_size * 4
    for name in ("tp2", "zero3_tp2"):
        mesh = Mesh(world=dist.get_world_size(), tp=2)
        if name == "tp2":
            engine = types.SimpleNamespace(model=build_chunks(f"hf={hf_dir}", mesh, shape))
        else:
            parallel.init_model_parallel(mesh, seed=0)
            config = qwen.transformer_config(shape, mesh)
            with partitioned_construction(torch.float32, None):
                chunk = qwen.build_qwen(config, shape, vocab_size=qwen.padded_vocab_size(shape.vocab_size, 128, 2))
            fill_partitioned([chunk], pretrained.values(pretrained.HFWeights(hf_dir, shape, 0), [chunk])[0])
            engine = types.SimpleNamespace(megatron_chunk=chunk, model=[chunk], engine=types.SimpleNamespace(
                zero_optimization_stage=lambda: 3))
        gc.collect()
        dist.barrier()
        before = _status("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM from here
        peak = []
        exact = export_exact(engine, hf_dir, shape, os.path.join(out_root, f"wide_{name}"),
                             lambda: peak.append((_status("VmHWM") - before) / embedding))
        record(results, f"wide/{name}/export_peak", peak[0])
        record(results, f"wide/{name}/export", exact)
        del engine


def engines(out_root: str, hf_dir: str, results: dict) -> None:
    """Two lr-0 training steps of the loaded model under TP2 x DP2 on the megatron engine with the distributed
    optimizer and on DeepSpeed ZeRO-3 (built partitioned, filled one parameter at a time, as a run's
    _build_chunks does): both steps' losses against transformers' on the same global batch
    (``engine/NAME/LAYOUT``), and whether the export after the step gives every tensor back bit for bit."""
    import deepspeed
    from megatron.core import parallel_state
    from transformers import AutoModelForCausalLM

    from megatron_ext.convert import pretrained
    from megatron_ext.models import families
    from megatron_ext.data import synthetic
    from megatron_ext.engines import deepspeed as ds
    from megatron_ext.engines.megatron import build_model_chunks
    from megatron_ext.objectives.sft import forward_step

    shape = families.from_hf_config(hf_dir, "hf")[1].shape_from_hf(hf_dir, "hf")
    micro = synthetic.global_batch(1, seed=1234, global_batch_size=4, micro_batch_size=1, seq_length=SEQ,
                                   vocab_size=shape.vocab_size)
    tokens, labels = torch.cat([m["tokens"] for m in micro]), torch.cat([m["labels"] for m in micro])
    with torch.no_grad():
        logits = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()(tokens).logits
        expected = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
    cpu = torch.device("cpu")
    for name in ("distopt_tp2_dp2", "zero3_tp2_dp2"):
        mesh = Mesh(world=dist.get_world_size(), tp=2)
        if name.startswith("distopt"):
            engine = build_engine(build_chunks(f"hf={hf_dir}", mesh, shape), cpu, forward_step, mesh,
                                  distributed_optimizer=True, seq_length=SEQ, lr=0.0)
        else:
            build = chunk_builder(mesh, shape)
            # ds.partitioned_construction's config, with the batch given per rank: its train_batch_size 1 fails
            # once DeepSpeed's comm is up (memory:'s model before this one; a run builds one model per process)
            with deepspeed.zero.Init(data_parallel_group=parallel_state.get_data_parallel_group(), mpu=ds.MegatronMpu,
                                     config_dict_or_path={"train_micro_batch_size_per_gpu": 1,
                                                          "zero_optimization": {"stage": 3},
                                                          "bf16": {"enabled": False}, "fp16": {"enabled": False}}):
                chunks = build_model_chunks(build, None)
            ds.fill_partitioned(chunks, pretrained.values(pretrained.HFWeights(hf_dir, shape, 0), chunks)[0])
            engine = build_engine(chunks, cpu, forward_step, mesh, engine="deepspeed", zero_stage=3,
                                  global_batch_size=len(micro), lr=0.0)
        mine = synthetic.data_parallel_slice(micro, parallel_state.get_data_parallel_rank(),
                                             parallel_state.get_data_parallel_world_size())
        losses = [engine.forward_backward(mine)]
        engine.optimizer_step()
        losses.append(engine.forward_backward(mine, forward_only=True))
        key = f"engine/{os.path.basename(hf_dir)}/{name}"
        record(results, key, worst(abs(loss - expected.item()) for loss in losses))
        export = os.path.join(out_root, f"engine_{os.path.basename(hf_dir)}_{name}")
        record(results, f"{key}/export", export_exact(engine, hf_dir, shape, export))
        del engine


def main(out_path, specs):
    parallel.init_distributed("gloo")
    results = {}
    out_root = os.path.dirname(os.path.abspath(out_path))
    for spec in specs:
        kind, _, rest = spec.partition(":")
        if kind == "vit":
            vit(rest, results)
        elif kind == "memory":
            memory(out_root, rest, results)
        elif kind == "engines":
            engines(out_root, rest, results)
        else:
            language(out_root, kind, rest, results)
        thread_guard.check(spec)
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)
    parallel.teardown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
