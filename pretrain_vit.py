"""Vision Transformer image classification with megatron-core: DP x TP x PP, the megatron engine or DeepSpeed ZeRO.

    torchrun --nproc-per-node 2 pretrain_vit.py --model tiny --mock-data --tensor-model-parallel-size 2 \
        --global-batch-size 16 --micro-batch-size 4 --train-iters 20

So far it trains on synthetic labelled images (--mock-data); image datasets, LoRA and the launchers are its issue's
next steps.
"""

import functools

from megatron_ext import arguments
from megatron_ext.cli import run_main


def main(argv=None):
    """Train with ``argv`` (default: the command line); returns this rank's per-step records."""
    run = arguments.parse(argv, description=__doc__.splitlines()[0], family="vit")  # every check first
    args, mesh, shape = run.args, run.mesh, run.shape

    import dataclasses

    from megatron.core import parallel_state

    from megatron_ext import parallel
    from megatron_ext.data.sources import MockImages
    from megatron_ext.models import vit
    from megatron_ext.observability.flops import vit_training_flops_per_image
    from megatron_ext.training.run import params_dtype, run_training

    device = parallel.init_distributed(args.distributed_backend)
    parallel.init_model_parallel(mesh, seed=args.seed)
    data = MockImages(image_size=shape.image_size, num_classes=args.num_classes, channels=shape.num_channels,
                      global_batch_size=args.global_batch_size, micro_batch_size=args.micro_batch_size,
                      dp_rank=parallel_state.get_data_parallel_rank(), dp_size=mesh.dp, seed=args.seed)
    config = vit.transformer_config(shape, mesh, params_dtype=params_dtype(args),
                                    recompute_granularity=args.recompute_granularity,
                                    recompute_num_layers=args.recompute_num_layers)
    # The loop counts tokens (patches + class token per image); MFU needs FLOPs per token, so per image / tokens.
    flops_per_token = vit_training_flops_per_image(shape, args.num_classes) / shape.seq_length
    model_meta = dict(model_shape=dataclasses.asdict(shape), params_dtype=str(params_dtype(args)),
                      num_classes=args.num_classes, model_type="vit")
    return run_training(run, device=device, data=data, model_meta=model_meta, flops_per_token=flops_per_token,
                        new_head=("head.weight", "head.bias"),  # --finetune with another --num-classes
                        build_chunk=lambda **stage: vit.ViTClassifier(config, shape, args.num_classes, **stage),
                        step_func=functools.partial(vit.forward_step, label_smoothing=args.label_smoothing))


if __name__ == "__main__":
    run_main(main)
