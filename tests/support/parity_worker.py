"""Parity worker: the same tiny Qwen step under several meshes, compared with one process (fp32).

``python tests/support/parity_worker.py reference OUT_DIR FAMILY...`` runs each family's single-process reference in one
process (``OUT_DIR/<family>.pt``): initial weights, loss and every gradient of step 1, and the losses/grad norms of
three optimizer steps.
``torchrun --nproc-per-node N tests/support/parity_worker.py compare REF_DIR OUT.json LAYOUT...`` runs each layout in turn
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

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.dirname(TESTS), TESTS]  # megatron_ext and support, run as a script

from support import engines, thread_guard  # noqa: E402
from support.step_checks import worst  # noqa: E402
from megatron_ext import parallel  # noqa: E402
from megatron_ext.mesh import Mesh  # noqa: E402
from megatron_ext.models.moe_flags import MoESettings  # noqa: E402
from support.parity_layouts import (BUCKET, GPT2_SHAPE, LAYOUTS, LORA, MICRO_BATCH, MOE_SHAPE, NAN_AT_STEP,  # noqa: E402
                            NUM_CLASSES, QWEN3_SHAPES, SEED, SEQ, SETTINGS, SHAPE, STEPS, family, global_batch, my_microbatches)

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
    from megatron_ext.engines.megatron import build_model_chunks
    from megatron_ext.models.qwen import model as qwen
    from megatron_ext.models.vit import model as vit
    from megatron_ext.models.sharding import load_full_state
    from megatron_ext.models.spec import Recompute

    parallel.init_model_parallel(mesh, seed=SEED)
    if family.startswith("vit"):
        shape = vit.VIT_PRESETS["tiny"]
        config = vit.transformer_config(shape, mesh, recompute=Recompute("full" if recompute else None))
        chunks = build_model_chunks(lambda **kw: vit.ViTClassifier(config, shape, NUM_CLASSES, **kw), mesh.vpp)
        if family == "vit_lora":
            add_lora(chunks, randomize_b=full_state is None, wrong=wrong)
        if full_state is not None:
            load_full_state(chunks, full_state)
        return engines.build(chunks, device, vit.forward_step, mesh, distributed_optimizer=distributed_optimizer,
                             micro_batch_size=MICRO_BATCH, seq_length=shape.seq_length, bucket=BUCKET, **SETTINGS)
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
    config = qwen.transformer_config(shape, mesh, moe_settings=moe, cross_entropy_fusion=layout.startswith("ce_fusion"))
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
    from megatron_ext.objectives.sft import forward_step

    step_func = forward_step
    if family.startswith("dpo"):
        from megatron.core.tensor_parallel import mappings

        from megatron_ext.objectives import dpo, reference
        from megatron_ext.objectives.config import DPOConfig

        step_func = dpo.DPOStep(DPOConfig(beta=0.5, losses=("sigmoid", "sft"), weights=(1.0, 0.5)))
        reference.reduce_from_tensor_model_parallel_region = (lambda t, group: t) if wrong else \
            mappings.reduce_from_tensor_model_parallel_region
    if "fsdp" in layout:
        engine = engines.build(chunks, device, step_func, mesh, engine="fsdp", **SETTINGS)
        if wrong and family == "qwen_lora":  # the adapters' norms counted on TP rank 0 only
            engine._tp_split = set()
        elif wrong:  # the query/key norms' gradients not summed over TP
            engine._tp_partial = set()
        return engine
    engine = engines.build(chunks, device, step_func, mesh, distributed_optimizer=distributed_optimizer,
                           micro_batch_size=MICRO_BATCH, seq_length=SEQ, bucket=BUCKET, **SETTINGS)
    if family == "moe" and wrong:
        reduce_experts_over_dense_dp(engine)
    if family == "qwen3" and wrong:  # megatron-core's finalize_model_grads no longer sums the q/k norms over TP
        engine.config.qk_layernorm = False
    return engine


def build_gpt2_engine(mesh: Mesh, device, distributed_optimizer: bool, full_state, fsdp=False, wrong=False):
    from megatron_ext.engines.megatron import build_model_chunks
    from megatron_ext.models.gpt2 import model as gpt2
    from megatron_ext.models.qwen import model as qwen
    from megatron_ext.models.sharding import load_full_state
    from megatron_ext.objectives.sft import forward_step

    config = gpt2.transformer_config(GPT2_SHAPE, mesh)
    vocab = qwen.padded_vocab_size(GPT2_SHAPE.vocab_size, 128, mesh.tp)
    chunks = build_model_chunks(lambda **kw: gpt2.build_gpt2(config, GPT2_SHAPE, vocab_size=vocab, **kw), mesh.vpp)
    if full_state is not None:
        load_full_state(chunks, full_state)
    if fsdp:
        engine = engines.build(chunks, device, forward_step, mesh, engine="fsdp", **SETTINGS)
        if wrong:
            engine._tp_split = set()
        return engine
    return engines.build(chunks, device, forward_step, mesh, distributed_optimizer=distributed_optimizer,
                         micro_batch_size=MICRO_BATCH, seq_length=SEQ, bucket=BUCKET, **SETTINGS)


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
    distopt = name.endswith("distopt") or "_distopt_" in name
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
    from megatron_ext.models import linear_cross_entropy

    vocab_split = linear_cross_entropy.parallel_state
    if name == "ce_fusion_tp2_sp_wrong":  # each TP rank's rows taken for the vocabulary's first
        from types import SimpleNamespace

        linear_cross_entropy.parallel_state = SimpleNamespace(
            get_tensor_model_parallel_rank=lambda: 0,
            get_tensor_model_parallel_world_size=vocab_split.get_tensor_model_parallel_world_size,
            get_tensor_model_parallel_group=vocab_split.get_tensor_model_parallel_group)
    if name == "dp2_distopt_gather_wrong":  # no wait for the all-gather of the other ranks' updated shards
        for chunk in engine.model:
            chunk.disable_forward_pre_hook(param_sync=False)
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
    linear_cross_entropy.parallel_state = vocab_split
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
