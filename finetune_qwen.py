"""Qwen2/2.5 training on megatron-core (DP x TP(+SP) x PP(+VPP)). Until the SFT data lands: synthetic tokens.

    torchrun --nproc-per-node 4 finetune_qwen.py --model tiny --tensor-model-parallel-size 2 \
        --pipeline-model-parallel-size 2 --global-batch-size 8 --train-iters 20
"""

from megatron_ext import arguments
from megatron_ext.cli import run_main


def main():
    run = arguments.parse(description="Qwen2/2.5 training on megatron-core")  # all checks, before any group
    args, mesh, shape = run.args, run.mesh, run.shape

    import torch
    from megatron.core import parallel_state

    from megatron_ext import parallel
    from megatron_ext.data import synthetic
    from megatron_ext.engines.megatron import MegatronEngine, OptimizerSettings, build_model_chunks
    from megatron_ext.models import qwen
    from megatron_ext.training.loop import train

    device = parallel.init_distributed(args.distributed_backend)
    parallel.init_model_parallel(mesh, args.seed)
    dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32
    config = qwen.transformer_config(shape, mesh, params_dtype=dtype, on_gpu=device.type == "cuda")
    vocab = qwen.padded_vocab_size(shape.vocab_size, args.make_vocab_size_divisible_by, mesh.tp)
    chunks = build_model_chunks(lambda **kw: qwen.build_qwen(config, shape, vocab_size=vocab,
                                                             transformer_impl=args.transformer_impl, **kw), mesh.vpp)
    settings = OptimizerSettings(lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
                                 clip_grad=args.clip_grad, warmup_iters=args.lr_warmup_iters,
                                 decay_iters=args.train_iters, decay_style=args.lr_decay_style)
    engine = MegatronEngine(chunks, device=device, settings=settings,
                            use_distributed_optimizer=args.use_distributed_optimizer,
                            micro_batch_size=args.micro_batch_size, seq_length=args.seq_length)
    if torch.distributed.get_rank() == 0:
        print(f"megatron_ext: {mesh.describe()} on {device.type} ({torch.distributed.get_backend()}), "
              f"{sum(p.numel() for c in chunks for p in c.parameters())} parameters on rank 0", flush=True)

    def microbatches(step):
        batch = synthetic.global_batch(step, seed=args.seed, global_batch_size=args.global_batch_size,
                                       micro_batch_size=args.micro_batch_size, seq_length=args.seq_length,
                                       vocab_size=shape.vocab_size)
        return synthetic.data_parallel_slice(batch, parallel_state.get_data_parallel_rank(), mesh.dp)

    train(engine, microbatches, train_iters=args.train_iters,
          tokens_per_step=args.global_batch_size * args.seq_length, log_dir=args.log_dir)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    run_main(main)
