"""What the parity matrix runs (tests/support/parity_worker.py, tests/training/test_parity_megatron.py): the tiny shapes and optimizer
settings, every layout (mesh, engine, family, and the deliberately wrong variants that must fail), and the global
batches each step draws, identical for every mesh."""

from __future__ import annotations

import torch

from megatron_ext.mesh import Mesh
from megatron_ext.models.qwen.shape import PRESETS
from megatron_ext.models.gpt2.shape import GPT2_PRESETS

SEED, STEPS, GLOBAL_BATCH, MICRO_BATCH, SEQ = 1234, 3, 8, 2, 32
SHAPE = PRESETS["tiny"]  # 4 heads / 2 KV groups (GQA), QKV bias, tied embeddings, 4 layers
GPT2_SHAPE = GPT2_PRESETS["tiny"]  # 4 heads, 4 layers, 2048-token vocabulary, 512 learned positions
MOE_SHAPE = PRESETS["tiny-moe"]  # the same with 4 experts (top-2) and a gated shared expert in every layer
QWEN3_SHAPES = {"qwen3": PRESETS["tiny-qwen3"],  # query/key norms, no QKV bias, head dimension 32 (2 x hidden/heads)
                "qwen3moe": PRESETS["tiny-qwen3-moe"]}  # and 4 experts (top-2, renormalised), no shared expert
# Gradients per data-parallel reduction bucket of the megatron engine: the tiny models' in dozens of buckets, each
# reduced as soon as its gradients are ready, behind the rest of the backward (megatron-core's overlap_grad_reduce).
BUCKET = 4096
SETTINGS = dict(lr=2e-3, clip_grad=0.5, decay_iters=STEPS, decay_style="constant",  # clipping bites (norm ~1.4)
                weight_decay=0.1)  # (and weight decay, on every engine only where megatron-core applies it)

LAYOUTS = {
    "dp2": dict(world=2),
    "tp2": dict(world=2, tp=2),
    "tp2_sp": dict(world=2, tp=2, sequence_parallel=True),
    "pp2": dict(world=2, pp=2),
    "pp2_vpp2": dict(world=2, pp=2, vpp=2),
    "dp2_distopt": dict(world=2),
    # The distributed optimizer's updated shards are all-gathered during the next forward, each bucket just before
    # its first module runs (overlap_param_gather, on with every distopt layout). "wrong": that wait taken out, so
    # every rank trains on the other rank's half of the weights as they were, which must fail from step 2.
    "dp2_distopt_gather_wrong": dict(world=2),
    # --cross-entropy-loss-fusion: the output layer and the loss in chunks of tokens (models/linear_cross_entropy.py)
    # against the unfused reference: under TP2 + SP (the vocabulary split), PP2 (the last stage's copy of the tied
    # embedding; x DP2 with the distributed optimizer: that copy read after its overlapped all-gather) and CP2 x TP2 +
    # SP. "wrong": every TP rank taking its rows for the vocabulary's first, which must fail.
    "ce_fusion_tp2_sp": dict(world=2, tp=2, sequence_parallel=True),
    "ce_fusion_pp2": dict(world=2, pp=2),
    "ce_fusion_pp2_dp2_distopt": dict(world=4, pp=2),
    "ce_fusion_cp2_tp2_sp": dict(world=4, tp=2, cp=2, sequence_parallel=True),
    "ce_fusion_tp2_sp_wrong": dict(world=2, tp=2, sequence_parallel=True),
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
    # DPO (objectives/dpo.py) on the tiny Qwen: pairs of rows [chosen; rejected] in one micro-batch, the sigmoid loss
    # against fixed reference log-probabilities plus half the chosen completions' mean token loss ("sft"), under
    # PP2 x VPP2, CP2 (each row's log-probability summed over the CP ranks), DP2 with the distributed optimizer and
    # FSDP2 (TP2+SP: the MoE and LoRA layouts below).
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
        from megatron_ext.models.vit.model import VIT_PRESETS

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
    chosen_tokens = sum(b["completion_mask"][:pairs].sum() for b in batches)  # the "sft" term's mean over them
    for b in batches:
        b["sft_scale"] = torch.full((pairs,), GLOBAL_BATCH / 2 / float(chosen_tokens))
    return batches


def my_microbatches(step: int, mesh: Mesh, kind: str = "qwen"):
    from megatron.core import parallel_state
    from megatron_ext.data.synthetic import data_parallel_slice

    return data_parallel_slice(global_batch(step, kind), parallel_state.get_data_parallel_rank(), mesh.dp)
