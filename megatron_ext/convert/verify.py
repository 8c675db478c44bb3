"""A parity card for a model as a run builds it: logits, per-token loss, top-1 and parameter count against
transformers on one fixed batch, the ``--save-hf`` round trip, and the training path's loss
(``tools/verify_model.py``; the tests' logits and export checks use the same functions).

Rows pass within a tolerance that depends on the dtype: fp32 is exact up to summation order (logits 1e-4), bf16 is a
band (the two sides round differently in every layer).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from typing import Callable, Dict, List, Optional, Union

import torch
import torch.distributed as dist

# (logits max abs, logits mean abs, per-token loss max abs, top-1 agreement at least, mean loss abs). Measured in
# bf16: a random Qwen2.5-1.5B on an H200 0.13, 0.019, 0.055, 97%, 0.0029 (2026-11-27); the mean loss's band is its
# own, since per-token errors of either sign average out of it (a LoRA forward without its scale moved the tiny
# test model's tokens by 0.56 and its mean loss by 0.058: tests/convert/test_verify_model.py).
BANDS = {torch.float32: (1e-4, 1e-5, 1e-4, 1.0, 1e-4), torch.bfloat16: (0.5, 0.05, 0.1, 0.95, 0.02),
         torch.float16: (0.25, 0.02, 0.05, 0.97, 0.01)}


@dataclasses.dataclass
class Row:
    name: str
    value: object
    limit: str
    passed: bool


def logits(chunks, tokens: torch.Tensor, vocab_size: int) -> Optional[torch.Tensor]:
    """[B, S, vocab] logits of ``tokens`` (one row per micro-batch) on the model ``chunks`` (TP shards gathered;
    context parallelism: each rank its zig-zag chunks, the sequence put back in order); on the last pipeline stage,
    None elsewhere. Collective over the model's mesh."""
    from megatron.core import parallel_state

    from megatron_ext.models.context_parallel import zigzag, zigzag_slice
    from megatron_ext.models.sharding import all_gather_tp

    seq = tokens.shape[1]
    cp, cp_rank = parallel_state.get_context_parallel_world_size(), parallel_state.get_context_parallel_rank()

    def whole_sequence(part_logits):  # every CP rank's two chunks back in sequence order
        parts = all_gather_tp(part_logits, parallel_state.get_context_parallel_group())
        pieces = [None] * (2 * cp)
        for r, part in enumerate(parts):
            for g, piece in zip(zigzag(cp, r), part.chunk(2, dim=1)):
                pieces[g] = piece
        return torch.cat(pieces, dim=1)

    def forward(model, row):
        positions = torch.arange(seq, device=row.device)[None]
        if cp > 1:
            row, positions = zigzag_slice(row, cp, cp_rank), zigzag_slice(positions, cp, cp_rank)

        def gather(out):
            gathered = torch.cat(all_gather_tp(out.detach().float()), dim=-1)
            return whole_sequence(gathered) if cp > 1 else gathered
        return model(row, positions, attention_mask=None), gather

    out = _forward_only(chunks, tokens.split(1), seq // cp, forward)
    return None if out is None else out[..., :vocab_size]


def image_outputs(chunks, pixels: torch.Tensor, seq_length: int, features: bool = False) -> Optional[torch.Tensor]:
    """A ViT's [B, classes] logits of normalised ``pixels`` (one image per micro-batch), or with ``features`` what
    its head reads ([B, hidden]: the class token after the final norm, the features a new head is trained on); on
    the last pipeline stage, None elsewhere. (The head is not TP-sharded: every TP rank holds the whole output.)"""
    seen = []  # the head's input, of the micro-batch just run (its loss function runs right after its forward)
    hooks = [module.register_forward_hook(lambda _, inputs, output: seen.append(inputs[0]))
             for chunk in chunks for name, module in chunk.named_modules()
             if features and name.rsplit(".", 1)[-1] == "head"]  # (the last stage's)
    try:
        return _forward_only(chunks, pixels.split(1), seq_length, lambda model, image: (
            model(image), lambda out: (seen.pop() if features else out).detach().float()))
    finally:
        for hook in hooks:
            hook.remove()


def _forward_only(chunks, inputs, seq_length: int, forward) -> Optional[torch.Tensor]:
    """``inputs`` (one micro-batch each) through megatron-core's forward-only pipeline schedule on the model
    ``chunks``: ``forward(model, input)`` returns a chunk's output and, for the last stage, how to keep it; there the
    kept outputs, concatenated on the CPU; None on other stages."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    device = next(chunks[0].parameters()).device
    for chunk in chunks:
        chunk.eval()

    def forward_step(data_iterator, model):
        output, keep = forward(model, next(data_iterator).to(device))
        return output, lambda out: (out.sum() * 0, {"kept": keep(out)})

    iterators = [iter(inputs) for _ in chunks]
    with torch.no_grad():
        out = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iterators if len(chunks) > 1 else iterators[0],
            model=chunks, num_microbatches=len(inputs), seq_length=seq_length, micro_batch_size=1, forward_only=True)
    if not parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        return None
    return torch.cat([o["kept"] for o in out]).cpu()


def compare(ours: torch.Tensor, theirs: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor,
            dtype: torch.dtype, unit: str = "token") -> List[Row]:
    """The logit rows: max and mean absolute difference, per-``unit`` loss (on the masked ones), top-1 agreement.
    Language models: [B, S, vocab] logits, [B, S] labels and mask; images: [B, classes], [B]."""
    if ours.dim() == 2:  # one "token" per image
        ours, theirs, labels, mask = ours[:, None], theirs[:, None], labels[:, None], mask[:, None]
    _, _, loss_abs, top1, _ = BANDS.get(dtype, BANDS[torch.bfloat16])
    losses = [torch.nn.functional.cross_entropy(x.float().transpose(1, 2), labels, reduction="none")
              for x in (ours, theirs)]
    loss_diff = ((losses[0] - losses[1]).abs() * mask).max().item()
    agree = ((ours.argmax(-1) == theirs.argmax(-1)).float() * mask).sum().item() / max(mask.sum().item(), 1)
    return differences("logits", ours, theirs, dtype) + [
        Row(f"per-{unit} loss: max |difference|", loss_diff, f"<= {loss_abs:g}", loss_diff <= loss_abs),
        Row("top-1 agreement", agree, f">= {top1:.0%}", agree >= top1)]


def differences(what: str, ours: torch.Tensor, theirs: torch.Tensor, dtype: torch.dtype) -> List[Row]:
    """Max and mean absolute difference of two outputs (logits, features), within the dtype's band."""
    max_abs, mean_abs, *_ = BANDS.get(dtype, BANDS[torch.bfloat16])
    diff = (ours.float() - theirs.float()).abs()
    return [Row(f"{what}: max |ours - transformers|", diff.max().item(), f"<= {max_abs:g}", diff.max() <= max_abs),
            Row(f"{what}: mean |ours - transformers|", diff.mean().item(), f"<= {mean_abs:g}",
                diff.mean() <= mean_abs)]


def parameter_count(chunks, vocab_size: int) -> int:
    """The model's parameters as transformers counts them (collective): every rank's, each global name once
    (experts, TP shards and the last stage's tied embedding included once), vocabulary padding and LoRA adapters
    (merged into the weights they wrap on export) left out."""
    from megatron_ext.models.init import full_shape
    from megatron_ext.models.sharding import global_named_parameters

    mine = {}
    for chunk in chunks:
        for gname, _, param in global_named_parameters(chunk):
            if ".lora_a." in gname or ".lora_b." in gname:
                continue
            shape = list(full_shape(param))
            if gname in ("embedding.word_embeddings.weight", "output_layer.weight"):
                shape[0] = vocab_size
            mine[gname] = math.prod(shape)
    everyone: List = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return sum({k: v for part in everyone for k, v in part.items()}.values())


Tensors = Dict[str, Union[torch.Tensor, Callable[[], torch.Tensor]]]  # a tensor, or what reads it when asked


def _tensor(value) -> torch.Tensor:
    return value() if callable(value) else value


def exact_round_trip(exported: Tensors, source: Tensors) -> Optional[str]:
    """None when every exported tensor is the source's bit for bit, dtype included, and none is missing; else
    what differs first. Lazy values are read one pair at a time (a large model's two copies never all at once)."""
    return _round_trip(exported, source, lambda ours, theirs: torch.equal(ours, theirs), "values differ")


def merged_round_trip(exported: Tensors, merged: Tensors) -> Optional[str]:
    """None when the export (adapters folded in) is PEFT's ``merge_and_unload`` of the same adapter: the same names
    and dtypes, each tensor within one rounding of its dtype at its own scale (we add B A in fp32 and round once,
    PEFT rounds B A to the dtype first); else what differs first."""
    def close(ours, theirs):
        scale = max(theirs.float().abs().max().item(), 1e-30)
        return (ours.float() - theirs.float()).abs().max().item() <= 2 * torch.finfo(theirs.dtype).eps * scale

    return _round_trip(exported, merged, close, "values differ beyond one rounding")


def _round_trip(exported: Tensors, source: Tensors, same, differ: str) -> Optional[str]:
    if sorted(exported) != sorted(source):
        extra, missing = sorted(set(exported) - set(source)), sorted(set(source) - set(exported))
        return f"names differ (extra {extra[:2]}, missing {missing[:2]})"
    for name in source:
        theirs, ours = _tensor(source[name]), _tensor(exported[name])
        if ours.dtype != theirs.dtype:
            return f"{name}: {ours.dtype} instead of {theirs.dtype}"
        if not same(ours, theirs):
            return f"{name}: {differ}"
    return None


def in_dtype(tensors: Tensors, dtype: torch.dtype) -> Tensors:
    """``tensors`` cast to ``dtype`` as each is read."""
    return {name: functools.partial(lambda value: _tensor(value).to(dtype), value) for name, value in tensors.items()}


def read_tensors(directory: str, keep=lambda name: True, lazy: bool = False) -> Tensors:
    """Every tensor of a Hugging Face directory (its index and shards; those ``keep`` accepts), by name; ``lazy``:
    what reads each, when asked."""
    from megatron_ext.convert.common import SafetensorsReader

    reader = SafetensorsReader(directory)
    if lazy:
        return {name: functools.partial(reader.get, name) for name in reader.names() if keep(name)}
    return {name: reader.get(name) for name in reader.names() if keep(name)}


def format_card(title: str, rows: List[Row]) -> str:
    width = max(len(r.name) for r in rows)
    lines = [title, f"  {'check':<{width}}  {'value':>20}  {'limit':<20} result"]
    for r in rows:
        value = f"{r.value:.3e}" if isinstance(r.value, float) and (abs(r.value) < 1e-2 or abs(r.value) >= 1e5) \
            else f"{r.value:.4f}" if isinstance(r.value, float) else f"{r.value:,}" if isinstance(r.value, int) \
            else str(r.value)
        lines.append(f"  {r.name:<{width}}  {value:>20}  {r.limit:<20} {'pass' if r.passed else 'FAIL'}")
    failed = [r.name for r in rows if not r.passed]
    lines.append(f"  => {'PASS' if not failed else 'FAIL: ' + '; '.join(failed)}")
    return "\n".join(lines)


def write_json(path: str, title: str, rows: List[Row], extra: dict) -> None:
    with open(path, "w") as f:
        json.dump(dict(title=title, passed=all(r.passed for r in rows), **extra,
                       rows=[dict(dataclasses.asdict(r), passed=bool(r.passed)) for r in rows]), f, indent=1,
                  default=str)
