"""Engines as training builds them (``training.run.build_engine``), from sections a test chooses: the same
construction as a run's, without a command line."""

from megatron_ext.config.engine import Engine
from megatron_ext.config.training import Fusions, Training
from megatron_ext.engines.optimizer import OptimizerSettings


def build(chunks, device, step_func, mesh, *, engine: str = "megatron", distributed_optimizer: bool = False,
          zero_stage: int = 1, micro_batch_size: int = 1, global_batch_size=None, seq_length: int = 128, bucket=None,
          seed: int = 1234, gradient_accumulation_fusion: bool = True, compile_layers: bool = False, **optimizer):
    """``optimizer``: OptimizerSettings' fields (lr, clip_grad, decay_style, ...); ``engine="deepspeed"``: ZeRO at
    ``zero_stage``."""
    from megatron_ext.training.run import build_engine

    return build_engine(chunks, device, step_func, mesh=mesh, optimizer=OptimizerSettings(**optimizer),
                        engine=Engine(engine=engine, use_distributed_optimizer=distributed_optimizer,
                                      zero_stage=zero_stage, ddp_bucket_size=bucket),
                        training=Training(micro_batch_size=micro_batch_size, seq_length=seq_length, seed=seed,
                                          global_batch_size=global_batch_size or micro_batch_size * mesh.dp),
                        fusions=Fusions(gradient_accumulation_fusion=gradient_accumulation_fusion,
                                        compile_layers=compile_layers))
