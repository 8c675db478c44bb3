"""Vision Transformer image classification with megatron-core: DP x TP x PP, the megatron engine or DeepSpeed ZeRO.

    torchrun --nproc-per-node 2 pretrain_vit.py --model tiny --data-path examples/data/shapes_sample.parquet \
        --global-batch-size 32 --micro-batch-size 8 --train-iters 60 --lr 2e-3 --eval-interval 20

Data: a datasets hub id (ethz/food101, uoft-cs/cifar100), an image-folder or save_to_disk directory, parquet/arrow
files, or --mock-data. --lora-rank trains adapters and the head on a frozen (--load --finetune) model.
"""

from megatron_ext import arguments
from megatron_ext.cli import run_main


def main(argv=None):
    """Train with ``argv`` (default: the command line); returns this rank's per-step records."""
    run = arguments.parse(argv, description=__doc__.splitlines()[0], family="vit")  # every check first
    shape = run.shape

    from megatron_ext.data.sources import image_source
    from megatron_ext.models.vit import build
    from megatron_ext.objectives.base import FamilyStep
    from megatron_ext.observability.flops import vit_training_flops_per_image
    from megatron_ext.training.run import run_training, start

    device = start(run)
    data = image_source(run, device)
    num_classes = run.model.num_classes or getattr(data, "num_classes", 10)
    # The loop counts tokens (patches + class token per image); MFU needs FLOPs per token, so per image / tokens.
    flops_per_token = vit_training_flops_per_image(shape, num_classes, frozen_base=run.lora is not None)
    built = build.model(run, shape, device, num_classes)  # its objective: the classification, a head it may start
    objective = FamilyStep(built.pop("step_func"), new_head=built.pop("new_head"))
    return run_training(run, device=device, data=data, flops_per_token=flops_per_token / shape.seq_length,
                        objective=objective, **built)


if __name__ == "__main__":
    run_main(main)
