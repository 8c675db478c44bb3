"""Qwen2/2.5 supervised fine-tuning on MetaMathQA with megatron-core: DP x TP(+SP) x PP(+VPP) x CP, GPU to many nodes.

    torchrun --nproc-per-node 4 finetune_qwen.py --model tiny --pack-sequences \
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --global-batch-size 8 --train-iters 20
"""

from megatron_ext import arguments
from megatron_ext.cli import run_main


def main(argv=None):
    """Train with ``argv`` (default: the command line); returns this rank's per-step records (bench/ reads them)."""
    run = arguments.parse(argv, description=__doc__.splitlines()[0])  # every check, before any process group
    mesh, training = run.mesh, run.training

    import dataclasses

    from megatron.core import parallel_state

    from megatron_ext import objectives
    from megatron_ext.evaluation import generate
    from megatron_ext.models.qwen import build
    from megatron_ext.observability.flops import training_flops_per_token
    from megatron_ext.training.run import run_training, start

    device = start(run)
    batches = dict(global_batch_size=training.global_batch_size, micro_batch_size=training.micro_batch_size,
                   dp_rank=parallel_state.get_data_parallel_rank(), dp_size=mesh.dp, seed=training.seed)
    objective = objectives.REGISTRY[run.objective.NAME](run)  # SFT, DPO, KTO, reward: its data, step and hooks
    data, info = objective.data(batches)
    shape = dataclasses.replace(run.shape, vocab_size=max(run.shape.vocab_size, info["vocab_size"]))
    return run_training(run, device=device, data=data, **build.model(run, shape, device),
                        flops_per_token=training_flops_per_token(shape, training.seq_length),
                        eval_metrics=generate.from_run(run, device), objective=objective)


if __name__ == "__main__":
    run_main(main)
