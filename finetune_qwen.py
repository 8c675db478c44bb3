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

    import dataclasses

    from megatron.core import parallel_state

    from megatron_ext.data import sft
    from megatron_ext.data.sources import MockData, SFTData
    from megatron_ext.evaluation import generate
    from megatron_ext.models.qwen import build
    from megatron_ext.observability.flops import training_flops_per_token
    from megatron_ext.training.run import print_rank0, run_training, start

    device = start(run)
    batches = dict(global_batch_size=args.global_batch_size, micro_batch_size=args.micro_batch_size,
                   dp_rank=parallel_state.get_data_parallel_rank(), dp_size=mesh.dp, seed=args.seed)
    shape = run.shape
    preference = None  # training/{dpo,kto,reward}.py: another objective than SFT
    if args.mock_data:
        data = MockData(vocab_size=shape.vocab_size, seq_length=args.seq_length, **batches)
    elif args.objective != "sft":
        import importlib

        preference = importlib.import_module(f"megatron_ext.training.{args.objective}")
        data, info = preference.data(args, batches)
        shape = dataclasses.replace(shape, vocab_size=max(shape.vocab_size, info["vocab_size"]))
    else:
        from megatron_ext.data import mixture

        train, valid, info = mixture.build(args.data_mixture, lambda path: sft.build_datasets(
            path, args.tokenizer, args.seq_length, pack=args.pack_sequences, data_split=args.data_split,
            system_prompt=args.system_prompt, bad_rows=args.bad_rows, seed=args.seed, cache_dir=args.data_cache_dir,
            pad_multiple=2 * mesh.cp,  # context parallelism cuts every packed document into 2 x CP chunks
            how=args.row_format, loss_on=args.loss_on))
        print_rank0(f"megatron_ext: {info['records']} records ({info['bad_rows']} bad rows skipped, "
                    f"{info['truncated']} truncated) -> {info['train_samples']} train / {info['valid_samples']} "
                    f"validation samples of {args.seq_length} tokens; cache {info['cache']} in {info['seconds']:.1f}s")
        for line in mixture.describe(info):  # a mixture: each data set's part
            print_rank0(f"megatron_ext:   {line}")
        data = SFTData(train, valid, **batches)
        shape = dataclasses.replace(shape, vocab_size=max(shape.vocab_size, info["vocab_size"]))

    built = build.model(run, shape, device)
    objective = preference.Objective(run, info, built["model_meta"]) if preference else None
    return run_training(run, device=device, data=data, **built,
                        flops_per_token=training_flops_per_token(shape, args.seq_length),
                        eval_metrics=generate.from_args(args, device), objective=objective,
                        new_head=getattr(objective, "new_head", ()))


if __name__ == "__main__":
    run_main(main)
