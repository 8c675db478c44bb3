"""Parity worker: the same tiny Qwen step under several meshes, compared with one process (fp32).

``python tests/parity_worker.py reference OUT_DIR FAMILY...`` runs each family's single-process reference in one
process (``OUT_DIR/<family>.pt``): initial weights, loss and every gradient of step 1, and the losses/grad norms of
three optimizer steps.
``torchrun --nproc-per-node N tests/parity_worker.py compare REF_DIR OUT.json LAYOUT...`` runs each layout in turn
(process groups are rebuilt between them, so one launch pays megatron's import once), loads the reference weights
into the shards, gathers every sharded gradient back to full shape and writes raw differences; the pytest side
owns the tolerances.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import thread_guard  # noqa: E402
from step_checks import worst  # noqa: E402
from megatron_ext import parallel  # noqa: E402
from megatron_ext.mesh import Mesh  # noqa: E402
from megatron_ext.models.moe_flags import MoESettings  # noqa: E402
from megatron_ext.models.shapes import GPT2_PRESETS, PRESETS  # noqa: E402

SEED, STEPS, GLOBAL_BATCH, MICRO_BATCH, SEQ = 1234, 3, 8, 2, 32
SHAPE = PRESETS["tiny"]  # 4 heads / 2 KV groups (GQA), QKV bias, tied embeddings, 4 layers
GPT2_SHAPE = GPT2_PRESETS["tiny"]  # 4 heads, 4 layers, 2048-token vocabulary, 512 learned positions
MOE_SHAPE = PRESETS["tiny-moe"]  # the same with 4 experts (top-2) and a gated shared expert in every layer
QWEN3_SHAPES = {"qwen3": PRESETS["tiny-qwen3"],  # query/key norms, no QKV bias, head dimension 32 (2 x hidden/heads)
                "qwen3moe": PRESETS["tiny-qwen3-moe"]}  # and 4 experts (top-2, renormalised), no shared expert
SETTINGS = dict(lr=2e-3, clip_grad=0.5, decay_iters=STEPS, decay_style="constant",  # clipping bites (norm ~1.4)
                weight_decay=0.1)  # (and weight decay, on every engine only where megatron-core applies it)

LAYOUTS = {
    "dp2": dict(world=2),
    "tp2": dict(world=2, tp=2),
    "tp2_sp": dict(world=2, tp=2, sequence_parallel=True),
    "pp2": dict(world=2, pp=2),
    "pp2_vpp2": dict(world=2, pp=2, vpp=2),
    "dp2_distopt": dict(world=2),
    "tp2_pp2": dict(world=4, tp=2, pp=2),
    "dp2_tp2_sp": dict(world=4, tp=2, sequence_parallel=True),
    # The ViT family (tiny ViT, 17 tokens, 10 classes) through the same engine: its own reference run.
    "vit_dp2": dict(world=2),
    "vit_tp2": dict(world=2, tp=2),
    "vit_pp2": dict(world=2, pp=2),
    # LoRA on every linear of the tiny ViT (frozen base, adapters + head train), its own reference run, under TP2 with
    # full activation checkpointing (LoRA over DP: the Qwen layouts); "wrong": row-parallel adapters without their TP
    # all-reduce, which must fail.
    "vit_lora_tp2_recompute": dict(world=2, tp=2),
    "vit_lora_tp2_wrong": dict(world=2, tp=2),
    # The same adapters on the tiny Qwen (SwiGLU's fused fc1) under TP2 + SP (the sequence gathers and scatters), PP2 x
    # VPP2, CP2 and DP2 with the distributed optimizer (which holds the adapters' state only).
    "qwen_lora_tp2_sp": dict(world=2, tp=2, sequence_parallel=True),
    "qwen_lora_pp2_vpp2": dict(world=2, pp=2, vpp=2),
    "qwen_lora_cp2": dict(world=2, cp=2),
    "qwen_lora_dp2_distopt": dict(world=2),
    # ... under FSDP2 x TP2 (the base frozen inside each layer's shard group); "wrong": FSDP's norm
    # without the TP shards of the adapters (every one of them is split over TP), which clipping must show.
    "qwen_lora_fsdp2_tp2": dict(world=4, tp=2),
    "qwen_lora_fsdp2_tp2_wrong": dict(world=4, tp=2),
    # Qwen3: the query/key norms' gradients are partial sums over TP (each rank its heads): summed by megatron-core
    # by name, by our DeepSpeed and FSDP engines by tag. "wrong": TP2 with megatron-core's rule off, which must fail.
    # Dense Qwen3 also under PP2 x VPP2 x DP2 with the distributed optimizer (qwen3_8b_4d_8gpu.sh's kinds of mesh).
    # Qwen3-MoE (no shared expert) with Qwen's load-balancing loss over every layer's routing (--moe-aux-loss-scope
    # model: models/moe_aux.py) under TP2+SP x expert TP2 x EP2 (the allgather dispatcher: alltoall's uneven
    # all-gather over expert TP needs NCCL) and CP2 x EP2 x DP2 with the distributed optimizer.
    "qwen3_tp2": dict(world=2, tp=2),
    "qwen3_pp2_vpp2_dp2_distopt": dict(world=4, pp=2, vpp=2),
    "qwen3_tp2_wrong": dict(world=2, tp=2),
    "qwen3_fsdp2_tp2": dict(world=4, tp=2),
    "qwen3_fsdp2_tp2_wrong": dict(world=4, tp=2),  # FSDP without its TP sum of those gradients
    "qwen3moe_tp2_sp_etp2_ep2_allgather": dict(world=4, tp=2, etp=2, ep=2, sequence_parallel=True),
    "qwen3moe_cp2_ep2_distopt": dict(world=4, cp=2, ep=2),
    # Context parallelism (K/V all-gathered over CP, the sequence in 2*CP zig-zag chunks). "packed": rows of
    # documents padded to multiples of 2*CP, against its own packed reference run; "topleft_wrong": SDPA's top-left
    # aligned causal mask (is_causal) for the query blocks shorter than their keys, which must fail.
    "cp2": dict(world=2, cp=2),
    "cp2_packed": dict(world=2, cp=2),
    "cp2_topleft_wrong": dict(world=2, cp=2),
    "cp2_tp2_sp": dict(world=4, tp=2, cp=2, sequence_parallel=True),
    "cp2_pp2": dict(world=4, pp=2, cp=2),
    # Expert parallelism on the tiny Qwen2-MoE (4 experts, top-2, gated shared expert, load-balancing and z-loss on),
    # its own reference run (alltoall, SequentialMLP). Every layout runs grouped experts (torch._grouped_mm) but
    # "sequential". "allgather": that dispatcher (with expert TP: the layouts below); "wrong": expert gradients all-reduced over the dense data-parallel
    # group instead of the expert-data-parallel one, which must fail. TP2+SP x EP2 with expert TP 1: inside the
    # 8-rank 5D layout, DP2 x PP2 x TP2+SP x EP2 (EP folded over DP x TP), and the MoE LoRA layout.
    "moe_ep2": dict(world=2, ep=2),
    "moe_ep2_sequential": dict(world=2, ep=2),
    "moe_dp2_ep2_distopt": dict(world=4, ep=2),
    "moe_dp2_ep2_wrong": dict(world=4, ep=2),
    "moe_tp2_sp_etp2_ep2_allgather": dict(world=4, tp=2, etp=2, ep=2, sequence_parallel=True),
    "moe_pp2_ep2": dict(world=4, pp=2, ep=2),
    "moe_cp2_ep2": dict(world=4, cp=2, ep=2),  # routing statistics and the aux-loss scale over TP x CP
    "moe_dp2_pp2_tp2_sp_ep2_distopt": dict(world=8, tp=2, pp=2, ep=2, sequence_parallel=True),
    # LoRA on every linear of the MoE model: attention, shared expert, and each routed expert (grouped adapters,
    # one grouped GEMM per factor; the reference: LoRALinear on each SequentialMLP expert), router frozen; under
    # TP2+SP x EP2 and with expert TP2. "wrong": the experts' fc2 adapters without the all-reduce of A's output over
    # expert TP (each rank's A sees only its part of the FFN), which must fail.
    "moe_lora_tp2_sp_ep2": dict(world=4, tp=2, ep=2, sequence_parallel=True),
    "moe_lora_tp2_sp_etp2_ep2_allgather": dict(world=4, tp=2, etp=2, ep=2, sequence_parallel=True),
    "moe_lora_tp2_sp_etp2_ep2_allgather_wrong": dict(world=4, tp=2, etp=2, ep=2, sequence_parallel=True),
    # GPT-2 (tiny: LayerNorm, tanh GELU, learned positions, biases, tied embedding): DDP, TP + SP with the
    # vocab-parallel loss (loss parallelism), PP, 2D DP x TP. "wrong": PP2 without the tied embedding's gradient all-reduce
    # between the first and last stage, which must fail.
    "gpt2_dp2": dict(world=2),
    "gpt2_tp2_sp": dict(world=2, tp=2, sequence_parallel=True),
    "gpt2_pp2": dict(world=2, pp=2),
    "gpt2_pp2_wrong": dict(world=2, pp=2),
    "gpt2_dp2_tp2_distopt": dict(world=4, tp=2),
    # torch FSDP2 (--engine fsdp) over DP, and 2D over DP x TP; "wrong": TP-split parameters counted in the grad norm
    # on TP rank 0 only (as if replicated), which must fail.
    "gpt2_fsdp2": dict(world=2),
    "gpt2_fsdp2_tp2": dict(world=4, tp=2),
    "gpt2_fsdp2_tp2_wrong": dict(world=4, tp=2),
    # DPO (training/dpo.py) on the tiny Qwen: pairs of rows [chosen; rejected] in one micro-batch, the sigmoid loss
    # against fixed reference log-probabilities, under PP2 x VPP2, CP2 (each row's log-probability summed over the
    # CP ranks), DP2 with the distributed optimizer and FSDP2 (TP2+SP: the MoE and LoRA layouts below).
    # "wrong": CP2 without that sum (each rank's loss from its half of every row), which must fail.
    "dpo_pp2_vpp2": dict(world=2, pp=2, vpp=2),
    "dpo_cp2": dict(world=2, cp=2),
    "dpo_cp2_wrong": dict(world=2, cp=2),
    "dpo_dp2_distopt": dict(world=2),
    "dpo_fsdp2": dict(world=2),
    # ... on the tiny Qwen2-MoE under TP2+SP x EP2 (grouped experts), and with LoRA adapters under TP2+SP.
    "dpomoe_tp2_sp_ep2": dict(world=4, tp=2, ep=2, sequence_parallel=True),
    "dpolora_tp2_sp": dict(world=2, tp=2, sequence_parallel=True),
    # The comparison itself: DP2 whose model output turns NaN at the last step, after steps that match (where
    # Python's max() would drop the NaN), which must fail every check that reads that step.
    "dp2_nan_wrong": dict(world=2),
}
NAN_AT_STEP = STEPS - 1  # dp2_nan_wrong, 0-based
LORA = dict(rank=4, alpha=8.0, targets=("qkv", "proj", "fc1", "fc2"))
NUM_CLASSES = 10


def family(layout: str) -> str:
    """Which reference run a layout is compared with: qwen, qwen_packed, vit, qwen_lora, vit_lora, moe, moe_lora,
    gpt2, qwen3, qwen3moe, dpo, dpomoe or dpolora."""
    if layout.startswith("moe_lora"):
        return "moe_lora"
    if layout.startswith(("moe", "gpt2", "qwen3", "dpo")):
        return layout.split("_")[0]
    kind = "vit" if layout.startswith("vit") else "qwen"
    if layout.endswith("packed"):
        return "qwen_packed"
    return f"{kind}_lora" if layout.startswith(f"{kind}_lora") else kind


def global_batch(step: int, family: str = "qwen"):
    """Micro-batches of one global batch; loss masks vary so the per-token normalisation is exercised."""
    g = torch.Generator().manual_seed(SEED + step)
    if family.startswith("vit"):
        from megatron_ext.models.vit import VIT_PRESETS

        size = VIT_PRESETS["tiny"].image_size
        pixels = torch.randn(GLOBAL_BATCH, 3, size, size, generator=g)
        labels = torch.randint(0, NUM_CLASSES, (GLOBAL_BATCH,), generator=g)
        keep = (torch.rand(GLOBAL_BATCH, generator=g) < 0.8).float()  # some images left out of the loss
        return [dict(pixels=pixels[i:i + MICRO_BATCH], labels=labels[i:i + MICRO_BATCH],
                     loss_mask=keep[i:i + MICRO_BATCH]) for i in range(0, GLOBAL_BATCH, MICRO_BATCH)]
    if family.startswith("dpo"):
        return dpo_batches(g)
    vocab = GPT2_SHAPE.vocab_size if family == "gpt2" else SHAPE.vocab_size
    tokens = torch.randint(0, vocab, (GLOBAL_BATCH, SEQ + 1), generator=g)
    loss_mask = (torch.rand(GLOBAL_BATCH, SEQ, generator=g) < 0.7).float()
    batches = [dict(tokens=tokens[i:i + MICRO_BATCH, :-1], labels=tokens[i:i + MICRO_BATCH, 1:],
                    loss_mask=loss_mask[i:i + MICRO_BATCH], position_ids=torch.arange(SEQ).expand(MICRO_BATCH, SEQ))
               for i in range(0, GLOBAL_BATCH, MICRO_BATCH)]
    if family in ("moe", "moe_lora", "qwen3moe"):  # row tails of padding (outside the loss, never routed): every
        # stage and slice gets its part
        for batch in batches:
            tails = torch.randint(0, SEQ // 2, (MICRO_BATCH, 1), generator=g)
            batch["padding_mask"] = torch.arange(SEQ).expand(MICRO_BATCH, SEQ) >= SEQ - tails
            batch["loss_mask"] = batch["loss_mask"] * ~batch["padding_mask"]
    if family == "qwen_packed":  # documents cut at random multiples of 4 (2 x CP2) inside every row
        for batch in batches:
            cuts = [[0, *(c for c in range(4, SEQ, 4) if torch.rand(1, generator=g) < 0.35), SEQ]
                    for _ in range(MICRO_BATCH)]
            batch["position_ids"] = torch.stack([torch.cat([torch.arange(b - a) for a, b in zip(row, row[1:])])
                                                 for row in cuts])
            batch["cu_seqlens"] = torch.tensor([0] + [i * SEQ + c for i, row in enumerate(cuts) for c in row[1:]],
                                               dtype=torch.int32)
    return batches


def dpo_batches(g: torch.Generator):
    """GLOBAL_BATCH / 2 pairs as MICRO_BATCH-row micro-batches (rows: the pairs' chosen, then their rejected), each
    completion a random span after a prompt, padding after it; reference log-probabilities near the model's."""
    pairs = MICRO_BATCH // 2
    batches = []
    for _ in range(GLOBAL_BATCH // MICRO_BATCH):
        tokens = torch.randint(0, SHAPE.vocab_size, (MICRO_BATCH, SEQ + 1), generator=g)
        start = torch.randint(4, SEQ // 2, (MICRO_BATCH, 1), generator=g)
        end = torch.randint(SEQ // 2 + 2, SEQ + 1, (MICRO_BATCH, 1), generator=g)
        at = torch.arange(SEQ).expand(MICRO_BATCH, SEQ)
        batches.append(dict(tokens=tokens[:, :-1], labels=tokens[:, 1:], position_ids=at,
                            completion_mask=((at >= start) & (at < end)).float(), padding_mask=at >= end,
                            loss_mask=torch.ones(pairs), index=torch.arange(pairs),
                            reference=-(end - start).float().view(2, pairs).t() * 6.0
                            + torch.randn(pairs, 2, generator=g)))
    return batches


def add_lora(chunks, randomize_b: bool, wrong: bool, rank: int = LORA["rank"]) -> None:
    """LoRA adapters; the reference draws B at random (it starts at zero, which would leave A without gradient)."""
    import torch.nn.functional as F

    from megatron_ext.models import lora
    from megatron_ext.models.sharding import global_named_parameters

    lora.apply(chunks, lora.LoRAConfig(**dict(LORA, rank=rank)), SEED)
    for chunk in chunks:
        for global_name, _, param in global_named_parameters(chunk):
            if randomize_b and "lora_b" in global_name:
                param.data.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(len(global_name)))
        for module in chunk.modules():
            if wrong and isinstance(module, lora.LoRALinear) and not module.column:
                module.lora_a.forward = lambda x, m=module.lora_a: (F.linear(x, m.weight), None)


def reduce_experts_over_dense_dp(engine) -> None:
    """The deliberate MoE bug: expert gradients all-reduced over the dense DP group, mixing different experts."""
    from megatron.core import parallel_state

    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    for model in engine.model:
        for bucket_group in model.expert_parallel_bucket_groups:
            bucket_group.data_parallel_group = bucket_group.intra_distributed_optimizer_instance_group = group


def build_engine(mesh: Mesh, device, distributed_optimizer: bool, full_state=None, family: str = "qwen",
                 recompute: bool = False, wrong: bool = False, layout: str = ""):
    from megatron_ext.engines.megatron import MegatronEngine, OptimizerSettings, build_model_chunks
    from megatron_ext.models import qwen, vit
    from megatron_ext.models.sharding import load_full_state

    parallel.init_model_parallel(mesh, seed=SEED)
    if family.startswith("vit"):
        shape = vit.VIT_PRESETS["tiny"]
        config = vit.transformer_config(shape, mesh, recompute_granularity="full" if recompute else None)
        chunks = build_model_chunks(lambda **kw: vit.ViTClassifier(config, shape, NUM_CLASSES, **kw), mesh.vpp)
        if family == "vit_lora":
            add_lora(chunks, randomize_b=full_state is None, wrong=wrong)
        if full_state is not None:
            load_full_state(chunks, full_state)
        return MegatronEngine(chunks, device=device, settings=OptimizerSettings(**SETTINGS),
                              use_distributed_optimizer=distributed_optimizer, micro_batch_size=MICRO_BATCH,
                              seq_length=shape.seq_length, step_func=vit.forward_step)
    if family == "gpt2":
        return build_gpt2_engine(mesh, device, distributed_optimizer, full_state, "fsdp" in layout, wrong)
    # MoE: the reference runs SequentialMLP, the layouts grouped experts (torch._grouped_mm), except "sequential".
    grouped = full_state is not None and not layout.endswith("sequential")
    shape, moe = QWEN3_SHAPES.get(family, SHAPE), None
    if family in ("moe", "moe_lora", "dpomoe"):
        shape, moe = MOE_SHAPE, MoESettings(aux_loss_coeff=1e-2, z_loss_coeff=1e-3, grouped_gemm=grouped,
                                            dispatcher="allgather" if "allgather" in layout else "alltoall")
    elif family == "qwen3moe":  # Qwen's load-balancing loss (models/moe_aux.py)
        moe = MoESettings(aux_loss_coeff=1e-2, aux_loss_scope="model", grouped_gemm=grouped,
                          dispatcher="allgather" if layout.endswith("allgather") else "alltoall")
    config = qwen.transformer_config(shape, mesh, moe_settings=moe)
    vocab = qwen.padded_vocab_size(shape.vocab_size, 128, mesh.tp)
    chunks = build_model_chunks(lambda **kw: qwen.build_qwen(config, shape, vocab_size=vocab, **kw), mesh.vpp)
    if family in ("qwen_lora", "moe_lora", "dpolora"):
        add_lora(chunks, randomize_b=full_state is None, wrong=wrong and family == "qwen_lora" and "fsdp" not in layout,
                 rank=8 if family == "moe_lora" else LORA["rank"])  # (grouped GEMMs: 16-byte rows at expert TP2)
        from megatron.core.tensor_parallel import mappings

        from megatron_ext.models import lora_experts  # set for every layout: the planted bug is this layout's only
        lora_experts.reduce_from_tensor_model_parallel_region = (lambda a, group: a) if wrong else \
            mappings.reduce_from_tensor_model_parallel_region
    if full_state is not None:
        load_full_state(chunks, full_state)
    step_func = None
    if family.startswith("dpo"):
        from megatron.core.tensor_parallel import mappings

        from megatron_ext.training import dpo
        from megatron_ext.training.dpo_flags import DPOSettings

        step_func = dpo.DPOStep(DPOSettings(beta=0.5))
        dpo.reduce_from_tensor_model_parallel_region = (lambda t, group: t) if wrong else \
            mappings.reduce_from_tensor_model_parallel_region
    if "fsdp" in layout:
        from megatron_ext.engines.fsdp import FSDPEngine

        engine = FSDPEngine(chunks, device=device, settings=OptimizerSettings(**SETTINGS), step_func=step_func)
        if wrong and family == "qwen_lora":  # the adapters' norms counted on TP rank 0 only
            engine._tp_split = set()
        elif wrong:  # the query/key norms' gradients not summed over TP
            engine._tp_partial = set()
        return engine
    engine = MegatronEngine(chunks, device=device, settings=OptimizerSettings(**SETTINGS),
                            use_distributed_optimizer=distributed_optimizer, micro_batch_size=MICRO_BATCH,
                            seq_length=SEQ, step_func=step_func)
    if family == "moe" and wrong:
        reduce_experts_over_dense_dp(engine)
    if family == "qwen3" and wrong:  # megatron-core's finalize_model_grads no longer sums the q/k norms over TP
        engine.config.qk_layernorm = False
    return engine


def build_gpt2_engine(mesh: Mesh, device, distributed_optimizer: bool, full_state, fsdp=False, wrong=False):
    from megatron_ext.engines.megatron import MegatronEngine, OptimizerSettings, build_model_chunks
    from megatron_ext.models import gpt2, qwen
    from megatron_ext.models.sharding import load_full_state

    config = gpt2.transformer_config(GPT2_SHAPE, mesh)
    vocab = qwen.padded_vocab_size(GPT2_SHAPE.vocab_size, 128, mesh.tp)
    chunks = build_model_chunks(lambda **kw: gpt2.build_gpt2(config, GPT2_SHAPE, vocab_size=vocab, **kw), mesh.vpp)
    if full_state is not None:
        load_full_state(chunks, full_state)
    if fsdp:
        from megatron_ext.engines.fsdp import FSDPEngine

        engine = FSDPEngine(chunks, device=device, settings=OptimizerSettings(**SETTINGS))
        if wrong:
            engine._tp_split = set()
        return engine
    return MegatronEngine(chunks, device=device, settings=OptimizerSettings(**SETTINGS),
                          use_distributed_optimizer=distributed_optimizer, micro_batch_size=MICRO_BATCH, seq_length=SEQ)


def my_microbatches(step: int, mesh: Mesh, kind: str = "qwen"):
    from megatron.core import parallel_state
    from megatron_ext.data.synthetic import data_parallel_slice

    return data_parallel_slice(global_batch(step, kind), parallel_state.get_data_parallel_rank(), mesh.dp)


def full_grads(engine, distributed_optimizer: bool):
    """{global name: full gradient} as this rank sees it (TP shards gathered)."""
    from megatron.core import parallel_state
    from megatron_ext.models.sharding import all_gather_tp, gather_full, global_named_parameters

    if distributed_optimizer:  # reduce-scatter left only this rank's shard valid: gather the rest
        for model in engine.model:
            for buffer in model.buffers + model.expert_parallel_buffers:
                # Expert gradients are sharded over the expert-data-parallel group, the rest over DP (x CP).
                group = (parallel_state.get_expert_data_parallel_group() if buffer in model.expert_parallel_buffers
                         else parallel_state.get_data_parallel_group(with_context_parallel=True))
                for bucket in buffer.buckets:
                    shards = list(bucket.grad_data.chunk(dist.get_world_size(group)))
                    local = shards[dist.get_rank(group)].clone()
                    dist.all_gather(shards, local, group=group)
    grads, wrong = {}, {}
    if hasattr(engine, "layout"):  # FSDP: DTensor gradients, gathered over DP, then over TP as before sharding
        for name, param in engine.module.named_parameters():
            if param.grad is None:  # LoRA's frozen base
                continue
            global_name, before = engine.layout[name]
            grads[global_name] = gather_full(param.grad.full_tensor(), name, before, engine.module)
        return grads, wrong
    for model in engine.model:
        for global_name, name, param in global_named_parameters(model):
            if not param.requires_grad:
                continue
            grads[global_name] = gather_full(param.main_grad, name, param, model)
            if ("linear_fc1" in name and parallel_state.get_tensor_model_parallel_world_size() > 1
                    and engine.config.gated_linear_unit and getattr(param, "allreduce", True)):  # not experts
                # A deliberately wrong layout (plain concatenation of SwiGLU shards) for the negative check.
                wrong[global_name] = torch.cat(all_gather_tp(param.main_grad), dim=0)
    return grads, wrong


def rel_diff(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).abs().max() / expected.abs().max().clamp(min=1e-30)).item()


def step_diffs(ours, ref) -> list:
    """Relative differences step by step; a missing or extra step is infinitely wrong."""
    if len(ours) != len(ref):
        return [math.inf]
    return [math.inf if a is None else abs(a - r) / abs(r) for a, r in zip(ours, ref)]


def run_reference(out_dir: str, kinds):
    device = parallel.init_distributed("gloo")
    for kind in kinds:
        reference(os.path.join(out_dir, f"{kind}.pt"), kind, device)


def reference(out_path: str, kind: str, device):
    engine = build_engine(Mesh(world=1), device, distributed_optimizer=False, family=kind)
    from megatron_ext.models.sharding import global_named_parameters, plain_name

    # by plain names: a LoRA layout's grouped experts hold their base weights as weight1/weight2, no LoRALinear
    state = {plain_name(g): p.detach().clone() for m in engine.model for g, _, p in global_named_parameters(m)}
    losses, norms, grads = [], [], None
    for step in range(STEPS):
        losses.append(engine.forward_backward(global_batch(step, kind)))
        if step == 0:
            grads = {g: p.main_grad.detach().clone() for m in engine.model for g, _, p in global_named_parameters(m)
                     if p.requires_grad}
        norms.append(engine.optimizer_step()["grad_norm"])
    torch.save(dict(state=state, grads=grads, losses=losses, grad_norms=norms), out_path)


@contextlib.contextmanager
def count_host_reads(calls: list):
    """Append the name of every tensor-to-host read (item, tolist, bool, ...) made inside the block to ``calls``,
    except megatron-core's RNG tracker comparing host RNG states (host tensors on a GPU too)."""
    originals = {m: getattr(torch.Tensor, m) for m in ("item", "tolist", "__float__", "__int__", "__bool__", "cpu",
                                                       "numpy")}

    def counting(name):
        def read(self, *args, **kwargs):
            if not sys._getframe(1).f_code.co_filename.endswith(os.path.join("tensor_parallel", "random.py")):
                calls.append(name)
            return originals[name](self, *args, **kwargs)
        return read

    for method in originals:
        setattr(torch.Tensor, method, counting(method))
    try:
        yield
    finally:
        for method, original in originals.items():
            setattr(torch.Tensor, method, original)


def run_layout(name: str, ref, device) -> dict:
    from megatron_ext.models.sharding import gather_full, global_named_parameters, plain_name

    spec = dict(LAYOUTS[name])
    distopt = name.endswith("distopt")
    mesh = Mesh(**spec)
    assert mesh.world == dist.get_world_size(), f"{name} needs world {mesh.world}"
    kind = family(name)
    engine = build_engine(mesh, device, distopt, full_state=ref["state"], family=kind,
                          recompute=name.endswith("recompute"), wrong=name.endswith("wrong"), layout=name)
    from megatron_ext.models import context_parallel

    from megatron.core.distributed import finalize_model_grads as finalize

    causal_mask = context_parallel.causal_mask
    if name == "cp2_topleft_wrong":  # SDPA's is_causal semantics: queries aligned with the *first* keys
        context_parallel.causal_mask = lambda q, k, device: torch.ones(q, k, dtype=torch.bool, device=device).tril()
    finalizer = sys.modules[finalize.__module__]
    tied_sync = finalizer._allreduce_word_embedding_grads
    if name == "gpt2_pp2_wrong":  # the last stage's copy of the tied embedding never hears the first stage's grads
        finalizer._allreduce_word_embedding_grads = lambda *args, **kwargs: None
    step_now = [0]
    if name == "dp2_nan_wrong":
        for chunk in engine.model:
            chunk.register_forward_hook(lambda m, i, out: out * math.nan if step_now[0] == NAN_AT_STEP else out)
    losses, norms, grad_diffs, wrong_diffs, host_reads = [], [], {}, {}, []
    for step in range(STEPS):
        step_now[0] = step
        microbatches = my_microbatches(step, mesh, kind)
        with count_host_reads(host_reads if step == 0 else []):
            losses.append(engine.forward_backward(microbatches))
        if step == 0:
            grads, wrong = full_grads(engine, distopt)
            grad_diffs = {g: rel_diff(t, ref["grads"][g]) for g, t in grads.items()}
            wrong_diffs = {g: rel_diff(t, ref["grads"][g]) for g, t in wrong.items()}
        norms.append(engine.optimizer_step()["grad_norm"])
    context_parallel.causal_mask, finalizer._allreduce_word_embedding_grads = causal_mask, tied_sync
    if hasattr(engine, "layout"):  # FSDP: DTensors gathered over DP, TP attributes from the layout
        frozen = worst([rel_diff(gather_full(p.full_tensor(), n, engine.layout[n][1], engine.module),
                                 ref["state"][plain_name(engine.layout[n][0])])
                        for n, p in engine.module.named_parameters() if not p.requires_grad] or [0.0])
    else:
        frozen = worst([rel_diff(gather_full(p.detach(), n, p, m), ref["state"][plain_name(g)]) for m in engine.model
                        for g, n, p in global_named_parameters(m) if not p.requires_grad] or [0.0])
    # Collect every rank's view: losses live on the last stage, parameters are spread over stages.
    views = [None] * dist.get_world_size()
    dist.all_gather_object(views, dict(losses=losses, norms=norms, grads=grad_diffs, wrong=wrong_diffs, frozen=frozen,
                                       host_reads=host_reads))
    # Every aggregate counts a NaN as infinitely wrong and a missing step as a failure, on any rank.
    loss_diffs = [d for v in views if v["losses"][0] is not None for d in step_diffs(v["losses"], ref["losses"])]
    merged_grads: dict = {}
    for v in views:
        for g, d in v["grads"].items():
            merged_grads[g] = worst([d, merged_grads.get(g, 0.0)])
    wrong = [d for v in views for d in v["wrong"].values()]
    return dict(
        mesh=mesh.describe(),
        loss_rel_diff=worst(loss_diffs),
        losses=next(v["losses"] for v in views if v["losses"][0] is not None),
        ref_losses=ref["losses"],
        grad_norm_rel_diff=worst(d for v in views for d in step_diffs(v["norms"], ref["grad_norms"])),
        grad_rel_diff=worst(merged_grads.values()),
        worst_param=max(merged_grads, key=merged_grads.get),
        params_compared=sorted(merged_grads),
        params_expected=sorted(ref["grads"]),
        wrong_layout_rel_diff=min(wrong) if wrong else None,
        frozen_rel_change=worst(v["frozen"] for v in views),
        batch_p2p_comm=engine.config.batch_p2p_comm,
        host_reads=[v["host_reads"] for v in views],
        experts=sorted({type(m.experts).__name__ for c in engine.model for m in c.modules() if hasattr(m, "experts")}),
    )


def run_compare(ref_dir: str, out_path: str, names):
    """Each layout against its family's reference run, ``REF_DIR/<family>.pt``."""
    device = parallel.init_distributed("gloo")
    refs = {kind: torch.load(os.path.join(ref_dir, f"{kind}.pt")) for kind in {family(n) for n in names}}
    results = {}
    for name in names:
        start = time.perf_counter()
        results[name] = dict(run_layout(name, refs[family(name)], device), seconds=time.perf_counter() - start,
                             threads=thread_guard.check(name))
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)
    parallel.teardown()


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "reference":
        run_reference(sys.argv[2], sys.argv[3:])
    else:
        run_compare(sys.argv[2], sys.argv[3], sys.argv[4:])
