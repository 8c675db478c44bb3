"""Run an entry script with a named, deliberate change on the real code path: the negative controls of end-to-end
tests (a planted bug must fail the comparison that guards against it) and the counters the GPU tier reads.

``python tests/support/patched.py NAME[,NAME...] SCRIPT ARGS...``, also as run_ranks' script: every rank applies the
changes, then runs SCRIPT as ``__main__`` with ARGS.
"""

from __future__ import annotations

import atexit
import os
import runpy
import sys


def wgrad_overwrite() -> None:
    """Gradient-accumulation fusion that overwrites ``main_grad`` instead of adding to it: only the last
    micro-batch's weight gradient survives in every fused linear layer."""
    from megatron_ext.platform import kernels

    def overwrite(input, grad_output, main_grad):
        main_grad.copy_(grad_output.t().to(main_grad.dtype) @ input.to(main_grad.dtype))

    kernels.TorchWgradAccumulation.wgrad_gemm_accum_fp32 = staticmethod(overwrite)


def pipeline_stage_clipping() -> None:
    """DeepSpeed's pipeline engine clipping as DeepSpeed does (its ``clip_fp32_gradients``: the norm of the stage's
    own parameters), instead of ours over every stage and TP rank; the norm it computed is reported."""
    from deepspeed.runtime.utils import clip_grad_norm_

    from megatron_ext.engines.deepspeed_pipe import DeepSpeedPipelineEngine

    def clip(self):
        engine = self.engine
        norm = clip_grad_norm_(parameters=engine.module.parameters(), max_norm=engine.gradient_clipping(),
                               mpu=engine.mpu)
        engine._global_grad_norm = float(norm)

    DeepSpeedPipelineEngine._clip_fp32_gradients = clip


def no_tp_sum_of_query_key_norms() -> None:
    """The DeepSpeed engine summing over TP only the sequence-parallel norms' gradients, not Qwen3's query/key
    norms' (each TP rank's covers its own heads)."""
    from megatron_ext.engines import deepspeed

    deepspeed.tp_partial_grad = lambda param, config: bool(
        config.sequence_parallel and getattr(param, "sequence_parallel", False)) and param.requires_grad


def count_zeropp() -> None:
    """Count ZeRO++'s quantizer calls: int8 weight gathers (qwZ) and the int4 gradient all-to-all (qgZ); each rank
    prints ``zeropp calls rank R: weights=N gradients=M`` as it exits."""
    from deepspeed.runtime.zero import partition_parameters, stage3

    counts = dict(weights=0, gradients=0)
    quantize, reduce = partition_parameters.CUDAQuantizer.quantize, stage3.all_to_all_quant_reduce

    def counted_quantize(self, *args, **kwargs):
        counts["weights"] += 1
        return quantize(self, *args, **kwargs)

    def counted_reduce(*args, **kwargs):
        counts["gradients"] += 1
        return reduce(*args, **kwargs)

    partition_parameters.CUDAQuantizer.quantize = counted_quantize
    stage3.all_to_all_quant_reduce = counted_reduce
    atexit.register(lambda: print(f"zeropp calls rank {os.environ.get('RANK', '0')}: weights={counts['weights']} "
                                  f"gradients={counts['gradients']}", flush=True))


def pretrained_plain_rows() -> None:
    """--pretrained's row reader with the fuse left out: each TP rank takes its plain 1/TP of the sources' rows
    stacked (the naive slicing that ignores the per-group QKV layout, [gate_r; up_r] and vocabulary padding)."""
    import torch

    from megatron_ext.convert import pretrained
    from megatron_ext.models.sharding import local_shard, tp_world_size

    rows = pretrained._rows

    def plain(rule, shapes, ctx, name, param, chunk):
        right = rows(rule, shapes, ctx, name, param, chunk)
        if right is None or tp_world_size(param) == 1:
            return right
        codes = torch.cat([torch.arange(shapes[n][0], dtype=torch.float64) + k * pretrained._STRIDE + 1
                           for k, n in enumerate(rule.hf)])
        full = torch.zeros(pretrained.full_shape(param)[0], dtype=torch.float64)
        full[:min(len(codes), len(full))] = codes[:len(full)]
        return local_shard(full.reshape(-1, *([1] * (param.dim() - 1))), "plain", param, chunk).flatten()

    pretrained._rows = plain


def next_token_off_by_one() -> None:
    """In-run generation reading each row's logits one position early (the second-to-last token's prediction)."""
    from megatron_ext.evaluation import generate

    pick = generate._pick_next_token
    generate._pick_next_token = lambda positions, last, logits: pick(positions, (last - 1).clamp(min=0), logits)


def node_local_disk() -> None:
    """Every rank but 0 on a node of its own with a local disk: rank 0's files are not there for them."""
    from megatron_ext.checkpoint import files

    if os.environ.get("RANK", "0") != "0":
        files.sees = lambda probe: False
        files.VISIBLE_WITHIN_S = 0.5


