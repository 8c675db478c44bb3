"""A Qwen model as runs build it (``build_chunk`` + ``model_meta`` for ``training.run.build_model``: finetune_qwen.py,
pretrain_gpt.py's continued pretraining, tools/verify_model.py) and as conversion builds it (one CPU process).
megatron is imported only when one builds, so the flags' checks stay torch-free."""

from __future__ import annotations

import dataclasses


def model(run, shape, device) -> dict:
    """``build_model``'s keywords: ``build_chunk(pre_process, post_process, vp_stage)`` and what checkpoints record of
    the model (``model_meta``)."""
    from megatron_ext.models.qwen import model as qwen
    from megatron_ext.models.qwen.shape import read_hf_config
    from megatron_ext.models.spec import Recompute, params_dtype

    model, mesh = run.model, run.mesh  # (QwenModel, or pretrain_gpt.py's GPTModel for a Qwen it continues)
    config = qwen.transformer_config(shape, mesh, params_dtype=params_dtype(run), on_gpu=device.type == "cuda",
                                     recompute=Recompute.of(run.training),
                                     cross_entropy_fusion=run.fusions.cross_entropy_loss_fusion, moe_settings=run.moe)
    vocab = qwen.padded_vocab_size(shape.vocab_size, model.make_vocab_size_divisible_by, mesh.tp)
    source = run.pretrained.source
    model_meta = dict(model_shape=dataclasses.asdict(shape), params_dtype=str(params_dtype(run)),
                      hf_config=read_hf_config(model.hf_config or (source and source.config_path)),
                      model_type=shape.model_type)  # the exporter's family
    return dict(build_chunk=lambda **stage: qwen.build_qwen(config, shape, vocab_size=vocab,
                                                            transformer_impl=getattr(model, "transformer_impl",
                                                                                     "local"), **stage),
                model_meta=model_meta)


def single_process_mesh():
    """One CPU process holding the whole model (TP=PP=1): a distributed checkpoint written from it (or read into
    it) reshards to any mesh, so conversion never needs the training mesh."""
    from megatron_ext import parallel
    from megatron_ext.mesh import Mesh

    parallel.init_distributed("gloo")
    mesh = Mesh(world=1)
    parallel.init_model_parallel(mesh, seed=0)
    return mesh


def single_process(shape, dtype, record=None):
    """TP=PP=1 Qwen model on CPU, allocated but not initialised."""
    from megatron_ext.models.qwen import model as qwen
    from megatron_ext.models.qwen.hf import context

    config = qwen.transformer_config(shape, single_process_mesh(), params_dtype=dtype, initialize=False)
    return qwen.build_qwen(config, shape, vocab_size=context(shape).padded_vocab)
