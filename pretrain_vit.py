"""Vision Transformer image classification with megatron-core: DP x TP x PP, the megatron engine or DeepSpeed ZeRO.

    torchrun --nproc-per-node 2 pretrain_vit.py --model tiny --data-path examples/data/shapes_sample.parquet \
        --global-batch-size 32 --micro-batch-size 8 --train-iters 60 --lr 2e-3 --eval-interval 20

Data: a datasets hub id (ethz/food101, uoft-cs/cifar100), an image-folder or save_to_disk directory, parquet/arrow
files, or --mock-data. --lora-rank trains adapters and the head on a frozen (--load --finetune) model.
"""

import functools

from megatron_ext import arguments
from megatron_ext.cli import run_main


def main(argv=None):
    """Train with ``argv`` (default: the command line); returns this rank's per-step records."""
    run = arguments.parse(argv, description=__doc__.splitlines()[0], family="vit")  # every check first
    args, shape = run.args, run.shape

    from megatron_ext.data.sources import image_source
    from megatron_ext.observability.flops import vit_training_flops_per_image
    from megatron_ext.training.run import run_training, start

    device = start(run)
    data = image_source(args, shape, run.mesh, device)
    num_classes = args.num_classes or getattr(data, "num_classes", 10)
    # The loop counts tokens (patches + class token per image); MFU needs FLOPs per token, so per image / tokens.
    flops_per_token = vit_training_flops_per_image(shape, num_classes, frozen_base=run.lora is not None)
    return run_training(run, device=device, data=data, flops_per_token=flops_per_token / shape.seq_length,
                        **model(run, shape, device, num_classes))


def model(run, shape, device, num_classes: int):
    """``build_model``'s keywords for the model this script trains: ``build_chunk``, what checkpoints record
    (``model_meta``), and the objective: the classification step and the head a fine-tune starts afresh
    (``--finetune`` or ``--pretrained`` with another class count). Also tools/verify_model.py's, so that it checks
    the model training builds."""
    import dataclasses

    from megatron_ext.models import vit
    from megatron_ext.objectives.base import FamilyStep
    from megatron_ext.models.spec import Recompute
    from megatron_ext.training.run import params_dtype

    args = run.args
    config = vit.transformer_config(shape, run.mesh, params_dtype=params_dtype(run),
                                    recompute=Recompute.of(run.training))
    norm = vit.normalization(args.hf_config)  # recorded: exports write it into preprocessor_config.json
    model_meta = dict(model_shape=dataclasses.asdict(shape), params_dtype=str(params_dtype(run)),
                      num_classes=num_classes, model_type="vit", image_mean=norm["mean"], image_std=norm["std"])
    return dict(build_chunk=lambda **stage: vit.ViTClassifier(config, shape, num_classes, **stage),
                model_meta=model_meta, objective=FamilyStep(
                    functools.partial(vit.forward_step, label_smoothing=args.label_smoothing,
                                      image_size=shape.image_size, **norm), new_head=("head.weight", "head.bias")))


if __name__ == "__main__":
    run_main(main)