def qkv_transposed() -> None:
    """The loader fusing q, k, v as q, v, k: each KV group's key and value rows swapped (Qwen's KV heads have the
    same width, so every shape still fits)."""
    from megatron_ext.models.qwen import hf as qwen

    fuse = qwen.fuse_qkv
    qwen.fuse_qkv = lambda q, k, v, shape: fuse(q, v, k, shape)


def no_qk_norm() -> None:
    """Qwen3's query/key norms built and loaded but never applied."""
    from megatron_ext.models import spec

    build = spec.QKNorm.__new__

    def identity_norm(cls, config, hidden_size, eps=1e-5, **unused):
        norm = build(cls, config, hidden_size, eps)
        norm.forward = lambda x: x
        return norm

    spec.QKNorm.__new__ = staticmethod(identity_norm)


def topk_unnormalised() -> None:
    """A norm_topk_prob MoE (Qwen3-MoE) routed with its top-k probabilities left unnormalised (softmax over every
    expert, then top-k: Qwen2-MoE's rule)."""
    from megatron_ext.models import moe

    kwargs = moe.config_kwargs

    def unnormalised(*args, **keywords):
        out = kwargs(*args, **keywords)
        return dict(out, moe_router_pre_softmax=True) if out else out

    moe.config_kwargs = unnormalised


def universal_halves_as_columns() -> None:
    """DeepSpeed's universal loader told that SwiGLU's fc1 is a plain column-parallel tensor: each TP rank takes
    1/TP of the merged [gate; up] rows instead of its piece of each half."""
    from megatron_ext.engines import deepspeed_checkpoint

    split = deepspeed_checkpoint._split
    deepspeed_checkpoint._split = lambda name, param, gated: (
        "columns" if split(name, param, gated) == "halves" else split(name, param, gated))


def count_gc() -> None:
    """Count the garbage collections that start while the training loop runs: young ones (generations 0 and 1,
    what Python's automatic collector mostly runs) and full ones; printed at exit."""
    import gc

    from megatron_ext.training import run

    counts = dict(inside=False, young=0, full=0)

    def started(phase, info):
        if phase == "start" and counts["inside"]:
            counts["full" if info["generation"] == 2 else "young"] += 1

    gc.callbacks.append(started)
    train = run.train

    def counted(*args, **kwargs):
        counts["inside"] = True
        try:
            return train(*args, **kwargs)
        finally:
            counts["inside"] = False

    run.train = counted
    atexit.register(lambda: print(f"collections while training: {counts['young']} young, {counts['full']} full",
                                  flush=True))


def slow_rank_1() -> None:
    """Rank 1 takes 0.5 s longer over each training step's forward and backward (a slow GPU, a throttled node)."""
    import time

    import torch.distributed as dist

    from megatron_ext.engines.megatron import MegatronEngine

    forward_backward = MegatronEngine.forward_backward

    def slow(self, microbatches, forward_only=False):
        if dist.get_rank() == 1 and not forward_only:
            time.sleep(0.5)
        return forward_backward(self, microbatches, forward_only)

    MegatronEngine.forward_backward = slow


def lora_unscaled() -> None:
    """LoRA's forward adding B A x without alpha / rank (the merge on export still scales): with B = 0, as a new
    adapter starts, no logit would change."""
    from megatron_ext.models import lora

    forward = lora.LoRALinear.forward

    def unscaled(self, x, *args, **kwargs):
        scale, self.scale = self.scale, 1.0
        try:
            return forward(self, x, *args, **kwargs)
        finally:
            self.scale = scale

    lora.LoRALinear.forward = unscaled


def kl_per_micro_batch() -> None:
    """KTO's KL estimate as TRL's gradient accumulation makes it: each micro-batch step's KL rows (over the DP
    ranks), instead of the whole global batch's."""
    from megatron_ext.data.sources import UnpairedData

    whole = UnpairedData._microbatches

    def per_micro_batch(self, dataset, indices):
        kl_pass, self.kl_pass = self.kl_pass, None
        try:
            batches = whole(self, dataset, indices)
        finally:
            self.kl_pass = kl_pass
        for batch in batches if kl_pass is not None else ():
            batch["kl"].fill_(kl_pass([batch]))
        return batches

    UnpairedData._microbatches = per_micro_batch


PATCHES = {f.__name__: f for f in (universal_halves_as_columns, wgrad_overwrite, pipeline_stage_clipping,
                                   count_zeropp, pretrained_plain_rows, next_token_off_by_one, node_local_disk,
                                   no_tp_sum_of_query_key_norms, qkv_transposed, no_qk_norm, topk_unnormalised,
                                   count_gc, slow_rank_1, kl_per_micro_batch, lora_unscaled)}


def main(argv) -> None:
    names, script, *args = argv
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.path.insert(0, repo)
    for name in names.split(","):
        PATCHES[name]()
    script = os.path.join(repo, script)
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(script))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
