"""Qwen2/2.5 supervised fine-tuning on MetaMathQA with megatron-core: DP x TP(+SP) x PP(+VPP) x CP, GPU to many nodes.

    torchrun --nproc-per-node 4 finetune_qwen.py --model tiny --pack-sequences \
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --global-batch-size 8 --train-iters 20
"""

from megatron_ext import arguments
from megatron_ext.cli import run_main


def main(argv=None):
    """Train with ``argv`` (default: the command line); returns this rank's per-step records (bench/ reads them)."""
    run = arguments.parse(argv, description=__doc__.splitlines()[0])  # every check, before any process group
    args, mesh = run.args, run.mesh
    training = run.training

    import dataclasses

    from megatron.core import parallel_state

    from megatron_ext import objectives
    from megatron_ext.evaluation import generate
    from megatron_ext.observability.flops import training_flops_per_token
    from megatron_ext.training.run import run_training, start

    device = start(run)
    batches = dict(global_batch_size=training.global_batch_size, micro_batch_size=training.micro_batch_size,
                   dp_rank=parallel_state.get_data_parallel_rank(), dp_size=mesh.dp, seed=training.seed)
    objective = objectives.REGISTRY[run.objective.NAME](run)  # SFT, DPO, KTO, reward: its data, step and hooks
    data, info = objective.data(batches)
    shape = dataclasses.replace(run.shape, vocab_size=max(run.shape.vocab_size, info["vocab_size"]))
    return run_training(run, device=device, data=data, **model(run, shape, device),
                        flops_per_token=training_flops_per_token(shape, training.seq_length),
                        eval_metrics=generate.from_args(args, device), objective=objective)


def model(run, shape, device):
    """``build_model``'s keywords for the model this script trains: ``build_chunk(pre_process, post_process,
    vp_stage)`` and what checkpoints record of it (``model_meta``). Also tools/verify_model.py's, so that it checks
    the model training builds."""
    import dataclasses

    from megatron_ext.models import qwen
    from megatron_ext.models.shapes import read_hf_config
    from megatron_ext.models.spec import Recompute
    from megatron_ext.training.run import params_dtype

    args, mesh = run.args, run.mesh
    config = qwen.transformer_config(shape, mesh, params_dtype=params_dtype(run), on_gpu=device.type == "cuda",
                                     recompute=Recompute.of(run.training),
                                     cross_entropy_fusion=run.fusions.cross_entropy_loss_fusion, moe_settings=run.moe)
    vocab = qwen.padded_vocab_size(shape.vocab_size, args.make_vocab_size_divisible_by, mesh.tp)
    source = args.pretrained_source
    model_meta = dict(model_shape=dataclasses.asdict(shape), params_dtype=str(params_dtype(run)),
                      hf_config=read_hf_config(args.hf_config or (source and source.config_path)),
                      model_type=shape.model_type)  # the exporter's family
    return dict(build_chunk=lambda **stage: qwen.build_qwen(config, shape, vocab_size=vocab,
                                                            transformer_impl=args.transformer_impl, **stage),
                model_meta=model_meta)


if __name__ == "__main__":
    run_main(main)
