"""A GPT-2 as pretrain_gpt.py (and tools/verify_model.py) builds it, and as conversion does (one CPU process); a Qwen
shape (continued pretraining) is built as finetune_qwen.py builds it."""

from __future__ import annotations

import dataclasses

from megatron_ext.models.qwen import build as qwen_build


def model(run, shape, device) -> dict:
    """``build_model``'s keywords (``build_chunk``, ``model_meta``)."""
    from megatron_ext.models.gpt2 import model as gpt2
    from megatron_ext.models.qwen.model import padded_vocab_size
    from megatron_ext.models.qwen.shape import ModelShape
    from megatron_ext.models.spec import Recompute, params_dtype

    if isinstance(shape, ModelShape):
        return qwen_build.model(run, shape, device)
    mesh = run.mesh
    config = gpt2.transformer_config(shape, mesh, params_dtype=params_dtype(run), on_gpu=device.type == "cuda",
                                     recompute=Recompute.of(run.training),
                                     cross_entropy_fusion=run.fusions.cross_entropy_loss_fusion)
    vocab = padded_vocab_size(shape.vocab_size, run.model.make_vocab_size_divisible_by, mesh.tp)
    model_meta = dict(model_shape=dataclasses.asdict(shape), params_dtype=str(params_dtype(run)),
                      hf_config=None, model_type="gpt2")  # the exporter's family
    return dict(build_chunk=lambda **stage: gpt2.build_gpt2(config, shape, vocab_size=vocab, **stage),
                model_meta=model_meta)


def single_process(shape, dtype, record=None):
    """TP=PP=1 GPT-2 on CPU, allocated but not initialised."""
    from megatron_ext.models.gpt2 import model as gpt2
    from megatron_ext.models.gpt2.hf import context

    config = gpt2.transformer_config(shape, qwen_build.single_process_mesh(), params_dtype=dtype, initialize=False)
    return gpt2.build_gpt2(config, shape, vocab_size=context(shape).padded_vocab)
