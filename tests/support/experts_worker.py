"""Grouped experts against SequentialMLP on one rank, step by step: the same batches through the megatron engine
(clipped AdamW), every parameter's gradient compared at every step, and a planted wrong grouping (token counts in
reverse expert order: rows meet another expert's weights) that must fail the same comparison.

tests/models/test_grouped_experts.py runs it in the test process (tiny-moe, fp32, CPU); tests/gpu/test_gpu_moe.py as a plain
process on one GPU with Qwen1.5-MoE-A2.7B's layer shapes in bf16 (the CUDA grouped GEMM):

    python tests/support/experts_worker.py --model qwen1.5-moe-a2.7b --num-layers 2 --vocab-size 2048 --seq-length 256 \
        --bf16 --out diffs.json
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import re
import sys
from typing import Dict, List, Optional

import torch

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.dirname(TESTS), TESTS]  # megatron_ext and support, run as a script

from megatron_ext.mesh import Mesh  # noqa: E402
from megatron_ext.models.qwen.shape import PRESETS, ModelShape  # noqa: E402
from support import engines  # noqa: E402

SHAPE = PRESETS["tiny-moe"]
SEQ, MICRO, STEPS = 32, 2, 3


def batches(step: int, shape: ModelShape = SHAPE, seq: int = SEQ):
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, shape.vocab_size, (2 * MICRO, seq + 1), generator=g)
    return [dict(tokens=tokens[i:i + MICRO, :-1], labels=tokens[i:i + MICRO, 1:],
                 loss_mask=(torch.rand(MICRO, seq, generator=g) < 0.8).float(),
                 position_ids=torch.arange(seq).expand(MICRO, seq)) for i in range(0, 2 * MICRO, MICRO)]


def build(grouped: bool, seed: int = 3, shape: ModelShape = SHAPE, dtype: torch.dtype = torch.float32,
          on_gpu: bool = False):
    from megatron_ext.mesh import Mesh
    from megatron_ext.models.qwen import model as qwen
    from megatron_ext.models.init import init_mesh_independent
    from megatron_ext.models.moe_flags import MoESettings

    settings = MoESettings(aux_loss_coeff=1e-2, z_loss_coeff=1e-3, grouped_gemm=grouped)
    config = qwen.transformer_config(shape, Mesh(world=1), params_dtype=dtype, on_gpu=on_gpu, moe_settings=settings)
    model = qwen.build_qwen(config, shape, vocab_size=qwen.padded_vocab_size(shape.vocab_size, 128, 1))
    init_mesh_independent([model], seed)
    return model


def _nan_last(value: float) -> float:
    return float("inf") if value != value else value  # NaN is the worst


def relative_by_parameter(grads: Dict[str, torch.Tensor], reference: Dict[str, torch.Tensor]) -> Dict[str, float]:
    """||g - ref|| per weight, each routed expert's on its own (one band over a layer's 60 experts would let a single
    wrong expert through), relative to ||ref|| or, for an expert, to the larger of its own norm and the root mean
    square of its layer's experts' norms for that weight: in bf16 a token whose top-k choice flips between two runs
    moves a rarely chosen expert's small gradient by tens of percent of itself, but little against a typical
    expert's; an expert whose rows meet another expert's weights moves by about 140% (two unrelated gradients)."""
    norms = {name: float(reference[name].float().norm()) for name in grads}
    layers: Dict[str, List[float]] = {}
    for name, norm in norms.items():
        if "local_experts." in name:
            layers.setdefault(re.sub(r"local_experts\.\d+\.", "local_experts.*.", name), []).append(norm)
    typical = {key: (sum(n * n for n in values) / len(values)) ** 0.5 for key, values in layers.items()}
    out = {}
    for name, grad in grads.items():
        scale = max(norms[name], typical.get(re.sub(r"local_experts\.\d+\.", "local_experts.*.", name), 0.0))
        out[name] = float((grad.float() - reference[name].float()).norm()) / max(scale, 1e-12)
    return out


def train(grouped: bool, shape: ModelShape = SHAPE, dtype: torch.dtype = torch.float32,
          device: torch.device = torch.device("cpu"), compare_to: Optional[dict] = None, seq: int = SEQ) -> dict:
    """Losses, grad norms and the expert implementation over STEPS steps; every step's gradients by global name, or,
    given ``compare_to`` (another run's result), each parameter's worst relative difference from those over the
    steps instead (so only one run's gradients are ever held)."""
    from megatron_ext.objectives.sft import forward_step
    from megatron_ext.models.sharding import global_named_parameters

    model = build(grouped, shape=shape, dtype=dtype, on_gpu=device.type == "cuda")
    engine = engines.build([model], device, forward_step, Mesh(world=1), micro_batch_size=MICRO, seq_length=seq,
                           lr=2e-3, clip_grad=0.5, decay_style="constant")
    out = dict(losses=[], norms=[], grads=[], worst={}, worst_by_step=[])
    for step in range(STEPS):
        out["losses"].append(engine.forward_backward(batches(step, shape, seq)))
        grads = {name: p.main_grad for name, _, p in global_named_parameters(engine.model[0])}
        if compare_to is None:
            out["grads"].append({name: g.clone() for name, g in grads.items()})
        else:
            reference = compare_to["grads"][step]
            assert grads.keys() == reference.keys()
            diffs = relative_by_parameter(grads, reference)
            for name, diff in diffs.items():
                out["worst"][name] = max(out["worst"].get(name, 0.0), diff, key=_nan_last)
            out["worst_by_step"].append(max(diffs.values(), key=_nan_last))
        out["norms"].append(engine.optimizer_step()["grad_norm"])
    out["kinds"] = sorted({type(m.experts).__name__ for m in engine.model[0].modules() if hasattr(m, "experts")})
    del engine, model, grads  # before the next model is built: on a GPU, three A2.7B-layer models would not fit
    gc.collect()
    if device.type == "cuda":
        out["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        torch.cuda.empty_cache()
    return out


def worst_diff(run: dict, reference: dict) -> float:
    """The largest relative difference of ``run`` (trained with ``compare_to=reference``) from ``reference``: any
    parameter's gradient at any step, any step's loss or grad norm; NaN counts as infinitely far."""
    from support.step_checks import worst

    assert len(run["losses"]) == len(reference["losses"]) == STEPS and run["worst"]
    scalars = [abs(x - y) / abs(y) for key in ("losses", "norms") for x, y in zip(run[key], reference[key])]
    return worst(list(run["worst"].values()) + scalars)


def reversed_grouping():
    """The planted bug: group offsets from the token counts in reverse expert order."""
    from megatron_ext.models import grouped_experts

    forward = grouped_experts.TorchGroupedMLP.forward
    grouped_experts.TorchGroupedMLP.forward = lambda self, x, counts, probs: forward(self, x, counts.flip(0), probs)
    return lambda: setattr(grouped_experts.TorchGroupedMLP, "forward", forward)


def two_experts_swapped():
    """The planted bug a layer-wide band misses: the token counts of the first expert and the next one with another
    count swapped (their rows meet each other's weights), every other expert right."""
    from megatron_ext.models import grouped_experts

    forward = grouped_experts.TorchGroupedMLP.forward

    def swapped(self, x, counts, probs):
        other = next((e for e in range(1, len(counts)) if int(counts[e]) != int(counts[0])), None)
        if other is not None:
            counts = counts.clone()
            counts[0], counts[other] = counts[other].clone(), counts[0].clone()
        return forward(self, x, counts, probs)

    grouped_experts.TorchGroupedMLP.forward = swapped
    return lambda: setattr(grouped_experts.TorchGroupedMLP, "forward", forward)


PLANTED = {"two_experts": two_experts_swapped}  # (the GPU's; reversed_grouping, the gross one, runs on CPU too)


def compare(shape: ModelShape, dtype: torch.dtype, device: torch.device, seq: int) -> Dict[str, object]:
    """Grouped and the planted wrong grouping, each against SequentialMLP: the worst differences (of all, and of
    the gradients per step), how many weights were compared, the losses, and the five weights furthest off."""
    reference = train(False, shape, dtype, device, seq=seq)
    result: Dict[str, object] = dict(reference_kinds=reference["kinds"])
    for name in ("grouped",) + tuple(PLANTED):
        undo = PLANTED[name]() if name in PLANTED else (lambda: None)
        try:
            run = train(True, shape, dtype, device, compare_to=reference, seq=seq)
        finally:
            undo()
        top: List = sorted(run["worst"].items(), key=lambda kv: -_nan_last(kv[1]))[:5]
        result[name] = dict(worst=worst_diff(run, reference), kinds=run["kinds"], furthest=top,
                            peak_gib=run.get("peak_gib"), compared=len(run["worst"]),
                            experts_compared=sum("local_experts." in k for k in run["worst"]),
                            worst_by_step=run["worst_by_step"],
                            losses=run["losses"], reference_losses=reference["losses"])
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-moe", choices=[k for k, v in PRESETS.items() if v.moe])
    parser.add_argument("--num-layers", type=int, default=None)
    parser.add_argument("--vocab-size", type=int, default=None, help="a smaller vocabulary: the experts are the point")
    parser.add_argument("--seq-length", type=int, default=SEQ, help="tokens per row (two micro-batches of two rows)")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    from megatron_ext import parallel
    from megatron_ext.mesh import Mesh

    shape = PRESETS[args.model]
    shape = dataclasses.replace(shape, num_layers=args.num_layers or shape.num_layers,
                                vocab_size=args.vocab_size or shape.vocab_size)
    device = parallel.init_distributed()
    parallel.init_model_parallel(Mesh(world=1), seed=1)
    try:
        result = compare(shape, torch.bfloat16 if args.bf16 else torch.float32, device, args.seq_length)
    finally:
        parallel.teardown()
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: v["worst"] for k, v in result.items() if isinstance(v, dict)}))


if __name__ == "__main__":
    main()
