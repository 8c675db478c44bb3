"""A ViT classifier as pretrain_vit.py (and tools/verify_model.py) builds it, and as conversion does (one CPU
process)."""

from __future__ import annotations

import dataclasses
import functools

from megatron_ext.models.qwen.build import single_process_mesh


def model(run, shape, device, num_classes: int) -> dict:
    """``build_model``'s keywords ``build_chunk`` and what checkpoints record (``model_meta``), and the objective's
    parts (``objectives.base.FamilyStep``): the forward step (``step_func``) and the head a fine-tune starts afresh
    (``new_head``: ``--finetune`` or ``--pretrained`` with another class count)."""
    from megatron_ext.models.spec import Recompute, params_dtype
    from megatron_ext.models.vit import model as vit

    model = run.model
    config = vit.transformer_config(shape, run.mesh, params_dtype=params_dtype(run),
                                    recompute=Recompute.of(run.training))
    norm = vit.normalization(model.hf_config)  # recorded: exports write it into preprocessor_config.json
    model_meta = dict(model_shape=dataclasses.asdict(shape), params_dtype=str(params_dtype(run)),
                      num_classes=num_classes, model_type="vit", image_mean=norm["mean"], image_std=norm["std"])
    return dict(build_chunk=lambda **stage: vit.ViTClassifier(config, shape, num_classes, **stage),
                model_meta=model_meta, new_head=("head.weight", "head.bias"),
                step_func=functools.partial(vit.forward_step, label_smoothing=model.label_smoothing,
                                            image_size=shape.image_size, **norm))


def single_process(shape, dtype, record: dict):
    """TP=PP=1 ViT on CPU, allocated but not initialised; with ``num_classes`` None a backbone (no head)."""
    from megatron_ext.models.vit import model as vit

    config = vit.transformer_config(shape, single_process_mesh(), params_dtype=dtype, initialize=False)
    classes = record.get("num_classes")
    model = vit.ViTClassifier(config, shape, classes or 1)
    if classes is None:
        del model.head  # a ViTModel / in21k backbone: no head is saved or exported
    return model
