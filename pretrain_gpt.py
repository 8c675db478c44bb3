"""GPT-2 pretraining, and continued pretraining of Qwen2.5/Qwen3 (dense, MoE), on Megatron corpora or text (Shakespeare,
OpenWebText, your own) with megatron-core: DP x TP(+SP) x PP(+VPP) x CP.

    torchrun --nproc-per-node 4 pretrain_gpt.py --model tiny --tensor-model-parallel-size 2 \
        --pipeline-model-parallel-size 2 --global-batch-size 8 --seq-length 128 --train-iters 40
    torchrun --nproc-per-node 8 pretrain_gpt.py --pretrained Qwen/Qwen2.5-0.5B --bf16 --data-path my_text_document \
        --seq-length 4096 --global-batch-size 64 --save-hf runs/cpt/hf
"""

from megatron_ext import arguments
from megatron_ext.cli import run_main


def main(argv=None):
    """Train with ``argv`` (default: the command line); returns this rank's per-step records."""
    run = arguments.parse(argv, description=__doc__.splitlines()[0], family="gpt")  # before any process group
    mesh, training = run.mesh, run.training
    from megatron_ext.data import indexed

    indexed.check_flags(run.data)  # corpora named by prefix: a bad one is one line before the process group and imports

    import dataclasses

    from megatron.core import parallel_state

    from megatron_ext.data import pretrain
    from megatron_ext.models.gpt2 import build
    from megatron_ext.objectives import base, sft
    from megatron_ext.observability.flops import training_flops_per_token
    from megatron_ext.training.run import print_rank0, run_training, start

    device = start(run)
    batches = dict(global_batch_size=training.global_batch_size, micro_batch_size=training.micro_batch_size,
                   dp_rank=parallel_state.get_data_parallel_rank(), dp_size=mesh.dp, seed=training.seed)
    shape = run.shape
    data, info = pretrain.build(run, vocab_size=shape.vocab_size, rampup=run.rampup, **batches)
    print_rank0(f"megatron_ext: {info['name']}: {info['train_samples']} train / {info['valid_samples']} validation "
                f"samples of {training.seq_length} tokens (megatron-core GPTDataset; sample index in {info['cache']})")
    shape = dataclasses.replace(shape, vocab_size=max(shape.vocab_size, info["vocab_size"]))

    return run_training(run, device=device, data=data, **build.model(run, shape, device),
                        flops_per_token=training_flops_per_token(shape, training.seq_length),
                        objective=base.FamilyStep(sft.forward_step))  # the next-token loss


if __name__ == "__main__":
    run_main(main)
